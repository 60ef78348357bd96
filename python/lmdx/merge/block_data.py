"""RegMean++'s data: each model's texts or batches as the batches its blocks run on.

Each model's statistics may have been collected on data of its own shape (its own
``max_length``, ``max_texts``), so besides the options for all models a model's entry can
carry its own (:func:`prepare_batches`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

from .._errors import MergeError
from .._util import parse_size
from ..data.batches import as_kwargs, text_batches
from .source import TensorSource

__all__ = ["MODEL_DATA_OPTIONS", "activation_budget", "prepare_batches"]

#: The options one model's data entry may set for itself, next to its ``texts``
#: (``{"texts": [...], "max_length": 64}``); the others use the options given for all.
MODEL_DATA_OPTIONS = ("max_texts", "max_length")


def prepare_batches(
    sources: Sequence[TensorSource],
    data: Sequence[Any],
    tokenizer: Any = None,
    *,
    max_texts: int | None = None,
    max_length: int = 128,
    batch_size: int = 16,
) -> list[list[dict[str, Any]]]:
    """Each model's data as batches for ``model(**batch)``.

    ``data[i]`` is model ``i``'s texts (tokenized with ``tokenizer`` — one for all, or a
    list with one per model — or else the tokenizer in model ``i``'s folder: at most
    ``max_texts`` texts, cut at ``max_length`` tokens, ``batch_size`` per batch, padded),
    or its texts with options of its own, ``{"texts": [...], "max_length": 64,
    "max_texts": 500}`` (:data:`MODEL_DATA_OPTIONS`; e.g. the length its statistics were
    collected with; an option it leaves out or sets to None is the one for all), or its
    batches (dicts of tensors, or input-id tensors; used as they are, ``labels`` dropped).
    """
    data = list(data)  # one entry per model: checked by lmdx.merge.inputs.check_needs
    for key, value in (
        ("max_texts", max_texts),
        ("max_length", max_length),
        ("batch_size", batch_size),
    ):
        if value is not None or key != "max_texts":
            _check_count(key, value)
    tokenizers = list(tokenizer) if isinstance(tokenizer, (list, tuple)) else None
    if tokenizers is not None and len(tokenizers) != len(sources):
        raise MergeError(f"tokenizer: {len(tokenizers)} tokenizers for {len(sources)} models")
    out = []
    for i, (source, items) in enumerate(zip(sources, data, strict=True)):
        options: dict[str, Any] = {"max_texts": max_texts, "max_length": max_length}
        if isinstance(items, Mapping):
            items = _own_options(items, options, f"data[{i}] (of {source.label})")
        if isinstance(items, (str, bytes, os.PathLike)) or not isinstance(items, Sequence):
            raise MergeError(
                f"data[{i}] (of {source.label}): expected a list of texts or of batches, or "
                f"{{'texts': [...], 'max_length': ...}}, got {type(items).__name__}"
            )
        if not items:
            raise MergeError(f"data[{i}] (of {source.label}): no texts or batches")
        if all(isinstance(x, str) for x in items):
            tok = tokenizers[i] if tokenizers is not None else tokenizer
            limit = options["max_texts"]
            texts = list(items)[:limit] if limit else list(items)
            out.append(
                text_batches(
                    texts,
                    tok if tok is not None else _folder_tokenizer(source, i),
                    batch_size=int(batch_size),
                    max_length=int(options["max_length"]),
                )
            )
            continue
        batches = []
        for item in items:
            try:
                kwargs = as_kwargs(item)
            except TypeError as exc:
                raise MergeError(f"data[{i}] (of {source.label}): {exc}") from None
            kwargs.pop("labels", None)
            batches.append(kwargs)
        out.append(batches)
    return out


def _check_count(key: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise MergeError(f"{key}: expected a whole number >= 1, got {value!r}")


def _own_options(entry: Mapping[str, Any], options: dict[str, Any], where: str) -> Any:
    """The texts of a model's data entry ``{"texts": [...], option: value, ...}``; its own
    options (checked) replace those in ``options``."""
    unknown = sorted(str(k) for k in entry if k != "texts" and k not in MODEL_DATA_OPTIONS)
    if unknown:
        raise MergeError(
            f"{where}: unknown key {unknown[0]!r}; a model's data entry takes texts and "
            f"{', '.join(MODEL_DATA_OPTIONS)} (its batches go in a list)"
        )
    texts = entry.get("texts")
    if (
        isinstance(texts, (str, bytes))
        or not isinstance(texts, Sequence)
        or not all(isinstance(t, str) for t in texts)
    ):
        raise MergeError(f"{where}: 'texts' must be a list of texts, got {type(texts).__name__}")
    for key in MODEL_DATA_OPTIONS:
        value = entry.get(key)
        if value is not None:
            _check_count(f"{where}: {key}", value)
            options[key] = value
    return texts


def _folder_tokenizer(source: TensorSource, i: int) -> Any:
    from transformers import AutoTokenizer

    if source.path is None or not source.path.is_dir():
        raise MergeError(
            f"data[{i}] (of {source.label}) holds texts but the model has no folder to load a "
            "tokenizer from; pass tokenizer=... or batches"
        )
    try:
        return AutoTokenizer.from_pretrained(str(source.path))
    except (OSError, ValueError) as exc:
        raise MergeError(
            f"model {source.path}: no tokenizer to tokenize data[{i}] with ({exc}); pass "
            "tokenizer=... or batches"
        ) from None


def activation_budget(max_activation_memory: int | str | None) -> int | None:
    """``max_activation_memory`` in bytes (None: hold every activation)."""
    if max_activation_memory is None:
        return None
    try:
        return parse_size(max_activation_memory)
    except ValueError:
        raise MergeError(
            f"max_activation_memory: expected e.g. '4GB' or bytes, got {max_activation_memory!r}"
        ) from None
