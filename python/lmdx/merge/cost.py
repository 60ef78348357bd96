"""What each task pays for a merge, from the statistics alone, for any method's merged
weights.

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

A contributor whose statistics pull far harder than the others' is **flagged**: its
median share over layers at least :data:`SHARE_RATIO_LIMIT` times the median of the
others' medians (scaled or forged Grams: an honest ``Ĝ_i`` is a mean over rows and has
the activations' scale, whatever the number of rows), or, for a method whose merge the
statistics steer, its median pull at least :data:`PULL_LIMIT`. Only statistics from data
are compared and flagged: a model with a surrogate Gram (:mod:`lmdx.merge.surrogate`,
made to the real ones' scale from its own task vector) is measured on it and marked, never
flagged; with fewer than two real ones nothing can be compared (``checked`` false).

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

import dataclasses
import functools
import math
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._errors import MergeError
from .._tensors import as_float64, as_tensor_array
from ..config import resolve_threads
from ..moments import gram_product
from ..stats.file import Statistics
from .inputs import open_stats
from .method import MergeInputs
from .plan import check_same_entries, check_stats_model
from .source import TensorSource, model_source
from .surrogate import SurrogateStatistics

__all__ = [
    "COST_MODES",
    "PULL_LIMIT",
    "SCALE_SPREAD_LIMIT",
    "SHARE_RATIO_LIMIT",
    "SKETCH",
    "WORST_LAYERS",
    "CostMeter",
    "LayerCost",
    "cost_lines",
    "cost_mode",
    "flagged_refusal",
    "group_cost",
    "layer_cost",
    "measure_cost",
    "open_cost",
]

#: How what each task pays is measured: ``"estimate"`` (the default, Hutch++) or ``"exact"``.
COST_MODES = ("estimate", "exact")
#: Columns per block of the estimate (sketch, its range, the residual probes).
SKETCH = 8

#: A model is flagged when its median share of the statistics' scale is this many times
#: the median of the other models' medians.
SHARE_RATIO_LIMIT = 4.0
#: ... or, for a method that uses the statistics, when its median pull reaches this.
PULL_LIMIT = 0.5
#: ... or when, at any layer, its scale ``tr Ĝ_i`` is this many times another real one's
#: (an honest ``Ĝ_i`` is a mean over rows, with the activations' scale): the layers where
#: the real statistics' scales disagree so, and who is high and who is low there, are
#: reported whatever the majority (two forged files of three outvote no median here).
#: 1.5 orders of magnitude: honest tiny random models (the LoRA tests) reach 12x at one
#: layer (and the test families 1.2-1.3x); a ×100 forgery gave 88-129x there (tests/merge).
SCALE_SPREAD_LIMIT = 30.0
#: How many of a task's most costly layers the report names.
WORST_LAYERS = 3
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


def _opened_gram_stats(
    stats: Sequence[Any], sources: Sequence[TensorSource], labels: Sequence[str]
) -> list[Statistics]:
    """Gram statistics given for the cost alone, opened and checked against the models."""
    opened = open_stats(stats, "regmean-gram", labels)
    assert opened is not None
    objs = []
    for i, (source, s) in enumerate(zip(sources, opened, strict=True)):
        if s is None:
            raise MergeError(
                f"stats[{i}]: what each task pays needs every model's Gram statistics "
                f"({labels[i]} has none; lmdx stats)"
            )
        check_stats_model(source, s)
        objs.append(s)
    check_same_entries(objs, labels)
    return objs


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


def _linear(x: Any, name: str, layout: str, exact: bool = True) -> NDArray[np.floating[Any]]:
    """Weight ``name``, ``[out, in]`` (a ``Conv1D`` weight, ``[in, out]``, transposed): in
    float64 for the exact cost, else as float32 or float64 as held (16-bit widened to
    float32)."""
    arr = as_float64(x, name) if exact else as_tensor_array(x, name)
    return np.ascontiguousarray(arr.T) if layout == "conv1d" else arr


@dataclass
class CostMeter:
    """Computes :func:`layer_cost` for every merged linear weight with statistics, as the
    merge produces it (:meth:`observe`, called by the engine with each step's tensors),
    and the report (:meth:`report`). ``stats``: one Gram statistics per model;
    ``steered``: whether the method's merge uses these statistics (then a pull is
    flagged too); ``only_for_cost``: they were given for this report alone; ``mode``:
    ``"estimate"`` (on the Grams as the merge read them) or ``"exact"``."""

    stats: Sequence[Statistics]
    sources: Sequence[TensorSource]
    labels: Sequence[str]
    coefficients: Sequence[float] | None
    steered: bool
    only_for_cost: bool = False
    mode: str = "estimate"
    n_threads: int | None = None
    layers: dict[str, LayerCost] = field(default_factory=dict)
    seconds: float = 0.0
    _weights: dict[str, tuple[str, str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._weights = {
            info["weight"]: (m, str(info["layout"])) for m, info in self.stats[0].modules.items()
        }

    def weights(self) -> list[str]:
        """The weights the statistics cover."""
        return list(self._weights)

    def observe(self, tensors: Mapping[str, Any], grams: Mapping[str, Any] | None = None) -> None:
        """The cost of every merged weight in ``tensors`` the statistics cover (those of
        one input group together: each model's Gram read once, one at a time). ``grams``:
        by module, the K Grams the merge's step read, as stored (the estimate measures on
        them instead of reading them again)."""
        t0 = time.process_time()
        groups: dict[str, list[tuple[str, str, str]]] = {}
        for name in tensors:
            found = self._weights.get(name)
            if found is not None:
                groups.setdefault(self.stats[0].group_of(found[0]), []).append((name, *found))
        for members in groups.values():
            first = members[0][1]
            exact = self.mode == "exact"
            merged = {m: _linear(tensors[w], w, lay, exact) for w, m, lay in members}
            weights = {
                m: [_linear(s.read(w), w, lay, exact) for s in self.sources]
                for w, m, lay in members
            }
            # the step's own Grams are these statistics' only when the merge used them
            own = grams is not None and self.mode == "estimate" and not self.only_for_cost
            given = grams.get(first) if own and grams is not None else None
            loaders: Sequence[Any] = (
                list(given)
                if given is not None
                else [
                    functools.partial(s.gram if self.mode == "exact" else s.gram_stored, first)
                    for s in self.stats
                ]
            )
            counts = [
                s.rows_seen(first, label) for s, label in zip(self.stats, self.labels, strict=True)
            ]
            sums = None if self.mode == "exact" else [s.sum(first) for s in self.stats]
            self.layers.update(
                group_cost(
                    merged,
                    weights,
                    loaders,
                    counts,
                    self.coefficients,
                    self.labels,
                    mode=self.mode,
                    n_threads=self.n_threads,
                    sums=sums,
                )
            )
        self.seconds += time.process_time() - t0

    def report(self) -> dict[str, Any]:
        """``report["cost"]``: per task its mean and largest cost over layers, its worst
        layers, median pull and share, the share's ratio to the others' and whether it is
        flagged (with why); per layer every model's numbers; the CPU seconds spent."""
        labels = list(self.labels)
        k = len(labels)
        mods = list(self.layers)
        shares = np.array([self.layers[m].share for m in mods]).reshape(len(mods), k)
        pulls = np.array([self.layers[m].pull for m in mods]).reshape(len(mods), k)
        # Layers the merge left as every model had them (frozen while fine-tuning: cost and
        # pull 0 for all) say nothing of who pulls: they do not enter the medians.
        moved = [
            r
            for r, m in enumerate(mods)
            if any(c != 0.0 for c in self.layers[m].cost if c is not None) or pulls[r].any()
        ]
        medians = np.median(shares[moved], axis=0) if moved else np.zeros(k)
        # Only statistics from data are compared and flagged: a surrogate is made to the
        # real ones' scale from the model's own task vector (lmdx.merge.surrogate).
        made = [isinstance(s, SurrogateStatistics) for s in self.stats]
        real = [i for i in range(k) if not made[i]]
        spread = _scale_spread(mods, shares, real)
        tasks: dict[str, Any] = {}
        flagged = []
        for i, lab in enumerate(labels):
            costs = [(m, c) for m in mods if (c := self.layers[m].cost[i]) is not None]
            errors_i = [self.layers[m].error[i] for m in mods if self.layers[m].cost[i] is not None]
            others = medians[[j for j in real if j != i]]
            compared = not made[i] and len(others) > 0
            ratio = (
                float(medians[i] / np.median(others)) if compared and np.median(others) > 0 else 1.0
            )
            pull = float(np.median(pulls[moved, i])) if moved else 0.0
            why = []
            if compared and ratio >= SHARE_RATIO_LIMIT:
                why.append(f"median share of the statistics' scale {ratio:.1f}x the others'")
            high = [m for m, (_, hi, _) in spread.items() if i in hi]
            if compared and high:
                most = max(spread[m][0] for m in high)
                why.append(
                    f"its scale up to {most:.0f}x another's at {len(high)} of {len(mods)} "
                    f"layers (e.g. {high[0]})"
                )
            if compared and self.steered and pull >= PULL_LIMIT:
                why.append(f"median pull {pull:.2f} toward it")
            worst = sorted(costs, key=lambda mc: -mc[1])[:WORST_LAYERS]
            tasks[lab] = {
                # exactly rounded: the same whatever order the layers came in
                "mean": math.fsum(c for _, c in costs) / len(costs) if costs else None,
                # the layers' estimates are independent: the mean's standard error
                "mean_error": math.sqrt(math.fsum(e * e for e in errors_i)) / len(costs)
                if costs
                else None,
                "max": worst[0][1] if worst else None,
                "worst_layers": [[m, c] for m, c in worst],
                "pull_median": pull,
                "share_median": float(medians[i]),
                "share_ratio": ratio,
                "flagged": bool(why),
                "surrogate": made[i],
            }
            if why:
                flagged.append({"model": lab, "why": "; ".join(why)})
        disagree = None
        if spread:
            high = sorted({i for _, hi, _ in spread.values() for i in hi})
            low = sorted({i for _, _, lo in spread.values() for i in lo})
            disagree = {
                "layers": list(spread),
                "largest": max(x for x, _, _ in spread.values()),
                "high": [labels[i] for i in high],
                "low": [labels[i] for i in low],
            }
        return {
            "statistics": "given for the cost only" if self.only_for_cost else "the merge's",
            "mode": self.mode,
            "tasks": tasks,
            "flagged": flagged,
            "scale_disagreement": disagree,
            "checked": len(real) > 1,
            "layers": {m: dataclasses.asdict(v) for m, v in self.layers.items()},
            "cpu_seconds": self.seconds,
        }


