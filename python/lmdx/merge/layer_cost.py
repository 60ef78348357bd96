"""What one linear layer's merge costs each task, from its statistics: the cost itself
(exact, or estimated in one pass over each Gram), the pull and the share, for K models.
:mod:`lmdx.merge.cost` meters them over a whole merge, flags and reports.

For model i and a linear layer with Gram statistics ``G_i`` over ``n_i`` rows, with
``Ĝ_i = G_i / n_i`` (the mean Gram: model i's own inputs, not reduced by α, so that every
method and every α is measured on one yardstick) and the merged weight ``W`` (``[out,
in]``)::

    cost_i  = ‖W − W_i‖_{Ĝ_i} / ‖W_i‖_{Ĝ_i},      ‖A‖²_Ĝ = tr(A Ĝ Aᵀ)

the relative RMS change of model i's layer outputs on its own statistics' rows (0: the
layer answers task i exactly as model i did). Two numbers say how hard each model pulls:

* ``pull_i = ⟨W − W̄, W_i − W̄⟩_F / ‖W_i − W̄‖²_F`` (``W̄`` the coefficient-weighted
  average): how far the merge moved from the average toward ``W_i`` (0: not at all, 1: all
  the way; 0 where ``W_i`` is the average to within 1e-12 relative);
* ``share_i = tr(Ĝ_i) / Σ_j tr(Ĝ_j)``: model i's share of the statistics' scale, the
  weight its Gram gets in a RegMean system.

**Estimated by default.** ``‖A‖²_Ĝ = tr(A Ĝ Aᵀ)`` (``A = W − W_i`` for the numerator,
``W_i`` for the denominator) is estimated as Hutch++ does (Meyer, Musco, Musco and
Woodruff, SOSA 2021), in one pass over the Gram: ``Q``, :data:`SKETCH` orthonormal columns
spanning ``A``'s dominant left singular directions (a randomized range finder with one
power iteration, on ``A`` alone), gives ``tr(QᵀA G AᵀQ)`` exactly, and the rest is
Hutchinson's estimate on ``(I − QQᵀ)Z`` for :data:`SKETCH` Gaussian columns ``Z``. Whatever
``Q`` is, the estimate is unbiased (``Q`` does not depend on ``Z``); it is exact for ``A``
of rank at most :data:`SKETCH`, and its standard error is estimated from the Hutchinson
samples: each layer's ``error`` (the cost's standard error, 0 where exact, by the delta
method) and each task's ``mean_error`` (of its mean over layers, whose estimates are
independent). The products are ``G·Y`` for ``Y`` of ``2·SKETCH`` columns per term, from
the Grams as the merge read them (packed, mapped, already checked:
:func:`lmdx.moments.gram_product`): ``4·SKETCH·in²`` flops per term instead of the exact
value's ``out·in²``; layers with at most ``2·SKETCH`` outputs or inputs are computed
exactly. The
probes are seeded by the layer's name and the model's place: the same inputs give the
same estimate. Share and pull (and so the flags) need no products and are exact either
way. Measured in docs/guide/merging.md ("What each task pays").

**Exact on request** (``cost="exact"``, ``lmdx merge --cost exact``, ``--exact-cost``):
``‖E‖²_Ĝ = ⟨Ĝ, EᵀE⟩_F``, one symmetric rank-k product ``EᵀE`` (``out·in²`` flops) per model
for the numerator and one ``W_iᵀW_i`` for the denominator, in float64; about as much as the
float64 RegMean solve of the layer.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._errors import MergeError
from ..config import resolve_threads
from ..moments import gram_product

__all__ = ["COST_MODES", "SKETCH", "LayerCost", "group_cost", "layer_cost"]

#: How what each task pays is measured: ``"estimate"`` (the default, Hutch++) or ``"exact"``.
COST_MODES = ("estimate", "exact")
#: Columns per block of the estimate (sketch, its range, the residual probes).
SKETCH = 8
#: ``W_i`` within this relative distance of the average counts as the average (pull 0).
_ALIKE = 1e-12
#: ... and for float32 weights (the estimate's), whose average rounds at about 1e-7.
_ALIKE_FLOAT32 = 1e-5


@dataclass(frozen=True)
class LayerCost:
    """One layer's numbers, one entry per model: ``cost`` (None where model i's outputs
    on its statistics are all zero, ``‖W_i‖_Ĝ = 0``), ``pull`` and ``share``."""

    cost: list[float | None]
    pull: list[float]
    share: list[float]
    #: the standard error of each cost (0.0 where computed exactly)
    error: list[float] = field(default_factory=list)


def _frobenius_with(gram: NDArray[np.float64], a: NDArray[np.float64]) -> float:
    """``‖a‖²_G = ⟨G, aᵀa⟩_F`` (``aᵀa`` by a symmetric rank-k product)."""
    return float(np.vdot(gram, a.T @ a))


def _packed_diagonal(gram: NDArray[np.float64]) -> NDArray[np.float64]:
    """The diagonal of a Gram held full (d, d) or packed (d (d + 1) / 2,)."""
    if gram.ndim == 2:
        return np.diagonal(gram)
    d = int((math.isqrt(8 * gram.size + 1) - 1) // 2)
    j = np.arange(d)
    return gram[j * d - j * (j - 1) // 2]


def _estimated_squares(
    gram: NDArray[np.float64],
    mean_row: NDArray[np.float64] | None,
    terms: Sequence[NDArray[np.floating[Any]]],
    seed: int,
    n_threads: int,
) -> list[tuple[float, float]]:
    """Per ``A`` of ``terms`` (``[out, in]``, float32 or float64, multiplied in their own
    precision): the estimate of ``tr(A G Aᵀ)`` and its standard error (see the module's
    description; exact, error 0, for ``A`` of at most ``2·SKETCH`` rows), every term's
    products with the Gram in one call of :func:`lmdx.moments.gram_product` on ``gram`` as
    held (full or packed). ``mean_row``: ``s/√n`` (``G − m mᵀ`` is the centred scatter),
    or None."""
    rng = np.random.default_rng(seed)
    k = SKETCH
    diagonal = _packed_diagonal(gram)
    m = np.zeros_like(diagonal) if mean_row is None else mean_row
    # Known exactly and cheaply: the mean's rank-one part m mᵀ and the centred diagonal c;
    # only the centred off-diagonal part N = A (G − m mᵀ − diag c) Aᵀ is estimated.
    c = np.maximum(diagonal - m * m, 0.0)
    scale = np.sqrt(c)
    columns, parts, known = [], [], []
    for a in terms:
        out = a.shape[0]
        if out <= 2 * k or a.shape[1] <= 2 * k:  # as cheap exactly
            columns.append(np.asarray(a.T, dtype=np.float64))
            parts.append((out, 0))
            known.append(0.0)
            continue
        # Q: A's dominant left singular directions, its inputs weighted by their scales (a
        # randomized range finder, one power iteration, both on A diag(c) Aᵀ); the rest by
        # Hutchinson on (I − QQᵀ)Z.
        sketch = np.column_stack([rng.standard_normal((a.shape[1], k)) * scale[:, None], m])
        left = np.asarray(a @ sketch.astype(a.dtype), dtype=np.float64)
        power = a @ ((a.T @ left[:, :k].astype(a.dtype)) * (c / c.max(initial=1.0))[:, None])
        q, _ = np.linalg.qr(np.asarray(power, dtype=np.float64))
        z = rng.standard_normal((out, k))
        z -= q @ (q.T @ z)
        columns.append(np.asarray(a.T @ np.hstack([q, z]).astype(a.dtype), dtype=np.float64))
        parts.append((k, k))
        # A's column norms², summed in A's precision (float32: to ~1e-5 of them, far below
        # the estimate's own error)
        squares = np.einsum("ij,ij->j", a, a).astype(np.float64)
        known.append(float(left[:, k] @ left[:, k]) + float(squares @ c))
    if not columns:
        return []
    y = np.hstack(columns)
    forms = np.einsum("ij,ij->j", y, gram_product(gram, y, n_threads=n_threads))
    found, at = [], 0
    for (exact, probes), base in zip(parts, known, strict=True):
        if not probes:
            found.append((float(forms[at : at + exact].sum()), 0.0))
            at += exact
            continue
        block = y[:, at : at + exact + probes]
        # off-diagonal forms yᵀ N y: yᵀ G y less the known parts
        off = forms[at : at + exact + probes] - (m @ block) ** 2 - c @ (block * block)
        at += exact + probes
        rest = off[exact:]
        value = base + float(off[:exact].sum()) + float(rest.mean())
        found.append((value, float(rest.std(ddof=1)) / math.sqrt(probes)))
    return found


def _bad_gram(owner: str, names: Sequence[str], what: str) -> MergeError:
    return MergeError(
        f"statistics of {owner}: the Gram of {', '.join(map(repr, names))} {what} (no input's "
        "products can give that): the file was edited or corrupted; collect them again "
        "(lmdx stats)"
    )


def layer_cost(
    merged: NDArray[np.float64],
    weights: Sequence[NDArray[np.float64]],
    grams: Sequence[NDArray[np.float64] | Callable[[], NDArray[np.float64]]],
    counts: Sequence[float],
    coefficients: Sequence[float] | None = None,
    *,
    mode: str = "exact",
    sums: Sequence[NDArray[np.float64] | None] | None = None,
) -> LayerCost:
    """What each of K models pays in one linear layer (see the module's description).

    Parameters
    ----------
    merged
        The merged weight ``W``, ``[out, in]``, float64.
    weights
        The K models' weights ``W_i``, ``[out, in]``, float64.
    grams
        The K input Grams ``G_i`` (``in × in``, float64; with ``mode="estimate"`` also
        their packed upper triangles), or callables that read them (then one is held at
        a time).
    counts
        The K row counts ``n_i`` (> 0).
    coefficients
        The merge's per-model coefficients (the average ``W̄`` of ``pull``); default 1.
    mode
        ``"exact"`` or ``"estimate"`` (:data:`COST_MODES`).
    sums
        The K input sums ``s_i`` (``in``), for the estimate: its rank-one mean part
        ``s sᵀ/n`` is then computed exactly; None: none given.
    """
    return group_cost(
        {"": merged}, {"": weights}, grams, counts, coefficients, mode=mode, sums=sums
    )[""]


def group_cost(
    merged: Mapping[str, NDArray[np.float64]],
    weights: Mapping[str, Sequence[NDArray[np.float64]]],
    grams: Sequence[NDArray[np.float64] | Callable[[], NDArray[np.float64]]],
    counts: Sequence[float],
    coefficients: Sequence[float] | None = None,
    labels: Sequence[str] | None = None,
    *,
    mode: str = "exact",
    n_threads: int | None = None,
    sums: Sequence[NDArray[np.float64] | None] | None = None,
) -> dict[str, LayerCost]:
    """:func:`layer_cost` of the layers of one input group (modules that share an input
    and so a Gram: q/k/v), by name: ``merged[name]``, ``weights[name]`` (K); each Gram is
    read (if a callable) once and dropped before the next. A Gram with a NaN or Inf, or a
    negative diagonal entry (a sum of squares), is refused as RegMean refuses it, naming
    ``labels[i]`` (whose statistics they are). ``sums``: the K input sums ``s_i`` (the
    estimate's control variate for the mean's part; None: none)."""
    if mode not in COST_MODES:
        raise MergeError(f"cost: expected one of {', '.join(COST_MODES)}, got {mode!r}")
    k = len(grams)
    coef = np.ones(k) if coefficients is None else np.asarray(coefficients, dtype=np.float64)
    costs: dict[str, list[float | None]] = {m: [] for m in merged}
    errors: dict[str, list[float]] = {m: [] for m in merged}
    traces = []
    threads = resolve_threads(n_threads)
    for i, (gram, n) in enumerate(zip(grams, counts, strict=True)):
        owner = labels[i] if labels is not None else f"model {i}"
        changes = {m: merged[m] - weights[m][i] for m in merged}
        g = gram() if callable(gram) else gram
        diagonal = _packed_diagonal(g)
        # Estimated, a NaN or Inf anywhere in G reaches the products (NaN · 0 is NaN):
        # checked there, not by a pass over the whole Gram.
        if not np.isfinite(diagonal).all() or (mode == "exact" and not np.isfinite(g).all()):
            raise _bad_gram(owner, list(merged), "is not finite")
        if (diagonal < 0).any():
            raise _bad_gram(owner, list(merged), "has a negative diagonal")
        traces.append(float(diagonal.sum()) / n)
        moved = [m for m, change in changes.items() if change.any()]
        if mode == "exact":
            squares = {m: (_frobenius_with(g, changes[m]), 0.0) for m in moved}
            dens = {m: (_frobenius_with(g, weights[m][i]), 0.0) for m in moved}
        else:
            terms = [changes[m] for m in moved] + [weights[m][i] for m in moved]
            seed = zlib.crc32(f"{next(iter(merged))}\0{i}".encode())
            row = None if sums is None or sums[i] is None else sums[i] / math.sqrt(n)
            found = _estimated_squares(g, row, terms, seed, threads)
            if not all(math.isfinite(v) for pair in found for v in pair):
                raise _bad_gram(owner, list(merged), "is not finite")
            squares = dict(zip(moved, found[: len(moved)], strict=True))
            dens = dict(zip(moved, found[len(moved) :], strict=True))
        for m in merged:
            if m not in squares:  # the layer as model i had it (a frozen layer): nothing paid
                costs[m].append(0.0)
                errors[m].append(0.0)
                continue
            (num, num_se), (den, den_se) = squares[m], dens[m]
            if not den > 0:
                costs[m].append(None)
                errors[m].append(0.0)
                continue
            value = float(np.sqrt(max(num, 0.0) / den))
            costs[m].append(value)
            rel = math.hypot(num_se / num if num > 0 else 0.0, den_se / den)
            errors[m].append(0.5 * value * rel)
        del g, changes
    total = sum(traces)
    share = [t / total if total > 0 else 1.0 / k for t in traces]
    out = {}
    for m, w_merged in merged.items():
        out[m] = LayerCost(costs[m], _pulls(w_merged, weights[m], coef), list(share), errors[m])
    return out


def _pulls(
    merged: NDArray[np.floating[Any]],
    weights: Sequence[NDArray[np.floating[Any]]],
    coef: NDArray[np.float64],
) -> list[float]:
    """Each model's pull ``⟨W − W̄, W_i − W̄⟩ / ‖W_i − W̄‖²`` (0 where ``W_i`` is the
    average up to rounding). float64 weights (the exact cost): by the formula, in float64.
    float32 weights (the estimate's): from the inner products of the deviations from the
    first model, ``W − W_1`` and ``W_j − W_1``, in one product (float32, no cancellation:
    the deviations are what is multiplied), to float32 rounding."""
    weight = coef / coef.sum()
    if merged.dtype == np.float64:
        mean = np.zeros_like(merged)
        for c, w in zip(weight, weights, strict=True):
            mean += c * w
        moved_by = merged - mean
        pull = []
        for w in weights:
            away = w - mean
            spread = float(np.vdot(away, away))
            # W_i the average up to rounding (one model, or all alike): nothing to pull toward
            alike = spread <= (_ALIKE**2) * float(np.vdot(w, w))
            pull.append(0.0 if alike else float(np.vdot(moved_by, away)) / spread)
        return pull
    first = weights[0].reshape(-1)
    k = len(weights)
    deviations = np.empty((k, first.size), dtype=np.result_type(merged, first))
    np.subtract(merged.reshape(-1), first, out=deviations[0])
    for j in range(1, k):
        np.subtract(weights[j].reshape(-1), first, out=deviations[j])
    h = np.asarray(deviations @ deviations.T, dtype=np.float64)
    # coefficient vectors over the rows (the merged one, then models 2..K): model 1 is 0
    models = np.zeros((k, k))
    models[np.arange(1, k), np.arange(1, k)] = 1.0
    mean = weight @ models
    moved_by = np.eye(k)[0] - mean
    scale = float(first @ first)
    pull = []
    for i in range(k):
        away = models[i] - mean
        spread = float(away @ h @ away)
        alike = spread <= (_ALIKE_FLOAT32**2) * scale
        pull.append(0.0 if alike else float(moved_by @ h @ away) / spread)
    return pull
