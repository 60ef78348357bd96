"""``wudi`` (Cheng et al., ICML 2025, "Whoever Started the Interference Should End It:
Guiding Data-Free Model Merging via Task Vectors", arXiv 2503.08099): RegMean's objective
with each task's input Gram replaced by a surrogate built from its own task vector, solved
in closed form by lmdx's certified RegMean solver.

The paper observes that a linear layer's task vector ``τ_i`` (``[out, in]``) has rows that
span (approximately) the inputs the layer saw while fine-tuned on task i, and minimises,
per layer, the interference ``Σ_i ‖(τ − τ_i) τ_iᵀ‖²_F / ‖τ_i‖²_F`` over the merged ``τ``
(FusionBench: 300–400 Adam steps from ``Σ τ_i`` per matrix on a GPU). That is RegMean's
objective ``Σ_i c_i ‖(τ − τ_i)‖²_{G_i / n_i}`` with the surrogate Gram ``G_i = τ_iᵀ τ_i``
and count ``n_i = ‖τ_i‖²_F`` (:func:`lmdx.merge.surrogate.surrogate_gram`), so lmdx solves it with
:func:`lmdx.regmean_merge_layer` (α = 1, the merge's coefficients ``c_i``, precision
``auto`` certified to 1e-6 in output error, or float64): exactly, in one factorization.

**The ridge toward task arithmetic.** Each surrogate Gram has rank at most ``out``, so the
system is singular wherever ``in > K · out`` and ill-conditioned in general; the paper's
optimizer, started at ``Σ τ_i`` and stopped early, never reaches the exact minimiser. lmdx
solves instead, with ``ρ`` the option ``ridge`` (relative) and ``T = Σ c_i τ_i`` (task
arithmetic at λ = 1, the paper's starting point)::

    min_τ  Σ_i c_i ‖τ − τ_i‖²_{G_i/n_i} + ρ · m · ‖τ − T‖²_F,   m = tr(Σ_i c_i G_i/n_i) / in

(``m``: the mean diagonal of the system, ``Σ c_i / in`` since every ``G_i/n_i`` has trace
1), as one more "model" of the same solve: weight ``T``, Gram ``ρ m I``, count 1. ``ρ = 0``
is the exact minimiser (directions no task vector reaches keep the average of the ``τ_i``,
as in any RegMean solve); large ``ρ`` is task arithmetic. Default ``ρ`` =
:data:`DEFAULT_RIDGE` (measured: bench/RESULTS.md, "wudi's ridge").

Every other tensor (biases, norms, tensors the ``exclude`` patterns name) is the
coefficient-weighted mean of the models (FusionBench's WUDI: the mean task vector, no
scaling). ``Conv1D`` weights are read transposed (the Gram is over a layer's inputs).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, get_args

import numpy as np
from numpy.typing import NDArray
from pydantic import Field

from ...regmean import PRECISION_DESCRIPTION, SolvePrecision, regmean_merge_layer
from ..method import Merged, MergeInputs, NoOptions, Step, StepSizes, cast_merged, checked_input
from ..surrogate import surrogate_gram
from .regmean_solve import GRAM_ROUNDOFF, solve_report
from .task_matrices import TaskMatrices, TaskMatrixMethod, is_task_matrix

__all__ = ["DEFAULT_RIDGE", "Wudi", "WudiOptions", "wudi_solve"]

#: The default relative ridge toward task arithmetic.
DEFAULT_RIDGE = 0.1


class WudiOptions(NoOptions):
    """WUDI: the ridge toward task arithmetic and the solver's precision."""

    ridge: Annotated[
        float,
        Field(
            ge=0.0,
            description="wudi: the relative ridge toward task arithmetic (λ 1); 0: the exact "
            "minimiser of the interference",
            json_schema_extra={"label": "must be a number >= 0"},
        ),
    ] = DEFAULT_RIDGE
    precision: Annotated[
        SolvePrecision,
        Field(
            description=PRECISION_DESCRIPTION,
            json_schema_extra={"label": "must be one of " + ", ".join(get_args(SolvePrecision))},
        ),
    ] = "auto"


