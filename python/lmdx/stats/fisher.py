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
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _core
from .._errors import MergeError
from .._tensors import as_float64
from .._util import matches, progress_bar
from ..data.batches import as_kwargs
from ..files.identity import model_identity
from ..files.peft import is_peft_model
from ..files.saved import saved_form
from .file import Statistics

__all__ = ["collect_fisher"]

#: Bytes of per-example gradients made at once (one block of parameter rows).
_BLOCK_BYTES = 16 << 20
#: Examples whose float32 squares are summed in float32 before they are added in float64.
_FLOAT32_TERMS = 16
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
    plan = _Plan(model, params)
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


# --------------------------------------------------------------------------- the plan


def _kind(module: Any) -> str | None:
    """How a module's own parameters get per-example gradients, or None (per-example loop)."""
    import torch

    cls = type(module)
    if cls is torch.nn.Linear:
        return "linear"
    if cls.__name__ == "Conv1D" and cls.__module__ == "transformers.pytorch_utils":
        return "conv1d"
    if cls is torch.nn.Embedding and module.max_norm is None and not module.scale_grad_by_freq:
        return "embedding"
    if cls is torch.nn.LayerNorm:
        return "layer_norm"
    if next(module.children(), None) is None:
        return "module"
    return None


@dataclass
class _Call:
    """One forward call of a watched module during a batch."""

    module: Any
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any
    versions: list[int]


