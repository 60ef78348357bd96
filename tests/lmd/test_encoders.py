"""Sentence embeddings: masked mean pooling, length-sorted batches, encoder checks.

The Hugging Face tests use a tiny BERT built from a config with a tokenizer built from a
vocabulary written by the test (nothing is downloaded). The reference embeds each text
alone, without any padding, and averages its token vectors in float64 in the test.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from lmdx.lmd.encoders import (
    CallableEncoder,
    HFEncoder,
    as_encoder,
    length_sorted_batches,
    mean_pool,
)
from tiny_bert import WORDS, build_tiny_bert

TEXTS = [
    "The cat sat on the mat.",
    "dog",
    "A big red dog ran quickly under the green tree and over the small blue house.",
    "the bird sang",
    "",
    "Cats and dogs ran; birds sang over the houses!",
    "blue",
    "the small cat sat on a big mat and the big dog sat on a small mat",
]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_bert(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="module")
def encoder(tiny_model: Path) -> HFEncoder:
    return HFEncoder(tiny_model, batch_size=3, max_length=32, progress=False)


def _reference(folder: Path, texts: list[str], max_length: int = 32) -> np.ndarray:
    """Each text alone (no padding at all), token vectors averaged in float64."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    model = AutoModel.from_pretrained(str(folder), local_files_only=True).eval()
    rows = []
    with torch.no_grad():
        for text in texts:
            batch = tokenizer([text], truncation=True, max_length=max_length, return_tensors="pt")
            hidden = model(**batch).last_hidden_state[0].double().numpy()
            rows.append(hidden.mean(axis=0))
    return np.array(rows)


# -- mean_pool ---------------------------------------------------------------------------


def test_mean_pool_divides_by_real_tokens_numpy(rng: np.random.Generator) -> None:
    hidden = rng.standard_normal((3, 5, 4))
    mask = np.array([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]])
    pooled = mean_pool(hidden, mask)
    expected = np.array([hidden[i, : mask[i].sum()].mean(axis=0) for i in range(3)])
    np.testing.assert_allclose(pooled, expected, rtol=0, atol=1e-12)
    # Padding values never matter.
    hidden[1, 2:] = 1e6
    np.testing.assert_allclose(mean_pool(hidden, mask)[1], expected[1], rtol=0, atol=1e-12)


def test_mean_pool_torch_matches_numpy(rng: np.random.Generator) -> None:
    torch = pytest.importorskip("torch")
    hidden = rng.standard_normal((4, 6, 3)).astype(np.float32)
    mask = (np.arange(6)[None, :] < np.array([6, 3, 1, 2])[:, None]).astype(np.int64)
    out = mean_pool(torch.from_numpy(hidden), torch.from_numpy(mask))
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    expected = np.array([hidden[i, : mask[i].sum()].astype(np.float64).mean(0) for i in range(4)])
    np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=1e-6)
    bool_mask = torch.from_numpy(mask.astype(bool))
    np.testing.assert_allclose(mean_pool(torch.from_numpy(hidden), bool_mask).numpy(), out.numpy())


def test_mean_pool_errors() -> None:
    with pytest.raises(ValueError, match=r"sequence 1 has no real token"):
        mean_pool(np.ones((2, 3, 4)), np.array([[1, 0, 0], [0, 0, 0]]))
    with pytest.raises(ValueError, match=r"\(batch, tokens, d\)"):
        mean_pool(np.ones((2, 3, 4)), np.ones((2, 4)))


def test_length_sorted_batches_cover_every_index_once() -> None:
    lengths = [3, 9, 1, 9, 4, 4, 7]
    batches = length_sorted_batches(lengths, 3)
    flat = np.concatenate(batches)
    assert sorted(flat.tolist()) == list(range(len(lengths)))
    assert [len(b) for b in batches] == [3, 3, 1]
    assert np.all(np.diff(np.asarray(lengths)[flat]) <= 0)  # longest first
    assert flat.tolist()[:2] == [1, 3]  # stable among equal lengths
    with pytest.raises(ValueError, match="batch_size"):
        length_sorted_batches(lengths, 0)


# -- HFEncoder ---------------------------------------------------------------------------


def test_hf_encoder_matches_unpadded_reference_in_input_order(
    tiny_model: Path, encoder: HFEncoder
) -> None:
    out = encoder(TEXTS)
    assert out.shape == (len(TEXTS), 32) and out.dtype == np.float32
    # batch_size=3 with lengths sorted: most texts share a batch with longer ones.
    np.testing.assert_allclose(out, _reference(tiny_model, TEXTS), rtol=0, atol=1e-5)


def test_hf_encoder_alone_equals_batched_with_longer_texts(tiny_model: Path) -> None:
    encoder = HFEncoder(tiny_model, batch_size=8, max_length=32, progress=False)
    short = "the bird sang"
    alone = encoder([short])[0]
    longer = [TEXTS[2], TEXTS[7], short, TEXTS[5]]
    batched = encoder(longer)
    np.testing.assert_allclose(batched[2], alone, rtol=0, atol=1e-5)
    # Sanity: the padded-length mean (the reference code's convention) would differ.
    assert encoder.token_counts([short])[0] < encoder.token_counts(longer).max()


