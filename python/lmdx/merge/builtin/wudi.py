"""``wudi`` (Cheng et al., ICML 2025, "Whoever Started the Interference Should End It:
Guiding Data-Free Model Merging via Task Vectors", arXiv 2503.08099): RegMean's objective
with each task's input Gram replaced by a surrogate built from its own task vector; by
default with SWUDI's spectral filter (arXiv 2606.07289), or as a ridged closed form solved
by lmdx's certified RegMean solver.

The paper observes that a linear layer's task vector ``τ_i`` (``[out, in]``) has rows that
span (approximately) the inputs the layer saw while fine-tuned on task i, and minimises,
per layer, the interference ``L(τ) = Σ_i c_i ‖(τ − τ_i) τ_iᵀ‖²_F / ‖τ_i‖²_F`` over the
merged ``τ`` (FusionBench: 300–400 Adam steps from ``Σ τ_i`` per matrix on a GPU). That is
RegMean's objective ``Σ_i c_i ‖(τ − τ_i)‖²_{G_i / n_i}`` with the surrogate Gram
``G_i = τ_iᵀ τ_i`` and count ``n_i = ‖τ_i‖²_F``
(:func:`lmdx.merge.surrogate.surrogate_gram`). Each surrogate Gram has rank at most
``out``, so the system is singular wherever ``in > K · out`` and ill-conditioned in
general: the paper's optimizer, started at ``Σ τ_i`` and stopped early, never reaches the
exact minimiser, and the small eigenvalues it never resolves are where the exact one
amplifies noise. Two ways to stop short of it (``solver``):

**``spectral`` (the default): the gradient flow, in closed form** (SWUDI). With
``C = Σ c_i τ_iᵀτ_i / ‖τ_i‖²`` (``in × in``, trace ``Σ c_i``), ``D = Σ c_i τ_i τ_iᵀτ_i /
‖τ_i‖²`` and the start ``T = Σ c_i τ_i`` (task arithmetic at λ = 1), the flow
``dτ/ds = −(τ C − D)`` from ``T`` is, at time ``t`` (``flow_time``)::

    τ(t) = T + (D − T C) Q diag((1 − e^{−t λ_j}) / λ_j) Qᵀ,   C = Q diag(λ) Qᵀ

(``(1 − e^{−tλ})/λ = t`` at ``λ = 0``): along an eigendirection of ``C`` with
``t λ_j ≫ 1`` the exact minimiser, with ``t λ_j ≪ 1`` barely moved from task arithmetic.
``top_fraction`` r keeps the filter on the ``⌈r · in⌉`` largest eigenvalues only (SWUDI's
hard top-K; the others stay at ``T``). Only the eigenpairs of ``C``'s range matter (the
rows of ``D − T C`` lie in it), so the eigendecomposition is of the smaller of ``C`` and
the ``K·out × K·out`` Gram of the stacked scaled task vectors, in float64 (NumPy's
``eigh``). Default ``t`` = :data:`DEFAULT_FLOW_TIME`, SWUDI's for ViT-B/32 (``C``'s
eigenvalues sum to K, so ``t`` is in units of one task's share of a direction).

**``ridge``: the ridged minimiser.** lmdx solves, with ``ρ`` the option ``ridge``
(relative)::

    min_τ  Σ_i c_i ‖τ − τ_i‖²_{G_i/n_i} + ρ · m · ‖τ − T‖²_F,   m = tr(Σ_i c_i G_i/n_i) / in

(``m``: the mean diagonal of the system, ``Σ c_i / in`` since every ``G_i/n_i`` has trace
1), as one more "model" of :func:`lmdx.regmean_merge_layer` (α = 1, the merge's
coefficients, precision ``auto`` certified to 1e-6 in output error, or float64): weight
``T``, Gram ``ρ m I``, count 1 (:func:`lmdx.merge.builtin.regmean_prior.prior_system`, the
prior of RegMean's ``prior`` option). ``ρ = 0`` is the exact minimiser (directions no task
vector reaches keep the average of the ``τ_i``, as in any RegMean solve); large ``ρ`` is
task arithmetic. Default ``ρ`` = :data:`DEFAULT_RIDGE` (measured: bench/RESULTS.md,
"wudi's ridge").

Every other tensor (biases, norms, tensors the ``exclude`` patterns name) is the
coefficient-weighted mean of the models (FusionBench's WUDI: the mean task vector, no
scaling). ``Conv1D`` weights are read transposed (the Gram is over a layer's inputs).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Annotated, Any, ClassVar, Literal, get_args

import numpy as np
from numpy.typing import NDArray
from pydantic import Field, model_validator

from ...regmean import PRECISION_DESCRIPTION, SolvePrecision, regmean_merge_layer
from ..method import Merged, MergeInputs, NoOptions, Step, StepSizes, cast_merged, checked_input
from ..surrogate import surrogate_gram
from .regmean_prior import prior_system
from .regmean_solve import GRAM_ROUNDOFF, solve_report
from .task_matrices import TaskMatrices, TaskMatrixMethod, is_task_matrix

__all__ = [
    "DEFAULT_FLOW_TIME",
    "DEFAULT_RIDGE",
    "Wudi",
    "WudiOptions",
    "spectral_wudi",
    "wudi_solve",
]

#: The default relative ridge toward task arithmetic (``solver: ridge``).
DEFAULT_RIDGE = 0.1
#: The default time of the gradient flow (``solver: spectral``): SWUDI's for ViT-B/32.
DEFAULT_FLOW_TIME = 1300.0


class WudiOptions(NoOptions):
    """WUDI: the spectral filter (its flow time and top fraction) or the ridge toward task
    arithmetic (and the solver's precision)."""

    solver: Annotated[
        Literal["spectral", "ridge"],
        Field(
            description="wudi: spectral (SWUDI's gradient flow from task arithmetic, in closed "
            "form) or ridge (the minimiser ridged toward task arithmetic)",
            json_schema_extra={"label": "must be spectral or ridge"},
        ),
    ] = "spectral"
    flow_time: Annotated[
        float,
        Field(
            gt=0.0,
            description="wudi, solver spectral: t, how far the flow goes from task arithmetic "
            "(SWUDI: 1300 for ViT-B/32, 300 for Llama-3B; larger: nearer the exact minimiser)",
            json_schema_extra={"label": "must be a number > 0"},
        ),
    ] = DEFAULT_FLOW_TIME
    top_fraction: Annotated[
        float | None,
        Field(
            gt=0.0,
            le=1.0,
            description="wudi, solver spectral: filter only the ⌈r·in⌉ largest eigendirections "
            "(SWUDI's top-K; none: all)",
            json_schema_extra={"label": "must be in (0, 1]"},
        ),
    ] = None

    ridge: Annotated[
        float,
        Field(
            ge=0.0,
            description="wudi, solver ridge: the relative ridge toward task arithmetic (λ 1); 0: "
            "the exact minimiser of the interference",
            json_schema_extra={"label": "must be a number >= 0"},
        ),
    ] = DEFAULT_RIDGE
    precision: Annotated[
        SolvePrecision,
        Field(
            description="wudi, solver ridge: " + PRECISION_DESCRIPTION,
            json_schema_extra={"label": "must be one of " + ", ".join(get_args(SolvePrecision))},
        ),
    ] = "auto"

    @model_validator(mode="after")
    def _options_of_the_solver(self) -> WudiOptions:
        """An option of the other solver set to anything but its default is refused, never
        silently unused (a resolved dump of the options, every field set, still loads)."""
        other = {"spectral": ("ridge", "precision"), "ridge": ("flow_time", "top_fraction")}
        fields = type(self).model_fields
        given = [k for k in other[self.solver] if getattr(self, k) != fields[k].default]
        if given:
            theirs = "ridge" if self.solver == "spectral" else "spectral"
            raise ValueError(
                f"{given[0]} is an option of solver {theirs}, not of {self.solver}; give "
                f"solver: {theirs} or leave it out"
            )
        return self


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
        system = prior_system(grams, counts, coef, taus[0].shape[1], ridge, _start(taus, coef))
        all_grams.append(system.gram)
        all_counts.append(1.0)
        weights.append(system.weight)
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


def _start(taus: Sequence[NDArray[np.float64]], coef: Sequence[float]) -> NDArray[np.float64]:
    """``T = Σ c_i τ_i``: task arithmetic at λ = 1, where the flow starts."""
    start = np.zeros_like(taus[0])
    for c, t in zip(coef, taus, strict=True):
        start += c * t
    return start


def spectral_wudi(
    taus: Sequence[NDArray[np.float64]],
    coefficients: Sequence[float],
    *,
    flow_time: float = DEFAULT_FLOW_TIME,
    top_fraction: float | None = None,
) -> tuple[NDArray[np.float64], dict[str, Any]]:
    """SWUDI's update of one layer (``[out, in]``) from its task matrices ``taus`` (models
    with coefficients ``c_i > 0``): the gradient flow of the interference from task
    arithmetic at time ``flow_time``, filtered to the ``⌈top_fraction · in⌉`` largest
    eigendirections of ``C`` if given (see the module's description); and its report."""
    coef = [float(c) for c in coefficients]
    norms = [float(np.sum(t * t)) for t in taus]
    seen = [i for i, n in enumerate(norms) if n > 0]
    if not seen:  # every task matrix zero: nothing moved
        return np.zeros_like(taus[0]), {}
    start = _start(taus, coef)
    d = taus[0].shape[1]
    # C = MᵀM with M the stacked √(c_i) τ_i / ‖τ_i‖; D = Σ c_i τ_i τ_iᵀ τ_i / ‖τ_i‖², each
    # product in its cheaper order (out² · in or out · in² multiply-adds)
    m = np.vstack([math.sqrt(coef[i] / norms[i]) * taus[i] for i in seen])
    out = taus[0].shape[0]
    d_sum = sum(
        (coef[i] / norms[i])
        * ((taus[i] @ taus[i].T) @ taus[i] if out < d else taus[i] @ (taus[i].T @ taus[i]))
        for i in seen
    )
    if m.shape[0] < d:  # C's nonzero eigenpairs from the smaller Gram M Mᵀ = U diag(λ) Uᵀ
        residual = d_sum - (start @ m.T) @ m  # D − T C, rows in C's range
        lam, u = np.linalg.eigh(m @ m.T)
        q = m.T @ u  # C's eigenvectors scaled by √λ: q_j = √λ_j v_j
        scale = 1.0 / np.where(lam > 0, lam, 1.0)  # q diag(f/λ) qᵀ = V diag(f) Vᵀ
        side = "gram"
    else:
        c = m.T @ m
        residual = d_sum - start @ c
        lam, q = np.linalg.eigh(c)
        del c
        scale = np.ones_like(lam)
        side = "inputs"
    # directions at the rounding of the largest eigenvalue are C's null space: dropped
    keep = lam > lam.max() * d * np.finfo(np.float64).eps
    if top_fraction is not None:
        top = math.ceil(top_fraction * d)
        keep &= np.arange(lam.size) >= lam.size - top  # eigh: ascending
    lam_k = lam[keep]
    gain = -np.expm1(-flow_time * lam_k) / lam_k * scale[keep]  # (1 − e^{−tλ})/λ
    q_k = q[:, keep]
    update = start + ((residual @ q_k) * gain) @ q_k.T
    report = {
        "solver": "spectral",
        "flow_time": flow_time,
        "directions": int(keep.sum()),
        "eigen_side": side,
        "shared_with": None,
    }
    return update, report


class Wudi(TaskMatrixMethod):
    name: ClassVar[str] = "wudi"
    summary: ClassVar[str] = (
        "WUDI (Cheng et al., ICML 2025): per linear layer RegMean's objective with each "
        "task's Gram replaced by τ_iᵀτ_i/‖τ_i‖² of its own task vector, its gradient flow "
        "from task arithmetic in closed form (SWUDI's spectral filter) or ridged; no data"
    )
    options: ClassVar[type[NoOptions]] = WudiOptions
    headline: ClassVar[tuple[str, ...]] = ("solver",)
    oriented: ClassVar[bool] = True
    scaled: ClassVar[bool] = False

    def scaling(self, inputs: MergeInputs) -> float:
        return 1.0

    def solve(
        self, name: str, matrices: TaskMatrices, inputs: MergeInputs
    ) -> tuple[NDArray[np.float64], dict[str, Any]]:
        """The layer's update and the solver's information."""
        own = inputs.options.own(WudiOptions)
        if own.solver == "spectral":
            return spectral_wudi(
                matrices.taus,
                matrices.coefficients,
                flow_time=own.flow_time,
                top_fraction=own.top_fraction,
            )
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