@dataclass
class _Plan:
    """Which module computes which parameter's per-example gradient, the hooks that record
    the calls of a batch, and the parameters that need the per-example loop."""

    model: Any
    params: Mapping[str, Any]
    #: id(module) -> (module, kind, [(local name, parameter name)])
    modules: dict[int, tuple[Any, str, list[tuple[str, str]]]] = field(default_factory=dict)
    #: id(parameter) -> (parameter name, ids of the modules allowed to use it)
    owners: dict[int, tuple[str, set[int]]] = field(default_factory=dict)
    loop: set[str] = field(default_factory=set)
    calls: list[_Call] = field(default_factory=list)
    active: list[int] = field(default_factory=list)
    misused: set[str] = field(default_factory=set)
    recording: bool = False
    size: int = 0
    handles: list[Any] = field(default_factory=list)

    def __post_init__(self) -> None:
        ids = {id(p): n for n, p in self.params.items()}
        for module in self.model.modules():
            for local, p in module.named_parameters(recurse=False):
                name = ids.get(id(p))
                if name is None:
                    continue
                kind = _kind(module)
                if kind is None:
                    self.loop.add(name)
                    continue
                entry = self.modules.setdefault(id(module), (module, kind, []))
                entry[2].append((local, name))
                self.owners.setdefault(id(p), (name, set()))[1].add(id(module))

    def names(self, module: Any) -> list[str]:
        return [name for _, name in self.modules[id(module)][2]]

    def attach(self) -> None:
        for module, _, _ in self.modules.values():
            self.handles.append(module.register_forward_pre_hook(self._enter))
            self.handles.append(module.register_forward_hook(self._leave, with_kwargs=True))

    def detach(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _enter(self, module: Any, args: Any) -> None:
        self.active.append(id(module))

    def _leave(self, module: Any, args: Any, kwargs: Any, output: Any) -> Any:
        if self.active and self.active[-1] == id(module):
            self.active.pop()
        if not self.recording:
            return None
        kind = self.modules[id(module)][1]
        ids: Any = args[0] if args else None
        if kind == "embedding" and self.size > 1 and _is_tensor(ids) and ids.shape[0] == 1:
            # one row of ids for the whole batch (position ids): the output is broadcast
            # over the batch later, which would sum its gradient over examples; an expanded
            # view (same values) keeps one gradient per example
            ids = ids.expand(self.size, *ids.shape[1:])
            output = output.expand(self.size, *output.shape[1:])
            args = (ids, *args[1:])
        tensors = [a for a in (*args, *kwargs.values(), output) if _is_tensor(a)]
        versions = [t._version for t in tensors]
        self.calls.append(_Call(module, tuple(args), dict(kwargs), output, versions))
        return output

    def watcher(self) -> Any:
        """A TorchFunctionMode noting parameters used (with gradient) outside the forward
        of the modules that own them."""
        from torch.overrides import TorchFunctionMode

        plan = self

        class _Watch(TorchFunctionMode):
            def __torch_function__(
                self, func: Any, types: Any, args: Any = (), kwargs: Any = None
            ) -> Any:
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                if _carries_grad(out):
                    for a in _flat(args, kwargs):
                        owner = plan.owners.get(id(a))
                        if owner is not None and not owner[1].intersection(plan.active):
                            plan.misused.add(owner[0])
                return out

        return _Watch()


def _is_tensor(x: Any) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def _carries_grad(x: Any) -> bool:
    if isinstance(x, (tuple, list)):
        return any(_carries_grad(v) for v in x)
    return _is_tensor(x) and bool(x.requires_grad)


def _flat(args: Any, kwargs: Mapping[str, Any]) -> list[Any]:
    out: list[Any] = []
    for a in (*args, *kwargs.values()):
        if isinstance(a, (tuple, list)):
            out.extend(a)
        else:
            out.append(a)
    return out


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
    if _is_tensor(mask) and mask.dim() == 2 and mask.shape[0] == size:
        return mask
    return None


# --------------------------------------------------------------------------- batched path


def _batched(
    plan: _Plan,
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
        tensors = [a for a in (*call.args, *call.kwargs.values(), call.output) if _is_tensor(a)]
        names = plan.names(call.module)
        if [t._version for t in tensors] != call.versions or not _is_tensor(call.output):
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
        contribution = _contribution(kind, call, g.detach(), size, wanted)
        if contribution is None:
            bad.update(wanted.values())
        else:
            work.append(contribution)
    work = [w for w in work if not bad.issuperset(w.wanted.values())]
    for w in work:
        w.wanted = {k: v for k, v in w.wanted.items() if v not in bad}
    _accumulate(work, size, sums)
    return bad


@dataclass
class _Contribution:
    """One call's per-example gradients of some parameters, computed a block at a time."""

    kind: str
    module: Any
    x: Any
    g: Any
    wanted: dict[str, str]  # local name -> parameter name
    extra: Any = None
    cached: tuple[int, int, dict[str, Any]] | None = None

    def block(self, local: str, lo: int, hi: int, r0: int, r1: int) -> Any:
        """Per-example gradients (hi - lo, r1 - r0, ...) of parameter ``local``, examples
        lo:hi, rows r0:r1 of the parameter."""
        import torch

        m, c = self.module, hi - lo
        if self.kind in ("linear", "conv1d"):
            x = self.x[lo:hi].reshape(c, -1, self.x.shape[-1])
            g = self.g[lo:hi].reshape(c, -1, self.g.shape[-1])
            if local == "bias":
                return g[:, :, r0:r1].sum(1)
            if self.kind == "linear":  # weight [out, in]: Σ_t g_t x_tᵀ
                return torch.bmm(g[:, :, r0:r1].transpose(1, 2), x)
            return torch.bmm(x[:, :, r0:r1].transpose(1, 2), g)  # Conv1D [in, out]
        if self.kind == "layer_norm":
            shape = tuple(m.normalized_shape)
            g = self.g[lo:hi]
            if local == "weight":
                g = g * torch.nn.functional.layer_norm(self.x[lo:hi], shape, None, None, m.eps)
            return g.reshape(c, -1, *shape).sum(1)[:, r0:r1]
        if self.kind == "embedding":
            keys, values = self.sparse(lo, hi)
            rows = int(m.weight.shape[0])
            example, row = keys // rows - lo, keys % rows
            keep = (row >= r0) & (row < r1)
            out = values.new_zeros((c, r1 - r0, values.shape[1]))
            return out.index_put_((example[keep], row[keep] - r0), values[keep], accumulate=True)
        if self.cached is None or self.cached[:2] != (lo, hi):
            self.cached = (lo, hi, self.extra(lo, hi))
        got = self.cached[2][local]
        return got if got.dim() == 1 else got[:, r0:r1]  # a 0-d parameter has no rows

    def add_weight_squares(self, target: Any) -> bool:
        """Add Σ over the examples of the squared per-example gradient of a linear or Conv1D
        weight into ``target`` (its float64 sums, the weight's shape) with the native kernel
        (products and up to :data:`_FLOAT32_TERMS` squares summed in the tensors' precision,
        those sums added in float64, as :func:`_accumulate` does; torch's thread count).
        False, and nothing added, where it does not apply (not float32 or float64 of one
        dtype, or not on the CPU)."""
        import torch

        x, g = self.x, self.g
        if (
            x.dtype != g.dtype
            or x.dtype not in (torch.float32, torch.float64)
            or x.device.type != "cpu"
            or g.device.type != "cpu"
        ):
            return False
        c = x.shape[0]
        xs = x.reshape(c, -1, x.shape[-1]).contiguous().numpy()
        gs = g.reshape(c, -1, g.shape[-1]).contiguous().numpy()
        a, b = (gs, xs) if self.kind == "linear" else (xs, gs)  # [out, in] or [in, out]
        _core.core.sum_squared_products(
            a=a, b=b, out=target.numpy(), n_threads=torch.get_num_threads()
        )
        return True

    def sparse(self, lo: int, hi: int) -> tuple[Any, Any]:
        """Embedding: (example × rows + row) keys and gradient rows of examples lo:hi."""
        import torch

        rows = self.module.weight.shape[0]
        ids = self.x[lo:hi].reshape(hi - lo, -1)
        g = self.g[lo:hi].reshape(hi - lo, ids.shape[1], -1)
        keys = ids + rows * torch.arange(lo, hi, device=ids.device).unsqueeze(1)
        if self.module.padding_idx is None:
            return keys.reshape(-1), g.reshape(-1, g.shape[-1])
        keep = ids != self.module.padding_idx  # that row never gets a gradient
        return keys[keep], g[keep]


def _contribution(
    kind: str, call: _Call, g: Any, size: int, wanted: dict[str, str]
) -> _Contribution | None:
    """The per-example gradient source of one call, or None when its tensors are not
    batch-first (or ``vmap`` cannot run the module)."""
    if g.dim() == 0 or g.shape[0] != size:
        return None
    if kind == "module":
        extra = _vjp_source(call, g, size, wanted)
        return None if extra is None else _Contribution(kind, call.module, None, g, wanted, extra)
    x: Any = call.args[0] if call.args else None
    if not _is_tensor(x) or x.dim() == 0 or x.shape[0] != size:
        return None
    x = x.detach()
    if kind == "embedding" and tuple(g.shape[: x.dim()]) != tuple(x.shape):
        return None
    if kind in ("linear", "conv1d") and x.shape[:-1] != g.shape[:-1]:
        return None
    if kind == "layer_norm" and x.shape != g.shape:
        return None
    return _Contribution(kind, call.module, x, g, wanted)


def _vjp_source(call: _Call, g: Any, size: int, wanted: dict[str, str]) -> Any:
    """A function (lo, hi) -> {local name: per-example gradients} from the module's own
    vector-Jacobian product, vmapped over examples; None if vmap cannot run it."""
    from torch.func import functional_call, vjp, vmap

    module = call.module
    args, kwargs = list(call.args), dict(call.kwargs)
    slots = [i for i, a in enumerate(args) if _is_tensor(a) and a.dim() and a.shape[0] == size]
    keys = [k for k, a in kwargs.items() if _is_tensor(a) and a.dim() and a.shape[0] == size]
    own = dict(module.named_parameters(recurse=False))
    params = {local: own[local].detach() for local in wanted}

    def one(ps: Any, xs: Any, ks: Any, gb: Any) -> Any:
        a, kw = list(args), dict(kwargs)
        for i, t in zip(slots, xs, strict=True):
            a[i] = t.unsqueeze(0)
        for k, t in zip(keys, ks, strict=True):
            kw[k] = t.unsqueeze(0)

        def f(p: Any) -> Any:
            return functional_call(module, p, tuple(a), kw)

        pull = vjp(f, ps)[1]
        return pull(gb.unsqueeze(0))[0]

    def source(lo: int, hi: int) -> Any:
        xs = [args[i][lo:hi].detach() for i in slots]
        ks = [kwargs[k][lo:hi].detach() for k in keys]
        return vmap(one, in_dims=(None, 0, 0, 0))(params, xs, ks, g[lo:hi])

    try:
        source(0, 1)
    except Exception:  # a forward vmap cannot run: the per-example loop takes over
        return None
    return source


def _accumulate(work: list[_Contribution], size: int, sums: dict[str, Any]) -> None:
    """Per parameter: add its contributions per example, square, sum over examples.

    A linear or Conv1D weight used once is summed by the native kernel
    (:meth:`_Contribution.add_weight_squares`: no per-example gradient is held). Otherwise
    per-example gradients are made a block of parameter rows at a time (about
    :data:`_BLOCK_BYTES`, so that squaring and summing them stays in cache). Float32 squares
    are summed over at most :data:`_FLOAT32_TERMS` examples in float32 — for positive terms
    within (n − 1)·2⁻²⁴ < 1e-6 relative — and those partial sums are added in float64;
    float64 gradients stay float64 throughout.
    """
    import torch

    uses: dict[str, list[tuple[_Contribution, str]]] = {}
    for w in work:
        for local, name in w.wanted.items():
            uses.setdefault(name, []).append((w, local))
    for name, parts in uses.items():
        target = sums[name]
        if all(w.kind == "embedding" for w, _ in parts):
            pieces = [w.sparse(0, size) for w, _ in parts]
            keys = torch.cat([k for k, _ in pieces])
            values = torch.cat([v for _, v in pieces])
            unique, inverse = torch.unique(keys, return_inverse=True)
            rows = values.new_zeros((unique.numel(), values.shape[1]))
            rows.index_add_(0, inverse, values)
            target.index_add_(0, unique % target.shape[0], rows.square().to(torch.float64))
            continue
        if len(parts) == 1 and parts[0][0].kind in ("linear", "conv1d") and parts[0][1] == "weight":
            if parts[0][0].add_weight_squares(target):
                continue
        height = int(target.shape[0]) if target.dim() else 1
        row_bytes = 4 * max(1, target.numel() // max(height, 1))
        chunk = min(size, _FLOAT32_TERMS)
        step = max(1, min(height, _BLOCK_BYTES // (row_bytes * chunk)))
        for lo in range(0, size, chunk):
            hi = min(size, lo + chunk)
            for r0 in range(0, height, step):
                r1 = min(height, r0 + step)
                total = None
                for w, local in parts:
                    t = w.block(local, lo, hi, r0, r1)
                    total = t if total is None else total + t
                assert total is not None
                partial = total.square_().sum(0)
                if target.dim():
                    target[r0:r1].add_(partial)
                else:
                    target.add_(partial.reshape(()))
    for w in work:
        w.cached = None


# --------------------------------------------------------------------------- per-example loop


def _per_example(
    plan: _Plan,
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
            if _is_tensor(v) and v.dim() > 0 and v.shape[0] == size:
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
