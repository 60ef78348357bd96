"""Diagonal Fisher, the per-example gradients of a batch: from the recorded calls of its
layers (a layer's inputs and its output gradient), a block of parameter rows at a time,
squared per example and summed in float64 (:func:`accumulate_squares`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import _core
from .._tensors import is_tensor
from .fisher_plan import ModuleCall

__all__ = ["Contribution", "accumulate_squares", "contribution_of"]

#: Bytes of per-example gradients made at once (one block of parameter rows).
_BLOCK_BYTES = 16 << 20
#: Examples whose float32 squares are summed in float32 before they are added in float64.
_FLOAT32_TERMS = 16


@dataclass
class Contribution:
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
        those sums added in float64, as :func:`accumulate_squares` does; torch's thread count).
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


def contribution_of(
    kind: str, call: ModuleCall, g: Any, size: int, wanted: dict[str, str]
) -> Contribution | None:
    """The per-example gradient source of one call, or None when its tensors are not
    batch-first (or ``vmap`` cannot run the module)."""
    if g.dim() == 0 or g.shape[0] != size:
        return None
    if kind == "module":
        extra = _vjp_source(call, g, size, wanted)
        return None if extra is None else Contribution(kind, call.module, None, g, wanted, extra)
    x: Any = call.args[0] if call.args else None
    if not is_tensor(x) or x.dim() == 0 or x.shape[0] != size:
        return None
    x = x.detach()
    if kind == "embedding" and tuple(g.shape[: x.dim()]) != tuple(x.shape):
        return None
    if kind in ("linear", "conv1d") and x.shape[:-1] != g.shape[:-1]:
        return None
    if kind == "layer_norm" and x.shape != g.shape:
        return None
    return Contribution(kind, call.module, x, g, wanted)


def _vjp_source(call: ModuleCall, g: Any, size: int, wanted: dict[str, str]) -> Any:
    """A function (lo, hi) -> {local name: per-example gradients} from the module's own
    vector-Jacobian product, vmapped over examples; None if vmap cannot run it."""
    from torch.func import functional_call, vjp, vmap

    module = call.module
    args, kwargs = list(call.args), dict(call.kwargs)
    slots = [i for i, a in enumerate(args) if is_tensor(a) and a.dim() and a.shape[0] == size]
    keys = [k for k, a in kwargs.items() if is_tensor(a) and a.dim() and a.shape[0] == size]
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


def accumulate_squares(work: list[Contribution], size: int, sums: dict[str, Any]) -> None:
    """Per parameter: add its contributions per example, square, sum over examples.

    A linear or Conv1D weight used once is summed by the native kernel
    (:meth:`Contribution.add_weight_squares`: no per-example gradient is held). Otherwise
    per-example gradients are made a block of parameter rows at a time (about
    :data:`_BLOCK_BYTES`, so that squaring and summing them stays in cache). Float32 squares
    are summed over at most :data:`_FLOAT32_TERMS` examples in float32 — for positive terms
    within (n − 1)·2⁻²⁴ < 1e-6 relative — and those partial sums are added in float64;
    float64 gradients stay float64 throughout.
    """
    import torch

    uses: dict[str, list[tuple[Contribution, str]]] = {}
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
