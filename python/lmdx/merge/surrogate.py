"""Surrogate Gram statistics: RegMean of models with and without statistics in one merge.

A model that brings no statistics (``surrogate: true``; ``base`` given) gets, for every
input group of the statistics the other models bring, a Gram made from its own task
vector ``τ = W − W_base`` (``[out, in]``): WUDI's observation (Cheng et al., ICML 2025,
arXiv 2503.08099) that the rows of a linear layer's task vector approximately span the
inputs it was fine-tuned on, so ``τᵀτ`` stands in for ``Σ x xᵀ``. Scaled to the real
statistics' size::

    Ĝ_sur = t̄ · T / tr T,    T = Σ_m τ_mᵀ τ_m   (m: the group's members, e.g. q, k, v)
    t̄ = median over the models with statistics of tr(G_j / n_j)

its normalised Gram has the trace — the mean squared input norm — of the real ones, so
RegMean weighs a model with a surrogate on the real ones' scale (not direction by
direction like them: docs/guide/merging.md measures what a mix costs). It is held as a Gram
``G = n̄ Ĝ_sur`` over ``n̄`` rows (the real models' mean row count), with the real
statistics' modules and groups, so the plan, the solve and what each task pays
(:mod:`lmdx.merge.cost`) run on it unchanged. A group whose task vector is zero (the model
left the layer as the base had it) gets ``(t̄ / d) I`` instead: isotropic, so that model
pulls toward its weights as in a plain average rather than not at all.

:func:`surrogate_gram` is WUDI's own form (trace-1 weighting), shared with
:mod:`lmdx.merge.builtin.wudi`."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._errors import MergeError
from .._tensors import as_float64
from ..stats.file import Statistics
from ..stats.packing import pack_upper, packed_diagonal
from .source import TensorSource

__all__ = [
    "SURROGATE_SOURCE",
    "RealScale",
    "SurrogateStatistics",
    "scaled_surrogate",
    "surrogate_gram",
    "surrogates_line",
    "with_surrogates",
]

#: How a model's statistics source reads when they are a surrogate (the merge report's
#: inputs, messages).
SURROGATE_SOURCE = "surrogate (task vector against base)"


def surrogate_gram(task_matrix: NDArray[np.float64]) -> tuple[NDArray[np.float64], float]:
    """WUDI's surrogate input statistics of one linear layer from its task matrix ``τ``
    (``[out, in]``, float64): the Gram ``G = τᵀ τ`` (``in × in``) of ``τ``'s rows taken as
    inputs, and the count ``n = ‖τ‖²_F``, so that ``G / n = τᵀτ / ‖τ‖²_F`` (the paper's
    weighting; its trace is 1). The same form as real statistics (``G = Σ x xᵀ`` over
    ``n`` rows, as :func:`lmdx.regmean_merge_layer` takes them), so surrogate and real
    Grams can go through one solve; mixing them needs a common scale
    (:func:`scaled_surrogate`). A zero task matrix gives a zero Gram and count 1 (it adds
    nothing)."""
    gram: NDArray[np.float64] = task_matrix.T @ task_matrix
    count = float(np.trace(gram))
    return gram, count if count > 0 else 1.0


def scaled_surrogate(
    task_matrices: Iterable[NDArray[np.float64]], trace: float
) -> NDArray[np.float64]:
    """The normalised surrogate Gram ``Ĝ`` of one input group from its members' task
    matrices (``[out_m, in]``, taken one at a time): ``trace · T / tr T`` with
    ``T = Σ_m τ_mᵀ τ_m``, or ``(trace / in) I`` when every ``τ_m`` is zero."""
    total: NDArray[np.float64] | None = None
    for tau in task_matrices:
        part = surrogate_gram(tau)[0]
        total = part if total is None else total + part
        del tau, part
    if total is None:
        raise ValueError("scaled_surrogate: no task matrix")
    size = float(np.trace(total))
    if size > 0:
        total *= trace / size
        return total
    dim = total.shape[0]
    identity: NDArray[np.float64] = np.eye(dim) * (trace / dim)
    return identity


class RealScale:
    """Per input group, the median over the real statistics of ``tr(G_j / n_j)`` and
    their mean row count ``n_j`` (read once per group, whichever surrogate asks first).
    The median: one scaled or forged file among three or more real ones does not set the
    surrogates' scale (:mod:`lmdx.merge.cost` flags it among the real ones)."""

    def __init__(self, real: Sequence[Statistics]) -> None:
        self.real = list(real)
        self._found: dict[str, tuple[float, float]] = {}
        self._lock = threading.Lock()

    def of_group(self, group: str, module: str) -> tuple[float, float]:
        """(median trace of ``G/n``, mean ``n``) of ``group`` (``module``: one of its
        members)."""
        with self._lock:
            if group not in self._found:
                traces, counts = [], []
                for s in self.real:
                    n = s.count(module)
                    stored = s.gram_stored(module)
                    if stored.ndim == 1:
                        total = float(np.sum(packed_diagonal(stored, s.groups[group]["dim"])))
                    else:
                        total = float(np.trace(stored))
                    del stored
                    if not np.isfinite(total):  # a NaN scale would make every surrogate NaN
                        raise MergeError(
                            f"statistics {s.source or ''}: the Gram of {module!r} is not "
                            "finite, and surrogate Grams take their scale from it: the file was "
                            "edited or corrupted; collect the statistics again (lmdx stats)"
                        )
                    traces.append(total / n if n > 0 else 0.0)
                    counts.append(n)
                self._found[group] = (float(np.median(traces)), float(np.mean(counts)))
            return self._found[group]


