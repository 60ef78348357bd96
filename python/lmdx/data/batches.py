"""Batches for ``model(**batch)``: texts tokenized and padded, or batches given as they are."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["as_kwargs", "text_batches"]


def text_batches(
    texts: Sequence[str],
    tokenizer: Any,
    *,
    batch_size: int = 16,
    max_length: int | None = 128,
    labels: Sequence[int] | None = None,
) -> list[dict[str, Any]]:
    """Tokenize ``texts`` into padded batches (dicts of tensors for ``model(**batch)``),
    cut at ``max_length`` tokens (None: the tokenizer's ``model_max_length``).

    ``labels`` (integers), when given, are added to each batch as ``"labels"``.
    """
    import torch

    texts = list(texts)
    if labels is not None and len(labels) != len(texts):
        raise ValueError(f"labels: {len(labels)} labels for {len(texts)} texts")
    out = []
    for start in range(0, len(texts), batch_size):
        chunk = texts[start : start + batch_size]
        enc = tokenizer(
            chunk, padding=True, truncation=True, max_length=max_length, return_tensors="pt"
        )
        batch = dict(enc)
        if labels is not None:
            batch["labels"] = torch.as_tensor(list(labels[start : start + batch_size]))
        out.append(batch)
    return out


def as_kwargs(batch: Any) -> dict[str, Any]:
    if isinstance(batch, Mapping):
        return dict(batch)
    if hasattr(batch, "dim"):  # a tensor of input ids
        return {"input_ids": batch}
    raise TypeError(
        f"batches: expected dicts of tensors (model(**batch)) or input-id tensors, "
        f"got {type(batch).__name__}"
    )
