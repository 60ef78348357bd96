"""Files: safetensors written tensor by tensor to a temporary name, atomic directories.

A safetensors file is an 8-byte little-endian header length, a JSON header (name ->
dtype, shape, byte range; plus ``__metadata__``, a str -> str map) and the raw bytes.
Because every shape is known before any data exists, :func:`write_safetensors` writes
the header first and then asks for one tensor at a time, so a file of many large
tensors never needs them all in memory. Files are read back tensor by tensor with plain
reads (:func:`read_safetensors_header`), not memory maps, so what was read and dropped
does not stay resident; no pickle anywhere.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

__all__ = [
    "atomic_directory",
    "file_sha256",
    "read_safetensors_header",
    "write_safetensors",
]

_DTYPES: dict[str, str] = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "int64": "I64",
    "int32": "I32",
    "uint8": "U8",
}


class TensorSpec:
    """Name, NumPy dtype and shape of one tensor of a file being written."""

    __slots__ = ("dtype", "name", "shape")

    def __init__(self, name: str, dtype: Any, shape: Sequence[int]) -> None:
        self.name = name
        self.dtype = np.dtype(dtype)
        self.shape = tuple(int(s) for s in shape)
        if self.dtype.name not in _DTYPES:
            raise ValueError(f"{name}: dtype {self.dtype} cannot be written")

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * int(self.dtype.itemsize)


def write_safetensors(
    path: str | os.PathLike[str],
    specs: Sequence[TensorSpec],
    produce: Callable[[str], NDArray[Any]],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write a safetensors file tensor by tensor, atomically.

    ``produce(name)`` is called once per spec, in order, and must return an array of the
    announced dtype and shape. The file appears at ``path`` only when complete; on any
    error the temporary file is removed and ``path`` is untouched.
    """
    path = Path(path)
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for spec in specs:
        if spec.name in header:
            raise ValueError(f"{path}: tensor {spec.name!r} listed twice")
        header[spec.name] = {
            "dtype": _DTYPES[spec.dtype.name],
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with atomic_file(path) as tmp, open(tmp, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for spec in specs:
            arr = np.asarray(produce(spec.name))
            if arr.dtype != spec.dtype or arr.shape != spec.shape:
                raise ValueError(
                    f"{path}: tensor {spec.name!r} announced as {spec.dtype}{list(spec.shape)}, "
                    f"got {arr.dtype}{list(arr.shape)}"
                )
            little = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<"), copy=False)
            f.write(little.tobytes() if little.ndim == 0 else memoryview(little.reshape(-1)))  # type: ignore[arg-type]


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it to ``path`` if the block succeeds."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path}: is a directory; give a file name")
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty temporary directory beside ``path``; rename it to ``path`` on success.

    ``path`` must not exist (nothing the user has is replaced). On any error, including
    KeyboardInterrupt, the temporary directory is removed.
    """
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path}: already exists; choose a new output directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield tmp
        if path.exists():
            raise FileExistsError(f"{path}: appeared while writing; the output is left at {tmp}")
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


_NUMPY_OF: dict[str, str] = {v: k for k, v in _DTYPES.items()}


class SafetensorsFile:
    """A safetensors file read with plain reads (no memory map, so tensors read and
    dropped do not stay resident), its header validated against the file size."""

    def __init__(self, path: Path, entries: dict[str, Any], data_start: int, meta: Any) -> None:
        self.path = path
        self._entries = entries
        self._data_start = data_start
        self._metadata = meta

    def metadata(self) -> dict[str, str]:
        return dict(self._metadata or {})

    def keys(self) -> list[str]:
        return list(self._entries)

    def shape(self, name: str) -> list[int]:
        return list(self._entries[name]["shape"])

    def get_tensor(self, name: str) -> NDArray[Any]:
        e = self._entries[name]
        dtype = np.dtype(_NUMPY_OF[e["dtype"]]).newbyteorder("<")
        count = int(np.prod(e["shape"], dtype=np.int64))
        arr = np.fromfile(
            self.path, dtype=dtype, count=count, offset=self._data_start + e["data_offsets"][0]
        )
        if arr.size != count:
            raise ValueError(f"{self.path}: tensor {name!r} is cut short")
        out: NDArray[Any] = arr.reshape(e["shape"]).astype(dtype.newbyteorder("="), copy=False)
        return out


def read_safetensors_header(
    path: str | os.PathLike[str], what: str = "file", error: type[Exception] = ValueError
) -> SafetensorsFile:
    """Parse and check a safetensors header (dtypes, shapes, byte ranges within the file);
    ``error`` names the file and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{what} {path}: no such file")

    def fail(msg: str) -> Exception:
        return error(f"{what} {path}: {msg}; the file is truncated, corrupted or of another format")

    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise fail(f"only {size} bytes")
        n = int.from_bytes(prefix, "little")
        if n < 2 or 8 + n > size:
            raise fail(f"header length {n} does not fit in {size} bytes")
        try:
            header = json.loads(f.read(n).decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise fail(f"header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise fail("header is not a JSON object")
    meta = header.pop("__metadata__", None)
    if meta is not None and not isinstance(meta, dict):
        raise fail("__metadata__ is not an object")
    data_start = 8 + n
    for name, e in header.items():
        ok = (
            isinstance(e, dict)
            and e.get("dtype") in _NUMPY_OF
            and isinstance(e.get("shape"), list)
            and all(isinstance(d, int) and d >= 0 for d in e["shape"])
            and isinstance(e.get("data_offsets"), list)
            and len(e["data_offsets"]) == 2
            and all(isinstance(o, int) for o in e["data_offsets"])
        )
        if not ok:
            raise fail(f"entry {name!r} of the header is malformed")
        begin, end = e["data_offsets"]
        nbytes = int(np.prod(e["shape"], dtype=np.int64)) * np.dtype(_NUMPY_OF[e["dtype"]]).itemsize
        if end - begin != nbytes or begin < 0:
            raise fail(f"tensor {name!r}: byte range does not match its shape")
        if data_start + end > size:
            raise fail(f"tensor {name!r} ends at byte {data_start + end} of {size}")
    return SafetensorsFile(path, header, data_start, meta)


def file_sha256(path: str | os.PathLike[str], chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
