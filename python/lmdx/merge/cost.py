"""What each task pays for a merge, from the statistics alone, for any method's merged
weights.

Per linear layer and model i (:mod:`lmdx.merge.layer_cost` has the formulas):
``cost_i``, the relative RMS change of model i's layer outputs on its own statistics' rows;
``pull_i``, how far the merge moved from the average toward ``W_i``; ``share_i``, model
i's share of the statistics' scale. The meter gathers them over a merge's layers.

A contributor whose statistics pull far harder than the others' is **flagged**: its
median share over layers at least :data:`SHARE_RATIO_LIMIT` times the median of the
others' medians (scaled or forged Grams: an honest ``Ĝ_i`` is a mean over rows and has
the activations' scale, whatever the number of rows), or, for a method whose merge the
statistics steer, its median pull at least :data:`PULL_LIMIT`. Only statistics from data
are compared and flagged: a model with a surrogate Gram (:mod:`lmdx.merge.surrogate`,
made to the real ones' scale from its own task vector) is measured on it and marked, never
flagged; with fewer than two real ones nothing can be compared (``checked`` false).

**Estimated by default**, exact on request (``cost="exact"``, ``lmdx merge --cost
exact``, ``--exact-cost``): the formulas, the estimate and its error are
:mod:`lmdx.merge.layer_cost`'s.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._errors import MergeError
from .._tensors import as_float64, as_tensor_array
from ..stats.file import Statistics
from .inputs import open_stats
from .layer_cost import COST_MODES, LayerCost, group_cost
from .method import MergeInputs
from .plan import check_same_entries, check_stats_model
from .source import TensorSource, model_source
from .surrogate import SurrogateStatistics

__all__ = [
    "PULL_LIMIT",
    "SCALE_SPREAD_LIMIT",
    "SHARE_RATIO_LIMIT",
    "WORST_LAYERS",
    "CostMeter",
    "cost_lines",
    "cost_mode",
    "flagged_refusal",
    "measure_cost",
    "open_cost",
]


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


def _linear(x: Any, name: str, layout: str, exact: bool = True) -> NDArray[np.floating[Any]]:
    """Weight ``name``, ``[out, in]`` (a ``Conv1D`` weight, ``[in, out]``, transposed): in
    float64 for the exact cost, else as float32 or float64 as held (16-bit widened to
    float32)."""
    arr = as_float64(x, name) if exact else as_tensor_array(x, name)
    return np.ascontiguousarray(arr.T) if layout == "conv1d" else arr


@dataclass
class CostMeter:
    """Computes :func:`~lmdx.merge.layer_cost.layer_cost` for every merged linear weight
    with statistics, as the merge produces it (:meth:`observe`, called by the engine with
    each step's tensors), and the report (:meth:`report`). ``stats``: one Gram statistics per model;
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
