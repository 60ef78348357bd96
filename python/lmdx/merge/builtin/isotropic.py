"""``iso_c`` and ``iso_cts`` (isotropic merging, Marczak et al., ICML 2025, "No task left
behind: isotropic model merging with common and task-specific subspaces", arXiv
2502.04959): the merged task matrix's singular spectrum flattened, so that every direction
it spans counts alike. Where the paper leaves details open, FusionBench's implementation is
the reference behaviour.

``iso_c`` (common subspace), per task matrix (:mod:`lmdx.merge.builtin.task_matrices`):
``M = Σ c_i τ_i = U Σ Vᵀ`` (thin SVD, ``r = min(out, in)`` singular values); the update is
``α · σ̄ · U Vᵀ`` with ``σ̄`` the mean of all ``r`` singular values.

``iso_cts`` (common and task-specific subspaces): with ``f`` the ``common_space_fraction``
(the paper's 0.8) and K models,

1. ``k_c = ⌊r · f⌋``; the task-specific part ``K · s`` with ``s = round((r − k_c) / K)``
   (Python's rounding, as FusionBench; at most ``⌊r / K⌋``), and ``k_c = r − K · s``;
2. the common subspace: the top ``k_c`` singular triplets of ``M = Σ c_i τ_i``;
3. per model, its task matrix with the common subspace projected out on the left,
   ``(I − U_c U_cᵀ) c_i τ_i``, cut to its top ``s`` singular triplets;
4. ``U = [U_1s … U_Ks U_c]``, ``V`` likewise, whitened to their orthogonal polar factors;
   the update is ``α · σ̄ · U_⊥ V_⊥ᵀ`` with ``σ̄`` the mean of the ``r`` singular values
   gathered in steps 2 and 3.

``precision: float64`` computes exactly that with NumPy's float64 SVDs. The default,
``precision: auto``, computes the same quantities from float64 eigendecompositions of
Grams, as TSV-M's default does (:mod:`lmdx.merge.builtin.tsv`: top triplets by
:func:`~lmdx.merge.builtin.task_matrices.gram_triplets`, polar factors by
:func:`~lmdx.merge.builtin.task_matrices.gram_polar`; ISO-C's ``U Vᵀ`` is ``M``'s polar
factor and ``σ̄`` the mean of the square roots of its Gram's eigenvalues), under the same
contract: **the merged update within a relative Frobenius** :data:`FAST_PATH_BOUND`
(``1e-6``) **of the float64 SVD definition**, checked per tensor by a first-order error
estimate, with the float64 SVDs wherever the estimate exceeds the bound (a rank-deficient
``M`` for ISO-C, near-equal singular values at a cut, duplicated tasks, kept singular
values below ``1e-4`` of the largest). ISO-CTS's estimate adds to TSV-M's terms the
common subspace's error carried into each task-specific part: ``δ · ‖U_cᵀ τ_i‖₂ · (1/g_i
+ 2/s_i + 1/σ̄)``, with ``δ`` the common cut's sensitivity (its Gram's rounding grown as
``√n``, the typical growth, not ``n``, the worst case) plus ``U_c``'s and ``V_c``'s
orthonormality defects, ``g_i`` the gap after the task's ``s``-th singular value and
``s_i`` that value. At BERT-base's shapes with 2 % deltas (K = 3) every matrix took the
fast path, its merged weight within ``2e-11`` (largest entry) of the float64 path's
(bench/bench_svd_methods.py); tests/merge/test_iso_fast.py checks the bound on drawn
spectra (the estimate is first order and was checked, not proven).

The left side is the output side (``[out, in]``), so ``Conv1D`` weights are read
transposed. Every other tensor is ``θ_0 + α ×`` the coefficient-weighted mean of the task
vectors (FusionBench's). α (``scaling``) defaults to 1 (FusionBench's; the paper tunes it
on validation data, e.g. 1.5 with SVC in FusionBench's configurations).
"""

from __future__ import annotations

from typing import Annotated, ClassVar

import numpy as np
from numpy.typing import NDArray
from pydantic import Field

from ..method import MergeInputs, NoOptions
from .task_matrices import (
    FAST_PATH_BOUND,
    GRAM_EPS,
    GRAM_PRECISION,
    GRAM_SMALL_LIMIT,
    MATRIX_SCALING,
    Precision,
    TaskMatrices,
    TaskMatrixMethod,
    gram_polar,
    gram_triplets,
    polar,
)

__all__ = [
    "FAST_PATH_BOUND",
    "IsoC",
    "IsoCOptions",
    "IsoCts",
    "IsoCtsOptions",
    "iso_c_merge",
    "iso_c_merge_fast",
    "iso_cts_merge",
    "iso_cts_merge_fast",
]

#: Power iterations of the spectral-norm estimate of a task matrix's common part.
_POWER_STEPS = 6


class IsoCOptions(NoOptions):
    """ISO-C: α 1 (FusionBench's)."""

    scaling: Annotated[float, MATRIX_SCALING] = 1.0
    precision: Annotated[Precision, GRAM_PRECISION] = "auto"