def _scale_spread(
    mods: Sequence[str], shares: NDArray[np.float64], real: Sequence[int]
) -> dict[str, tuple[float, list[int], list[int]]]:
    """The layers where the real statistics' scales differ :data:`SCALE_SPREAD_LIMIT`
    times or more: layer -> (largest over smallest, the models above their geometric
    middle, those below it)."""
    out = {}
    for r, m in enumerate(mods):
        scales = {i: float(shares[r, i]) for i in real}
        positive = [v for v in scales.values() if v > 0]
        if len(positive) < 2 or max(positive) < SCALE_SPREAD_LIMIT * min(positive):
            continue
        middle = math.sqrt(max(positive) * min(positive))
        out[m] = (
            max(positive) / min(positive),
            [i for i, v in scales.items() if v >= middle],
            [i for i, v in scales.items() if v < middle],
        )
    return out


def flagged_refusal(cost: Mapping[str, Any]) -> str:
    """Why a merge whose contributors ``cost`` flags is refused, and what to do, in one
    line."""
    who = "; ".join(f"{f['model']} ({f['why']})" for f in cost["flagged"])
    return (
        f"merge refused, nothing written: the statistics of {who} pull far harder than the "
        "others' (scaled or forged Grams?); check where they came from, leave them out, or "
        "merge anyway with accept_flagged: true (lmdx merge --accept-flagged), which the "
        "record and the card state"
    )


