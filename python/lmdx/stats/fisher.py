"""Diagonal Fisher statistics: per example, squared gradients of the log-likelihood.

How it stays exact without one backward pass per example
--------------------------------------------------------
Each batch runs one forward pass and one backward pass to the *outputs* of the layers that
hold the parameters (not to the parameters). Examples of a batch do not interact in an
eval-mode forward pass, so the rows of example ``b`` in a layer's input ``x`` and output
gradient ``g`` are the rows running ``b`` alone would give (padding rows that the model
masks out get no gradient). A right-padded batch is first cut into sub-batches of similar
lengths, each trimmed to its longest example, so that little padding is computed at all.
Each example's gradient is summed over its tokens *before* it is squared,
``(Σ_t g_t x_tᵀ)²``, never ``Σ_t (g_t x_tᵀ)²``:

* ``nn.Linear`` (weight ``Σ_t g_t x_tᵀ``, bias ``Σ_t g_t``) and Hugging Face ``Conv1D``
  (weight ``Σ_t x_t g_tᵀ``): for a float32/float64 weight used once, the native kernel
  forms each example's products a register tile at a time and squares them there (no
  per-example gradient is stored); otherwise batched matrix products per layer;
* ``nn.Embedding``: per row ``v``, ``Σ_{t: id_t = v} g_t`` over the example's tokens;
* ``nn.LayerNorm``: ``Σ_t g_t ⊙ x̂_t`` and ``Σ_t g_t``;
* any other module without submodules (RMSNorm, ...): the module's own vector-Jacobian
  product per example (``torch.func.vmap`` over ``torch.func.vjp`` of the module).

A parameter used more than once (tied weights, a module called twice) adds its uses per
example before squaring. A parameter this cannot cover exactly falls back to one forward and
backward per example, for that parameter only: a parameter of a module with submodules, one
used outside its own module's forward (every torch call is watched during the forward pass
with a ``TorchFunctionMode``), a layer whose input or output is changed in place afterwards,
a layer whose tensors are not batch-first, or a module that ``vmap`` cannot run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence, Sized
from typing import Any

import numpy as np

from .._errors import MergeError
from .._tensors import as_float64, is_tensor
from .._util import matches, progress_bar
from ..data.batches import as_kwargs
from ..files.identity import model_identity
from ..files.peft import is_peft_model
from ..files.saved import saved_form
from .file import Statistics
from .fisher_gradients import accumulate_squares, contribution_of
from .fisher_plan import FisherPlan

__all__ = ["collect_fisher"]

#: Largest share of padding tokens in a sub-batch of similar lengths (of the real tokens).
_PADDING = 0.25


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
    frozen: bool = False,
) -> Statistics:
    """Diagonal Fisher: per example, squared gradients of the log-likelihood, summed.

    Each example counts as if run alone on its real tokens: the gradient of its summed
    log-likelihood (one label per sequence, or one per real token) is squared per parameter
    and added up over examples in float64. Batches are run batched (see the module
    docstring for how that stays exact); padding, on either side, does not change results.

    Parameters
    ----------
    model
        A model whose output has ``.logits`` of shape (batch, classes) (sequence
        classification) or (batch, tokens, classes) (token-level; real tokens only).
    batches
        Iterable of dicts of tensors (``model(**batch)``); with ``labels="gold"`` each must
        hold ``"labels"`` ((batch,) or (batch, tokens)).
    labels
        ``"predicted"`` (the model's argmax, the default of Fisher merging) or ``"gold"``
        (gold labels below 0, Hugging Face's ignore index -100, are not scored).
    include, exclude
        ``fnmatch`` patterns over **parameter names** (``"*.layer.1.*"``,
        ``"classifier.weight"``), as in ``model.named_parameters()`` — unlike the Gram
        statistics of :func:`lmdx.collect_regmean_stats`, whose patterns match module names.
    mask_key
        The batch key of the 0/1 mask of real tokens.
    description
        The user's description of the data, stored with the statistics.
    progress
        Show a progress bar (one step per batch).
    frozen
        Also collect parameters with ``requires_grad=False``. By default they are skipped
        (a frozen parameter is the same in every fine-tuned model, so there is nothing to
        weight); their names are recorded in ``extra["frozen"]``.

    Returns
    -------
    Statistics
        ``kind="fisher"``; per parameter Σ over examples of ``(∂ log p(y|x) / ∂θ)²``, under
        the names and in the shapes the model's ``save_pretrained`` folder stores it
        (where transformers renames or splits a parameter on saving, its Fisher is
        converted the same way; :mod:`lmdx.files.saved`).
    """
    import torch

    if labels not in ("predicted", "gold"):
        raise ValueError(f"labels: expected 'predicted' or 'gold', got {labels!r}")
    if is_peft_model(model):
        raise MergeError(
            "collect_fisher: a PEFT LoRA model; Fisher merging of adapters is not supported: "
            "merge the adapter into its base first (merge_and_unload()) and collect on that"
        )
    chosen = {
        n: p
        for n, p in model.named_parameters()
        if (not include or matches(n, include)) and not matches(n, exclude)
    }
    skipped = [] if frozen else sorted(n for n, p in chosen.items() if not p.requires_grad)
    params = {n: p for n, p in chosen.items() if n not in skipped}
    if not chosen:
        example = next((n for n, _ in model.named_parameters()), "")
        raise ValueError(
            "collect_fisher: no parameter matches the include/exclude patterns (Fisher "
            f"patterns match parameter names such as {example!r}, not module names)"
        )
    if not params:
        raise ValueError(
            "collect_fisher: every parameter that matches the include/exclude patterns is "
            "frozen (requires_grad=False); pass frozen=True to collect them anyway"
        )
    sums = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in params.items()}
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    was_training = model.training
    total = len(batches) if isinstance(batches, Sized) else 0
    bar = progress_bar(total, "Fisher", progress, unit="batch")
    examples = 0
    plan = FisherPlan(model, params)
    model.eval()
    try:
        for n, p in model.named_parameters():
            p.requires_grad_(n in params)
        plan.attach()
        for batch in batches:
            kwargs = as_kwargs(batch)
            gold = kwargs.pop("labels", None)
            if labels == "gold" and gold is None:
                raise ValueError("collect_fisher: labels='gold' but a batch has no 'labels'")
            ref = kwargs.get("input_ids", next(iter(kwargs.values())))
            size = int(ref.shape[0])
            if len(plan.loop) < len(params):
                for part, part_gold, part_size in _length_groups(kwargs, gold, mask_key, size):
                    plan.loop |= _batched(
                        plan, model, part, part_gold, labels, mask_key, part_size, sums
                    )
            if plan.loop:
                _per_example(plan, model, kwargs, gold, labels, mask_key, size, sums)
            examples += size
            bar.update(1)
    finally:
        plan.detach()
        model.zero_grad(set_to_none=True)
        for n, p in model.named_parameters():
            p.requires_grad_(flags[n])
        model.train(was_training)
        bar.close()
    if examples == 0:
        raise ValueError("collect_fisher: batches is empty")
    identity = model_identity(model)
    sums = saved_form(model, sums)  # keyed and shaped as the saved checkpoint's tensors
    unsaved = [n for n in sums if n not in identity["parameters"]]
    if unsaved:
        raise ValueError(
            f"collect_fisher: the Fisher of {unsaved[0]!r} has no tensor of the saved model to "
            "go with (transformers converts it on saving only together with parameters left "
            "out); include them, or exclude every parameter of that module"
        )
    tensors = {f"fisher/{n}": as_float64(s, n) for n, s in sums.items()}
    for n, s in tensors.items():
        if not np.isfinite(s).all():
            raise ValueError(f"collect_fisher: {n} is not finite; check the model and data")
    return Statistics(
        kind="fisher",
        model=identity,
        data=description,
        parameters={n: {"shape": list(s.shape)} for n, s in sums.items()},
        count=float(examples),
        tensors=tensors,
        extra={"labels": labels, "frozen": skipped},
    )


# --------------------------------------------------------------------------- log-likelihood


def _log_likelihood(logits: Any, gold: Any, labels: str, mask: Any) -> Any:
    """Per example (batch,) or per token (batch, tokens) log p(y|x); 0 where not scored."""
    import torch

    wide = logits if logits.dtype == torch.float64 else logits.float()
    logp = torch.log_softmax(wide, dim=-1)
    if labels == "gold":
        gold = torch.as_tensor(gold)
        if gold.numel() != logp[..., 0].numel():
            raise ValueError(
                f"collect_fisher: labels of shape {tuple(gold.shape)} do not fit logits of "
                f"shape {tuple(logits.shape)} (one label per example or per token)"
            )
        y = gold.reshape(logp.shape[:-1]).long()
    else:
        y = logp.argmax(dim=-1)
    ll = logp.gather(-1, y.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    ll = torch.where(y >= 0, ll, torch.zeros_like(ll))
    if ll.dim() == 2 and mask is not None and tuple(mask.shape) == tuple(ll.shape):
        ll = ll * mask.to(ll.dtype)  # token level: real tokens only
    return ll


def _token_mask(kwargs: Mapping[str, Any], mask_key: str, size: int) -> Any:
    mask: Any = kwargs.get(mask_key)
    if is_tensor(mask) and mask.dim() == 2 and mask.shape[0] == size:
        return mask
    return None


# --------------------------------------------------------------------------- batched path


def _batched(
    plan: FisherPlan,
    model: Any,
    kwargs: dict[str, Any],
    gold: Any,
    labels: str,
    mask_key: str,
    size: int,
    sums: dict[str, Any],
) -> set[str]:
    """Add a batch's per-example squared gradients into ``sums`` for every parameter not in
    ``plan.loop``; return the parameters found to need the per-example loop instead."""
    import torch

    mask = _token_mask(kwargs, mask_key, size)
    plan.calls.clear()
    plan.active.clear()
    plan.misused.clear()
    plan.size = size
    plan.recording = True
    try:
        with plan.watcher():
            logits = model(**kwargs).logits
    finally:
        plan.recording = False
    ll = _log_likelihood(logits, gold, labels, mask)
    bad = set(plan.misused)
    calls = []
    for call in plan.calls:
        tensors = [a for a in (*call.args, *call.kwargs.values(), call.output) if is_tensor(a)]
        names = plan.names(call.module)
        if [t._version for t in tensors] != call.versions or not is_tensor(call.output):
            bad.update(names)
        elif call.output.requires_grad and not bad.issuperset(names):
            calls.append(call)
    grads: Sequence[Any] = []
    if calls and ll.requires_grad:
        outputs = [c.output for c in calls]
        grads = torch.autograd.grad(ll.sum(), outputs, allow_unused=True)
    work = []
    for call, g in zip(calls, grads, strict=True):
        if g is None:
            continue
        _, kind, entries = plan.modules[id(call.module)]
        wanted = {local: name for local, name in entries if name not in plan.loop}
        if not wanted:
            continue
        contribution = contribution_of(kind, call, g.detach(), size, wanted)
        if contribution is None:
            bad.update(wanted.values())
        else:
            work.append(contribution)
    work = [w for w in work if not bad.issuperset(w.wanted.values())]
    for w in work:
        w.wanted = {k: v for k, v in w.wanted.items() if v not in bad}
    accumulate_squares(work, size, sums)
    return bad


# --------------------------------------------------------------------------- per-example loop


def _per_example(
    plan: FisherPlan,
    model: Any,
    kwargs: dict[str, Any],
    gold: Any,
    labels: str,
    mask_key: str,
    size: int,
    sums: dict[str, Any],
) -> None:
    """One forward and backward per example (on its real tokens) for ``plan.loop``."""
    import torch

    names = sorted(plan.loop)
    tensors = [plan.params[n] for n in names]
    both = kwargs if gold is None else {**kwargs, "labels": gold}
    for i in range(size):
        one = _example(both, i, size, mask_key)
        y = one.pop("labels", None)
        ll = _log_likelihood(model(**one).logits, y, labels, one.get(mask_key))
        if not ll.requires_grad:
            continue
        grads = torch.autograd.grad(ll.sum(), tensors, allow_unused=True)
        for n, g in zip(names, grads, strict=True):
            if g is not None:  # square in the grad's dtype, sum in float64
                sums[n].add_(g.detach().square())


def _length_groups(
    kwargs: dict[str, Any], gold: Any, mask_key: str, size: int
) -> list[tuple[dict[str, Any], Any, int]]:
    """A right-padded batch as sub-batches of similar lengths, each cut to its longest
    example (examples do not interact, so this changes no result, only the padding work);
    any other batch as it is. Lengths are taken longest first; a group closes when one more
    example would make it more than :data:`_PADDING` padding."""
    import torch

    mask = _token_mask(kwargs, mask_key, size)
    if mask is None or size < 2:
        return [(kwargs, gold, size)]
    lengths = mask.sum(1)
    width = mask.shape[1]
    prefix = torch.arange(width, device=mask.device).unsqueeze(0) < lengths.unsqueeze(1)
    if not bool((mask.bool() == prefix).all()) or not bool((lengths > 0).all()):
        return [(kwargs, gold, size)]
    order = [int(i) for i in torch.argsort(lengths, descending=True, stable=True)]
    groups: list[list[int]] = []
    real = 0
    for i in order:
        n = int(lengths[i])
        if groups and (len(groups[-1]) + 1) * int(lengths[groups[-1][0]]) <= (1 + _PADDING) * (
            real + n
        ):
            groups[-1].append(i)
            real += n
        else:
            groups.append([i])
            real = n
    if len(groups) == 1 and int(lengths[order[0]]) == width:
        return [(kwargs, gold, size)]
    both = kwargs if gold is None else {**kwargs, "labels": gold}
    out = []
    for rows in groups:
        index = torch.tensor(sorted(rows))
        cut = int(lengths[rows[0]])
        part = {}
        for k, v in both.items():
            if is_tensor(v) and v.dim() > 0 and v.shape[0] == size:
                v = v.index_select(0, index.to(v.device))
                if v.dim() == 2 and v.shape[1] == width:
                    v = v[:, :cut]
            part[k] = v
        out.append((part, part.pop("labels", None), len(rows)))
    return out


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