class IsoCtsOptions(IsoCOptions):
    """ISO-CTS: α 1 and 80 % of the rank for the common subspace (the paper's)."""

    common_space_fraction: Annotated[
        float,
        Field(
            ge=0.0,
            le=1.0,
            description="the fraction of each matrix's rank given to the subspace common to "
            "all tasks (the rest is split evenly among the tasks)",
            json_schema_extra={"label": "must be in [0, 1]"},
        ),
    ] = 0.8


def iso_c_merge(
    taus: list[NDArray[np.float64]], precision: Precision = "auto"
) -> NDArray[np.float64]:
    """ISO-C's update ``σ̄ U Vᵀ`` of ``M = Σ taus``.

    Parameters
    ----------
    taus
        The task matrices, ``[out, in]``, float64, of one shape (at least one).
    precision
        ``"auto"``: :func:`iso_c_merge_fast`, or the float64 SVD where it is not assured;
        ``"float64"``: the SVD (see the module's description).

    Returns
    -------
    NDArray[np.float64]
        ``[out, in]``.
    """
    if min(taus[0].shape) == 0:
        return np.zeros(taus[0].shape)  # an empty tensor: no singular value to average
    if precision == "auto":
        fast = iso_c_merge_fast(taus)
        if fast is not None:
            return fast
    total = np.sum(taus, axis=0)
    u, s, vt = np.linalg.svd(total, full_matrices=False)
    out: NDArray[np.float64] = (float(s.mean()) * u) @ vt
    return out


def iso_c_merge_fast(taus: list[NDArray[np.float64]]) -> NDArray[np.float64] | None:
    """ISO-C's update from the eigendecomposition of ``M``'s smaller Gram, or ``None``
    where the a-posteriori estimate of its error exceeds :data:`FAST_PATH_BOUND` (see the
    module's description).

    Parameters
    ----------
    taus
        The task matrices, ``[out, in]``, float64, of one shape (at least one).

    Returns
    -------
    NDArray[np.float64] | None
        ``[out, in]``, or ``None``: merge by the float64 SVD.
    """
    total = np.sum(taus, axis=0)
    if total.size == 0:
        return None
    factor = gram_polar(total)
    if factor is None:
        return None  # M rank deficient: its polar factor is not unique
    r = factor.mu.shape[0]
    sigma = np.sqrt(factor.mu)
    mean = float(sigma.mean())
    slack = GRAM_EPS * r * float(factor.mu[-1])  # each eigenvalue's absolute error
    sigma_error = float(np.minimum(slack / (2.0 * sigma), np.sqrt(slack)).sum()) / r
    if not factor.estimate + sigma_error / mean <= FAST_PATH_BOUND:
        return None
    out: NDArray[np.float64] = mean * factor.q
    return out