def wudi_solve(
    name: str,
    taus: Sequence[NDArray[np.float64]],
    coefficients: Sequence[float],
    *,
    ridge: float,
    precision: SolvePrecision = "auto",
    n_threads: int | None = None,
) -> tuple[NDArray[np.float64], dict[str, Any]]:
    """The WUDI update of one layer (``[out, in]``) from its task matrices ``taus`` (models
    with coefficients ``c_i > 0``) and the solver's information; see the module's
    description."""
    grams, counts = zip(*(surrogate_gram(t) for t in taus), strict=True)
    seen = [float(np.trace(g)) > 0 for g in grams]
    if not any(seen):  # every task matrix zero: nothing moved
        return np.zeros_like(taus[0]), {}
    weights, coef = list(taus), [float(c) for c in coefficients]
    all_grams, all_counts = list(grams), list(counts)
    if ridge > 0:
        dim = taus[0].shape[1]
        strength = ridge * sum(c for c, s in zip(coef, seen, strict=True) if s) / dim
        target = np.zeros_like(taus[0])
        for c, t in zip(coef, taus, strict=True):
            target += c * t
        all_grams.append(np.diag(np.full(dim, strength)))
        all_counts.append(1.0)
        weights.append(target)
        coef.append(1.0)
    res = regmean_merge_layer(
        all_grams,
        weights,
        all_counts,
        alpha=1.0,
        coefficients=coef,
        layout="linear",
        precision=precision,
        noise_floor=GRAM_ROUNDOFF["float64"],
        name=name,
        n_threads=n_threads,
    )
    report = {**solve_report(res.info), "shared_with": None}
    return np.asarray(res.weight), report


class Wudi(TaskMatrixMethod):
    name: ClassVar[str] = "wudi"
    summary: ClassVar[str] = (
        "WUDI (Cheng et al., ICML 2025): per linear layer RegMean's closed form with each "
        "task's Gram replaced by τ_iᵀτ_i/‖τ_i‖² of its own task vector, ridged toward task "
        "arithmetic; no data"
    )
    options: ClassVar[type[NoOptions]] = WudiOptions
    headline: ClassVar[tuple[str, ...]] = ("ridge",)
    oriented: ClassVar[bool] = True
    scaled: ClassVar[bool] = False

    def scaling(self, inputs: MergeInputs) -> float:
        return 1.0

    def solve(
        self, name: str, matrices: TaskMatrices, inputs: MergeInputs
    ) -> tuple[NDArray[np.float64], dict[str, Any]]:
        """The layer's update and the solver's information."""
        own = inputs.options.own(WudiOptions)
        return wudi_solve(
            name,
            matrices.taus,
            matrices.coefficients,
            ridge=own.ridge,
            precision=own.precision,
            n_threads=inputs.options.threads,
        )

    def merge_matrices(
        self, name: str, matrices: TaskMatrices, inputs: MergeInputs
    ) -> NDArray[np.float64]:
        return self.solve(name, matrices, inputs)[0]

    def compute(self, step: Step, inputs: MergeInputs) -> Merged:
        """One tensor; a task matrix's solve reported under ``layers`` (by its module)."""
        name = step.tensors[0]
        assert inputs.base is not None
        base = checked_input(name, "the base", inputs.base.read(name))
        tensors = [checked_input(name, s.label, s.read(name)) for s in inputs.sources]
        info: dict[str, Any] = {}
        if is_task_matrix(name, tuple(base.shape), inputs.options.exclude):
            matrices = self.matrices(name, base, tensors, inputs)
            delta, info = self.solve(name, matrices, inputs)
            value = matrices.merged(delta)
        else:
            value = self.other_tensor(name, base, tensors, inputs)
        if inputs.lora is not None:
            inputs.lora.observe(name, value)
        merged = Merged({name: cast_merged(name, value, inputs.sources[0].dtype(name))})
        if info:
            merged.report = {"layers": {name.rsplit(".", 1)[0]: info}}
        return merged

    def memory(self, step: Step, sizes: StepSizes, inputs: MergeInputs) -> int:
        """The task matrices' and the solve's memory: K + 1 Grams and the solver's ``d × d``
        matrices (``d``: the layer's inputs) besides :meth:`TaskMatrixMethod.memory`."""
        name = step.tensors[0]
        shape = sizes.ref.shape(name)
        if not is_task_matrix(name, shape, inputs.options.exclude):
            return super().memory(step, sizes, inputs)
        d = int(shape[0] if name in inputs.state.get("conv1d", ()) else shape[1])
        return super().memory(step, sizes, inputs) + 8 * d * d * (sizes.k + 4)
