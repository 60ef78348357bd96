"""Diagonal Fisher statistics: per example, squared gradients of the log-likelihood."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Sized
from typing import Any

import numpy as np

from .._tensors import as_float64
from .._util import matches, progress_bar
from ..data.batches import as_kwargs
from ..files.identity import model_identity
from .file import Statistics

__all__ = ["collect_fisher"]


def collect_fisher(
    model: Any,
    batches: Iterable[Any],
    *,
    labels: str = "predicted",
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    mask_key: str = "attention_mask",
    description: str = "",
    progress: bool = True,
) -> Statistics:
    """Diagonal Fisher: per example, squared gradients of the log-likelihood, summed.

    Parameters
    ----------
    model
        A model whose output has ``.logits`` of shape (batch, classes) (sequence
        classification) or (batch, tokens, classes) (token-level; real tokens only).
    batches
        Iterable of dicts of tensors (``model(**batch)``); with ``labels="gold"`` each must
        hold ``"labels"``.
    labels
        ``"predicted"`` (the model's argmax, the default of Fisher merging) or ``"gold"``.
    include, exclude
        ``fnmatch`` patterns over parameter names.

    Returns
    -------
    Statistics
        ``kind="fisher"``; per parameter Σ over examples of ``(∂ log p(y|x) / ∂θ)²``.
    """
    import torch

    if labels not in ("predicted", "gold"):
        raise ValueError(f"labels: expected 'predicted' or 'gold', got {labels!r}")
    params = {
        n: p
        for n, p in model.named_parameters()
        if (not include or matches(n, include)) and not matches(n, exclude)
    }
    if not params:
        raise ValueError("collect_fisher: no parameter matches the include/exclude patterns")
    sums = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in params.items()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    was_training = model.training
    total = len(batches) if isinstance(batches, Sized) else 0
    bar = progress_bar(total, "Fisher", progress, unit="batch")
    examples = 0
    model.eval()
    try:
        for n, p in model.named_parameters():
            p.requires_grad_(n in params)
        for batch in batches:
            kwargs = as_kwargs(batch)
            gold = kwargs.pop("labels", None)
            if labels == "gold" and gold is None:
                raise ValueError("collect_fisher: labels='gold' but a batch has no 'labels'")
            ref = kwargs.get("input_ids", next(iter(kwargs.values())))
            for i in range(ref.shape[0]):
                one = _example(kwargs, i, ref.shape[0], mask_key)
                model.zero_grad(set_to_none=True)
                logits = model(**one).logits
                wide = logits if logits.dtype == torch.float64 else logits.float()
                logp = torch.log_softmax(wide, dim=-1)
                if labels == "gold":
                    assert gold is not None
                    y = gold[i : i + 1].reshape(logp.shape[:-1]).long()
                else:
                    y = logp.argmax(dim=-1)
                ll = logp.gather(-1, y.unsqueeze(-1)).squeeze(-1)
                if ll.dim() == 2 and mask_key in one:  # token level: real tokens only
                    ll = ll * one[mask_key].to(ll.dtype)
                ll.sum().backward()  # type: ignore[no-untyped-call]
                for n, p in params.items():
                    if p.grad is not None:  # square in the grad's dtype, sum in float64
                        sums[n].add_(p.grad.detach().square())
                examples += 1
            bar.update(1)
    finally:
        model.zero_grad(set_to_none=True)
        for n, p in model.named_parameters():
            p.requires_grad_(flags[n])
        model.train(was_training)
        bar.close()
    if examples == 0:
        raise ValueError("collect_fisher: batches is empty")
    tensors = {f"fisher/{n}": as_float64(s, n) for n, s in sums.items()}
    for n, s in tensors.items():
        if not np.isfinite(s).all():
            raise ValueError(f"collect_fisher: {n} is not finite; check the model and data")
    return Statistics(
        kind="fisher",
        model=model_identity(model),
        data=description,
        parameters={n: {"shape": list(p.shape)} for n, p in params.items()},
        count=float(examples),
        tensors=tensors,
        extra={"labels": labels},
    )


def _example(kwargs: Mapping[str, Any], i: int, b: int, mask_key: str) -> dict[str, Any]:
    """Example ``i`` of a batch, trimmed to its real tokens when padding is on the right."""
    one = {
        k: (v[i : i + 1] if hasattr(v, "shape") and v.dim() > 0 and v.shape[0] == b else v)
        for k, v in kwargs.items()
    }
    mask = one.get(mask_key)
    if mask is not None and mask.dim() == 2:
        length = int(mask.sum())
        if length > 0 and bool(mask[0, :length].all()):
            width = mask.shape[1]
            one = {
                k: (
                    v[:, :length]
                    if hasattr(v, "shape") and v.dim() == 2 and v.shape[1] == width
                    else v
                )
                for k, v in one.items()
            }
    return one