def _split(r: int, k: int, common_fraction: float) -> tuple[int, int]:
    """``(k_c, s)``: the common subspace's size and each task's (FusionBench's rule)."""
    common = int(r * common_fraction)
    per_task = min(round((r - common) / k), r // k)
    return r - k * per_task, per_task


def iso_cts_merge(
    taus: list[NDArray[np.float64]], common_fraction: float, precision: Precision = "auto"
) -> NDArray[np.float64]:
    """ISO-CTS's update ``σ̄ U_⊥ V_⊥ᵀ`` of the task matrices.

    Parameters
    ----------
    taus
        The task matrices, ``[out, in]``, float64, of one shape (at least one).
    common_fraction
        The fraction of the rank given to the common subspace.
    precision
        ``"auto"``: :func:`iso_cts_merge_fast`, or the float64 SVDs where it is not
        assured; ``"float64"``: the SVDs (see the module's description).

    Returns
    -------
    NDArray[np.float64]
        ``[out, in]``.
    """
    if min(taus[0].shape) == 0:
        return np.zeros(taus[0].shape)  # an empty tensor: no singular value to average
    if precision == "auto":
        fast = iso_cts_merge_fast(taus, common_fraction)
        if fast is not None:
            return fast
    common, per_task = _split(min(taus[0].shape), len(taus), common_fraction)
    u, s, vt = np.linalg.svd(np.sum(taus, axis=0), full_matrices=False)
    u_c, s_c, vt_c = u[:, :common], s[:common], vt[:common]
    us, ss, vts = [], [], []
    if per_task > 0:
        for tau in taus:
            specific = tau - u_c @ (u_c.T @ tau)
            u_t, s_t, vt_t = np.linalg.svd(specific, full_matrices=False)
            us.append(u_t[:, :per_task])
            ss.append(s_t[:per_task])
            vts.append(vt_t[:per_task])
    mean = float(np.concatenate([*ss, s_c]).mean())
    u_all = polar(np.concatenate([*us, u_c], axis=1))
    vt_all = polar(np.concatenate([*vts, vt_c], axis=0))
    out: NDArray[np.float64] = (mean * u_all) @ vt_all
    return out


def _norm_estimate(a: NDArray[np.float64]) -> float:
    """``‖a‖₂`` estimated by power iterations on ``aᵀa`` (from the all-ones vector)."""
    x = np.ones(a.shape[1])
    value = 0.0
    for _ in range(_POWER_STEPS):
        y = a.T @ (a @ x)
        value = float(np.linalg.norm(y))
        if value == 0.0:
            return float(np.abs(a).max()) * float(np.sqrt(a.size))  # the Frobenius bound
        x = y / value
    return float(np.sqrt(value))


def iso_cts_merge_fast(
    taus: list[NDArray[np.float64]], common_fraction: float
) -> NDArray[np.float64] | None:
    """ISO-CTS's update from Gram eigendecompositions, or ``None`` where the a-posteriori
    estimate of its error exceeds :data:`FAST_PATH_BOUND` (see the module's description).

    Parameters
    ----------
    taus
        The task matrices, ``[out, in]``, float64, of one shape (at least one).
    common_fraction
        The fraction of the rank given to the common subspace.

    Returns
    -------
    NDArray[np.float64] | None
        ``[out, in]``, or ``None``: merge by the float64 SVDs.
    """
    m, n = taus[0].shape
    if m == 0 or n == 0:
        return None
    common, per_task = _split(min(m, n), len(taus), common_fraction)
    u_c, s_c, v_c = np.zeros((m, 0)), np.zeros(0), np.zeros((n, 0))
    estimate = drift = 0.0
    if common > 0:
        shared = gram_triplets(np.sum(taus, axis=0), common, GRAM_SMALL_LIMIT)
        if shared is None:
            return None  # a kept singular value near zero, or equal ones at the cut
        u_c, s_c, v_c = shared.u, shared.s, shared.v
        estimate += sum(shared.terms)
        # How far U_c is from the exact common subspace, with the Gram's rounding grown
        # as √n (its typical growth) rather than n (the worst case), for the propagation
        # into the task-specific parts below (see the module's description).
        *cut, u_defect, v_defect = shared.terms
        drift = sum(cut) / np.sqrt(shared.lam.shape[0]) + u_defect + v_defect
    us, ss, vs, amplified = [], [], [], []
    for tau in taus if per_task > 0 else ():
        part = u_c.T @ tau
        own = gram_triplets(tau - u_c @ part, per_task, GRAM_SMALL_LIMIT)
        if own is None:
            return None
        estimate += sum(own.terms)
        if common > 0:
            root = np.sqrt(np.maximum(own.lam[::-1], 0.0))
            gap = float(root[per_task - 1] - (root[per_task] if per_task < root.size else 0.0))
            if not gap > 0.0:
                return None
            amplified.append((_norm_estimate(part), 1.0 / gap + 2.0 / float(own.s[-1])))
        us.append(own.u)
        ss.append(own.s)
        vs.append(own.v)
    s_all = np.concatenate([*ss, s_c])
    mean = float(s_all.mean())
    for norm, weight in amplified:
        estimate += drift * norm * (weight + 1.0 / mean)
    u_polar = gram_polar(np.concatenate([*us, u_c], axis=1))
    v_polar = gram_polar(np.concatenate([*vs, v_c], axis=1))
    if u_polar is None or v_polar is None:
        return None
    estimate += u_polar.estimate + v_polar.estimate
    if not estimate <= FAST_PATH_BOUND:
        return None
    out: NDArray[np.float64] = (mean * u_polar.q) @ v_polar.q.T
    return out


class IsoC(TaskMatrixMethod):
    name: ClassVar[str] = "iso_c"
    summary: ClassVar[str] = (
        "ISO-C (Marczak et al., ICML 2025): per matrix the sum of the task matrices with its "
        "singular values all set to their mean, × α"
    )
    options: ClassVar[type[NoOptions]] = IsoCOptions
    headline: ClassVar[tuple[str, ...]] = ("scaling",)

    def merge_matrices(
        self, name: str, matrices: TaskMatrices, inputs: MergeInputs
    ) -> NDArray[np.float64]:
        precision = inputs.options.own(IsoCOptions).precision
        return iso_c_merge(matrices.taus, precision)


class IsoCts(TaskMatrixMethod):
    name: ClassVar[str] = "iso_cts"
    summary: ClassVar[str] = (
        "ISO-CTS (Marczak et al., ICML 2025): per matrix a common subspace of the summed task "
        "matrices and each task's own top directions outside it, whitened, the spectrum "
        "flattened to its mean, × α"
    )
    options: ClassVar[type[NoOptions]] = IsoCtsOptions
    headline: ClassVar[tuple[str, ...]] = ("scaling", "common_space_fraction")
    oriented: ClassVar[bool] = True

    def merge_matrices(
        self, name: str, matrices: TaskMatrices, inputs: MergeInputs
    ) -> NDArray[np.float64]:
        options = inputs.options.own(IsoCtsOptions)
        return iso_cts_merge(matrices.taus, options.common_space_fraction, options.precision)