class SurrogateStatistics(Statistics):
    """Gram statistics of one model made from its task vector against ``base``
    (:func:`scaled_surrogate`), with the modules and groups of ``like`` (a real model's
    statistics); Grams are formed when read. They belong to their model by construction
    (nothing to check against its weights) and are never written to a file."""

    def __init__(
        self, source: TensorSource, base: TensorSource, like: Statistics, scale: RealScale
    ) -> None:
        self.of_model, self.base_model, self.scale = source, base, scale
        self._lock = threading.Lock()
        self._cached: tuple[str, NDArray[np.float64]] | None = None
        members: dict[str, list[str]] = {}
        for m, info in like.modules.items():
            members.setdefault(str(info["group"]), []).append(m)
        self.members = members
        tensors: dict[str, Any] = {}
        for g, v in like.groups.items():
            if g in members:
                tensors[f"gram/{g}"] = lambda g=g: self._gram(g)
            tensors[f"sum/{g}"] = np.zeros(int(v["dim"]))
        super().__init__(
            kind="regmean-gram",
            model={"architecture": like.model.get("architecture"), "surrogate_of": source.label},
            data=f"surrogate of {source.label} from its task vector",
            padding=like.padding,
            modules=like.modules,
            groups={g: dict(v) for g, v in like.groups.items()},
            tensors=tensors,
            source=SURROGATE_SOURCE,
            extra={"accumulation": "float64", "surrogate": True},
        )

    def count(self, module: str | None = None) -> float:
        group = self.group_of(str(module))
        return self.scale.of_group(group, self.members[group][0])[1]

    def group_count(self, g: str) -> float:
        return self.scale.of_group(g, self.members[g][0])[1] if g in self.members else 0.0

    def _task_matrix(self, module: str) -> NDArray[np.float64]:
        info = self.modules[module]
        w = str(info["weight"])
        tau: NDArray[np.float64] = as_float64(self.of_model.read(w), w).copy()
        base = as_float64(self.base_model.read(w), w)
        for source, values in ((self.of_model, tau), (self.base_model, base)):
            if not np.isfinite(values).all():  # (its trace would fail > 0: a silent identity)
                raise MergeError(
                    f"surrogate statistics of {self.of_model.label}: tensor {w!r} of "
                    f"{source.label} holds NaN or Inf; a surrogate Gram needs finite weights: "
                    "fix or replace that model"
                )
        tau -= base
        if info["layout"] == "conv1d":
            tau = tau.T
        dim = int(self.groups[str(info["group"])]["dim"])
        if tau.ndim != 2 or tau.shape[1] != dim:
            raise MergeError(
                f"surrogate statistics of {self.of_model.label}: weight {w!r} of module "
                f"{module!r} has shape {tuple(tau.shape)}, not a matrix over {dim} inputs; "
                "give this model its own statistics (lmdx stats)"
            )
        return tau

    def _gram(self, group: str) -> NDArray[np.float64]:
        """The group's packed Gram: formed from the task vectors of the members the base
        holds (a task head sharing the group's input may be absent from a bare encoder),
        one member at a time; kept until read once more (the solve, then what each task
        pays) or until another group is formed."""
        with self._lock:
            cached = self._cached
            self._cached = None
            if cached is not None and cached[0] == group:
                return cached[1]
            modules = self.members[group]
            held = [m for m in modules if str(self.modules[m]["weight"]) in self.base_model]
            if not held:
                w = self.modules[modules[0]]["weight"]
                raise MergeError(
                    f"surrogate statistics of {self.of_model.label}: base "
                    f"{self.base_model.label} has no {w!r} (module {modules[0]!r}); give the "
                    "base the models were fine-tuned from, or this model its own statistics "
                    "(lmdx stats)"
                )
            trace, count = self.scale.of_group(group, modules[0])
            g_hat = scaled_surrogate((self._task_matrix(m) for m in held), trace)
            g_hat *= count
            packed = pack_upper(g_hat)
            del g_hat
            self._cached = (group, packed)
            return packed


def surrogates_line(labels: Sequence[str]) -> str:
    """How the merge summary, the plan and the model card say which models took
    surrogate statistics."""
    return (
        f"statistics of {', '.join(labels)}: surrogates from their task vectors against the "
        "base (surrogate: true), not collected on data"
    )


def with_surrogates(
    stats: Sequence[Statistics | None],
    sources: Sequence[TensorSource],
    base: TensorSource,
) -> list[Statistics]:
    """``stats`` with every missing entry (None) replaced by the surrogate statistics of its
    model (:class:`SurrogateStatistics`, on the groups of the first model with statistics,
    scaled by all of them)."""
    real = [s for s in stats if s is not None]
    if not real:
        raise MergeError(
            "surrogate: no model has statistics; give at least one model its Gram statistics "
            "(lmdx stats): they set the surrogates' scale and which layers are solved"
        )
    scale = RealScale(real)
    return [
        s if s is not None else SurrogateStatistics(src, base, real[0], scale)
        for s, src in zip(stats, sources, strict=True)
    ]