def cost_lines(cost: Mapping[str, Any]) -> list[str]:
    """What a report's ``cost`` entry says, one line per task and one per flag (the merge
    summary of ``lmdx merge``)."""
    how = "exact" if cost.get("mode") == "exact" else "estimated (--cost exact: exact)"
    lines = [
        f"what each task pays ({len(cost['layers'])} layers; relative change of its layer "
        f"outputs on its own statistics, {how}): mean, worst layer"
    ]
    for lab, t in cost["tasks"].items():
        if t["mean"] is None:
            lines.append(f"  {lab}: no layer with nonzero outputs on its statistics")
            continue
        worst = t["worst_layers"][0]
        kind = " (on its surrogate Gram)" if t.get("surrogate") else ""
        error = t.get("mean_error") or 0.0
        plus = f" ± {error:.4f}" if error > 0 else ""
        lines.append(
            f"  {lab}{kind}: {t['mean']:.4f}{plus}, {worst[1]:.4f} ({worst[0]}); pull "
            f"{t['pull_median']:.2f}, share {t['share_median']:.2f}"
        )
    if not cost.get("checked", True):
        lines.append(
            "note: fewer than two models with statistics from data: scaled or forged Grams "
            "cannot be told apart from the others"
        )
    disagree = cost.get("scale_disagreement")
    if disagree:
        lines.append(
            f"warning: the statistics' scales disagree up to {disagree['largest']:.0f}x at "
            f"{len(disagree['layers'])} layers (e.g. {disagree['layers'][0]}): high "
            f"{', '.join(disagree['high'])}; low {', '.join(disagree['low'])}"
        )
    for f in cost["flagged"]:
        lines.append(
            f"warning: the statistics of {f['model']} pull far harder than the others' "
            f"({f['why']}): scaled or forged Grams? check where they came from"
        )
    if cost.get("accepted"):
        lines.append("warning: merged although flagged (accept_flagged: true)")
    return lines


