"""The strict safetensors reader and the JSON/YAML parser: files that the safetensors
library rejects are rejected too, and every bad document is one error naming the file."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from lmdx import LmdxError
from lmdx.files.parse import parse_json, read_json, read_yaml
from lmdx.files.safetensors import read_safetensors_header
from safetensors import safe_open
from safetensors.numpy import save_file


class Bad(LmdxError):
    pass


def _good(tmp_path: Path) -> bytes:
    path = tmp_path / "good.safetensors"
    save_file({"a": np.arange(4, dtype=np.float32), "b": np.ones(2, np.float64)}, str(path))
    return path.read_bytes()


def _split(raw: bytes) -> tuple[dict, bytes]:
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _join(header: dict | bytes, data: bytes) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + data


def _variants(raw: bytes) -> dict[str, tuple[bytes, str]]:
    header, data = _split(raw)

    def edited(**changes: list[int]) -> dict:
        h = json.loads(json.dumps(header))
        for name, offsets in changes.items():
            h[name]["data_offsets"] = offsets
        return h

    first, second = ("a", "b") if header["a"]["data_offsets"][0] == 0 else ("b", "a")
    f, s = header[first]["data_offsets"], header[second]["data_offsets"]
    shifted = edited(**{first: [f[0] + 8, f[1] + 8], second: [s[0] + 8, s[1] + 8]})
    overlap = edited(**{second: [s[0] - 4, s[1] - 4]})
    return {
        # every tensor read 8 bytes off: the first 8 data bytes belong to no tensor
        "gap": (_join(shifted, data + bytes(8)), "leaves a gap"),
        "overlap": (_join(overlap, data[:-4]), "overlaps another tensor"),
        "trailing": (_join(header, data + bytes(8)), "8 bytes after the last tensor"),
        "short": (_join(header, data[:-1]), "end at byte"),
        "dtype-list": (_join(_with(header, first, dtype=["F32"]), data), "is malformed"),
        "shape-beyond-int64": (
            _join(_with(header, first, shape=[2**64, 1]), data),
            "is malformed",
        ),
        "shape-bool": (_join(_with(header, first, shape=[True, 4]), data), "is malformed"),
        "extra-field": (_join(_with(header, first, offsets=[0]), data), "is malformed"),
        "metadata-not-strings": (
            _join({**header, "__metadata__": {"format": 1}}, data),
            "__metadata__ is not an object of strings",
        ),
        "nested": (_join(b"{" + b'"a":[' * 50_000 + b"]" * 50_000 + b"}", data), "nested"),
        "duplicate-key": (
            _join(
                json.dumps(header).encode()[:-1]
                + b',"a":'
                + json.dumps(header["a"]).encode()
                + b"}",
                data,
            ),
            "given twice",
        ),
        "not-utf8": (_join(b'{"\xff":1}', data), "not UTF-8"),
        "not-an-object": (_join(b"[1, 2]", data), "not a JSON object"),
    }


def _with(header: dict, name: str, **fields: object) -> dict:
    h = json.loads(json.dumps(header))
    h[name].update(fields)
    return h


CASES = (
    "gap",
    "overlap",
    "trailing",
    "short",
    "dtype-list",
    "shape-beyond-int64",
    "shape-bool",
    "extra-field",
    "metadata-not-strings",
    "nested",
    "duplicate-key",
    "not-utf8",
    "not-an-object",
)


@pytest.mark.parametrize("case", CASES)
def test_the_reader_refuses_what_the_safetensors_library_refuses(case: str, tmp_path: Path) -> None:
    variants = _variants(_good(tmp_path))
    assert set(variants) == set(CASES)
    data, what = variants[case]
    path = tmp_path / f"{case}.safetensors"
    path.write_bytes(data)
    if case not in ("duplicate-key", "extra-field", "shape-bool"):
        # the reference library refuses these as well (it has no opinion on the others)
        with pytest.raises(Exception):  # noqa: B017 - its error types vary by version
            with safe_open(str(path), "np") as f:
                for k in f.keys():
                    f.get_tensor(k)
    with pytest.raises(Bad, match=str(path)) as info:
        read_safetensors_header(path, "test file", Bad)
    assert what in str(info.value)
    assert "\n" not in str(info.value)


def test_the_reader_takes_what_the_library_writes(tmp_path: Path) -> None:
    path = tmp_path / "ok.safetensors"
    arrays = {
        "a": np.arange(6, dtype=np.float32).reshape(2, 3),
        "empty": np.zeros((0, 3), np.float16),
        "i": np.arange(3, dtype=np.int64),
    }
    save_file(arrays, str(path), metadata={"k": "v"})
    handle = read_safetensors_header(path)
    assert handle.metadata() == {"k": "v"}
    for name, arr in arrays.items():
        np.testing.assert_array_equal(handle.get_tensor(name), arr)


def test_json_documents_are_parsed_strictly(tmp_path: Path) -> None:
    with pytest.raises(Bad, match=r"doc is not valid JSON .*NaN"):
        parse_json('{"a": NaN}', "doc", Bad)
    assert parse_json('{"a": NaN}', "doc", Bad, allow_nonfinite=True)["a"] != 0
    with pytest.raises(Bad, match="nested too deeply"):
        parse_json("[" * 100_000 + "]" * 100_000, "doc", Bad)
    with pytest.raises(Bad, match="int"):
        parse_json("1" * 5000, "doc", Bad)
    path = tmp_path / "index.json"
    path.write_bytes(b'{"weight_map": "\xff"}')
    with pytest.raises(Bad, match=rf"index {path} is not UTF-8"):
        read_json(path, "index", Bad)


def test_yaml_aliases_are_refused(tmp_path: Path) -> None:
    bomb = 'a: &a ["x","x","x","x","x","x","x","x","x"]\n' + "".join(
        f"{c}: &{c} [*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p},*{p}]\n"
        for p, c in zip("abcdefgh", "bcdefghi", strict=True)
    )
    path = tmp_path / "bomb.yaml"
    path.write_text(bomb)
    with pytest.raises(Bad, match=rf"config {path}: cannot parse \(aliases .* not allowed"):
        read_yaml(path, "config", Bad)
    path.write_text("a: &x 1\nb: 2\n")  # an anchor nobody refers to is harmless
    assert read_yaml(path, "config", Bad) == {"a": 1, "b": 2}
    path.write_bytes(b"method: \xff\n")
    with pytest.raises(Bad, match=rf"config {path} is not UTF-8"):
        read_yaml(path, "config", Bad)