def test_hf_encoder_batch_size_does_not_change_results(
    tiny_model: Path, encoder: HFEncoder
) -> None:
    one_by_one = HFEncoder(tiny_model, batch_size=1, max_length=32, progress=False)(TEXTS)
    all_at_once = HFEncoder(tiny_model, batch_size=64, max_length=32, progress=False)(TEXTS)
    np.testing.assert_allclose(one_by_one, all_at_once, rtol=0, atol=1e-5)
    reversed_out = encoder(TEXTS[::-1])
    np.testing.assert_allclose(reversed_out[::-1], all_at_once, rtol=0, atol=1e-5)


def test_hf_encoder_truncates_at_max_length(tiny_model: Path) -> None:
    long_text = " ".join(WORDS * 4)
    enc = HFEncoder(tiny_model, max_length=10, progress=False)
    assert enc.token_counts([long_text]).tolist() == [10]
    np.testing.assert_allclose(
        enc([long_text, "dog"]), _reference(tiny_model, [long_text, "dog"], 10), atol=1e-5
    )


def test_hf_encoder_empty_input_and_metadata(tiny_model: Path, encoder: HFEncoder) -> None:
    assert encoder([]).shape == (0, 32)
    assert encoder.dim == 32
    assert encoder.name == tiny_model.name
    assert "HFEncoder" in repr(encoder)


def test_hf_encoder_rejects_non_list_inputs(encoder: HFEncoder) -> None:
    with pytest.raises(TypeError, match="single string"):
        encoder("the cat")
    with pytest.raises(TypeError, match=r"texts\[1\] is int"):
        encoder(["the cat", 3])  # type: ignore[list-item]


def test_hf_encoder_missing_path(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match=r"no-such-model.*does not exist"):
        HFEncoder(missing)
    with pytest.raises(FileNotFoundError, match=r"never downloads"):
        HFEncoder(str(missing))
    with pytest.raises(ValueError, match=r"no config\.json"):
        HFEncoder(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"cannot load model folder"):
        HFEncoder(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"local Hugging Face cache"):
        HFEncoder("no-such-org/no-such-model-lmdx")


def test_hf_encoder_without_transformers(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(
        ImportError, match=r"needs torch and transformers: pip install 'transformers>=4\.40'"
    ):
        HFEncoder(tmp_path, name="m")


def test_hf_encoder_bad_arguments(tiny_model: Path) -> None:
    with pytest.raises(ValueError, match="batch_size"):
        HFEncoder(tiny_model, batch_size=0)
    with pytest.raises(ValueError, match="max_length"):
        HFEncoder(tiny_model, max_length=0)


# -- CallableEncoder / as_encoder ----------------------------------------------------------


def _lengths(texts: list[str]) -> np.ndarray:
    return np.array([[len(t), t.count(" "), 1.0] for t in texts])


def test_callable_encoder_returns_float32_rows() -> None:
    enc = CallableEncoder(_lengths, "lengths")
    out = enc(["ab", "a b c"])
    assert out.dtype == np.float32 and out.flags.c_contiguous
    np.testing.assert_array_equal(out, [[2, 0, 1], [5, 2, 1]])
    assert enc.dim == 3
    assert enc([]).shape == (0, 3)


def test_callable_encoder_accepts_torch_output() -> None:
    torch = pytest.importorskip("torch")
    enc = CallableEncoder(lambda texts: torch.ones(len(texts), 4, requires_grad=True), "t")
    np.testing.assert_array_equal(enc(["x", "y"]), np.ones((2, 4), np.float32))


@pytest.mark.parametrize(
    ("fn", "match"),
    [
        (lambda texts: np.ones((len(texts) + 1, 3)), r"'bad': expected an array of shape \(2, d\)"),
        (lambda texts: np.ones(len(texts)), r"'bad': expected an array of shape \(2, d\)"),
        (lambda texts: np.ones((len(texts), 2, 2)), r"got shape \(2, 2, 2\)"),
        (lambda texts: np.full((len(texts), 3), np.nan), r"'bad': non-finite .* texts \[0, 1\]"),
        (lambda texts: np.array([["a"], ["b"]]), r"'bad': output is not a numeric array"),
        (lambda texts: np.ones((len(texts), 0)), r"'bad': returned 0 columns"),
    ],
)
def test_callable_encoder_validates_output(fn: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        CallableEncoder(fn, "bad")(["a", "b"])


def test_callable_encoder_dimension_must_not_change() -> None:
    enc = CallableEncoder(lambda texts: np.ones((len(texts), len(texts))), "varies")
    enc(["a", "b"])
    with pytest.raises(ValueError, match=r"'varies': returned 3 columns, but 2"):
        enc(["a", "b", "c"])


def test_callable_encoder_failure_names_encoder() -> None:
    def broken(texts: list[str]) -> np.ndarray:
        raise KeyError("no session")

    with pytest.raises(RuntimeError, match=r"encoder 'onnx' failed on 2 texts"):
        CallableEncoder(broken, "onnx")(["a", "b"])
    with pytest.raises(TypeError, match="must be callable"):
        CallableEncoder(42, "x")  # type: ignore[arg-type]


def test_as_encoder() -> None:
    enc = as_encoder(_lengths)
    assert isinstance(enc, CallableEncoder) and enc.name == "_lengths"
    assert as_encoder(enc) is enc
    renamed = as_encoder(enc, "other")
    assert renamed.name == "other" and enc.name == "_lengths"
    with pytest.raises(TypeError, match=r"got ndarray"):
        as_encoder(np.ones((2, 3)), "pre")


def test_as_encoder_loads_model_folders(tiny_model: Path) -> None:
    enc = as_encoder(str(tiny_model), "tiny")
    assert isinstance(enc, HFEncoder) and enc.name == "tiny"