def cost_mode(cost: bool | str | None) -> tuple[bool | None, str]:
    """The front doors' ``cost`` argument read: whether what each task pays is measured
    (True; False: not; None: when the method's statistics are Grams) and how
    (:data:`COST_MODES`): None, True and False estimate, ``"estimate"`` and ``"exact"``
    measure so."""
    if cost is None or isinstance(cost, bool):
        return cost, "estimate"
    if isinstance(cost, str) and cost in COST_MODES:
        return True, cost
    raise MergeError(
        f"cost: expected True, False, None, 'estimate' or 'exact', got {cost!r}"
        " (exact: the slower exact value of what each task pays)"
    )


def open_cost(
    inputs: MergeInputs, stats: Sequence[Any] | None, cost: bool | str | None
) -> CostMeter | None:
    """The meter of what each task pays for the merge of ``inputs`` (None: not measured).
    ``cost``: True (measured; Gram statistics needed), False (not), None (measured when
    the method's statistics are Grams), ``"estimate"`` or ``"exact"`` (measured so;
    :func:`cost_mode`). ``stats``: the front door's statistics argument; those of a
    method that takes none (accepted with ``cost``) are opened and checked against the
    models here."""
    wanted, mode = cost_mode(cost)
    if wanted is False:
        return None
    method = inputs.method
    threads = inputs.options.threads
    if method.stats == "regmean-gram" and inputs.stats is not None:
        return CostMeter(
            inputs.stats,
            inputs.sources,
            inputs.labels,
            inputs.options.coefficients,
            True,
            mode=mode,
            n_threads=threads,
        )
    if wanted and method.stats is None and stats is not None:
        objs = _opened_gram_stats(stats, inputs.sources, inputs.labels)
        return CostMeter(
            objs,
            inputs.sources,
            inputs.labels,
            inputs.options.coefficients,
            False,
            True,
            mode=mode,
            n_threads=threads,
        )
    if wanted:
        kind = f"its {method.stats} statistics" if method.stats else "no statistics"
        raise MergeError(
            f"cost: what each task pays needs Gram statistics (regmean-gram, lmdx stats) "
            f"for every model; method {method.name} was given {kind}"
        )
    return None


def measure_cost(
    merged: Mapping[str, Any],
    models: Sequence[Any],
    stats: Sequence[Any],
    *,
    labels: Sequence[str] | None = None,
    coefficients: Sequence[float] | None = None,
    mode: str = "estimate",
) -> dict[str, Any]:
    """What each task pays for a merged model made anyhow: ``merged`` a state dict (e.g.
    :attr:`lmdx.merge.MergeResult.state_dict`), ``models`` the K models merged (modules,
    state dicts or folders), ``stats`` their Gram statistics (checked to belong to them),
    ``coefficients`` the merge's (the average a pull is measured from), ``mode``
    ``"estimate"`` or ``"exact"``. Returns what a merge's ``report["cost"]`` holds (no
    pull is flagged: the method is not known)."""
    if len(stats) != len(models):
        raise MergeError(f"stats: {len(stats)} statistics for {len(models)} models")
    names = [f"model{i}" for i in range(len(models))] if labels is None else list(labels)
    sources = [model_source(m, lab, progress=False) for m, lab in zip(models, names, strict=True)]
    meter = CostMeter(
        _opened_gram_stats(stats, sources, names),
        sources,
        names,
        coefficients,
        False,
        True,
        mode=cost_mode(mode)[1],
    )
    meter.observe({w: merged[w] for w in meter.weights() if w in merged})
    return meter.report()
