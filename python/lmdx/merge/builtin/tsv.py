"""``tsv_m`` (Task Singular Vectors: Merge, Gargiulo et al., CVPR 2025, arXiv 2412.00081):
each task matrix cut to its top singular vectors, the vectors of all tasks concatenated and
whitened (made orthonormal), the matrix rebuilt and scaled.

Per task matrix (:mod:`lmdx.merge.builtin.task_matrices`: ``c_i τ_i`` of a 2-D tensor, for
the K models with ``c_i > 0``), of rank at most ``r = min(out, in)``:

1. the thin SVD ``c_i τ_i = U_i Σ_i V_iᵀ``, cut to its ``k = max(1, ⌊r · f⌋)`` largest
   singular triplets (``f``: ``rank_fraction``, default ``1/K``);
2. ``U = [U_1k … U_Kk]``, ``Σ = diag(Σ_1k … Σ_Kk)``, ``V = [V_1k … V_Kk]``; triplets with a
   singular value that is numerically zero (at most ``ε · max(out, in) · σ_max``, ``σ_max``
   the largest of all tasks) are left out: their vectors are arbitrary and add nothing;
3. ``U`` and ``V`` whitened to their orthogonal polar factors ``U_⊥``, ``V_⊥`` (the
   orthonormal matrices nearest to them: ``P Qᵀ`` from the thin SVD ``P S Qᵀ``), as the
   paper's code orthogonalizes them;
4. the merged update ``α · U_⊥ Σ V_⊥ᵀ`` (``α``: ``scaling``, the paper's and FusionBench's
   default 1).

``precision: float64`` computes exactly that: NumPy's float64 SVDs (K of the task
matrices, two for the polar factors). The default, ``precision: auto``, computes the same
quantities from float64 eigendecompositions of Grams, two to four times as fast at
BERT-base shapes (bench/bench_svd_methods.py): with ``τ`` oriented so that ``in ≤ out``,
``V_ik`` and ``σ²`` are the top ``k`` eigenpairs of ``τᵀτ``, ``U_ik = τ V_ik / σ`` (``σ``
the norms of ``τ V_ik``'s columns), and a polar factor is ``U (UᵀU)^(-1/2)`` (``(U Uᵀ)^(-1/2) U`` if
``U`` is wide) from the eigendecomposition of its Gram. Its contract: **the merged update
is within a relative Frobenius** :data:`FAST_PATH_BOUND` (``1e-6``) **of the float64 SVD
definition**, where that definition is itself well posed. Squaring a matrix squares its
condition, so each tensor's result is checked a posteriori by a first-order error
estimate, the sum of

* per task, the cut's sensitivity ``ε · n · λ_1 / (λ_k − λ_{k+1})`` (``λ`` the Gram's
  eigenvalues, ``n`` its order; none if ``k = n``) and the orthonormality defects
  ``max |U_ikᵀ U_ik − I|``, ``max |V_ikᵀ V_ik − I|``;
* per polar factor, ``ε · μ_max / μ_min`` (``μ`` its Gram's eigenvalues);

and a tensor whose estimate exceeds the bound, or whose smallest kept ``σ`` is below
``1e-4`` of its largest, is merged by the float64 SVDs instead (near-equal singular
values at the cut, two identical or collinear tasks, rank-deficient task matrices or
``k`` above a task's rank: the cases where the Grams lose what the SVDs keep). A task
matrix of zeros adds nothing on both paths, all of zeros give a zero update, and an empty
tensor takes the SVD path. On BERT-base-shaped 2 % deltas (slowly decaying spectra),
K = 3, the estimate's median is ``2e-9`` and the largest observed difference ``3e-9``; one
768 x 768 matrix in 72 falls back (estimate ``7e-5``: its ``U``'s Gram has a condition
near ``3e11``). The estimate is first order and was checked, not proven: over thousands
of drawn cases (tests/merge/test_tsv_fast.py) the difference stayed below a fifth of the
bound. torch's float32 ``eigh`` (faster alone) was measured and not used: its backward
error, about ``60 ε₃₂`` of the Gram's norm, leaves ``1e-5`` in the merged update, and its
threads run two to four times slower right after NumPy's.

Every other tensor is ``θ_0 + α ×`` the coefficient-weighted mean of the task vectors
(FusionBench's TSV-M: the mean, then ``× α``). The result does not depend on a matrix's
orientation (transposing a task matrix transposes its SVD), so ``Conv1D`` weights need no
care.
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
    "TaskSingularVectors",
    "TaskSingularVectorsOptions",
    "tsv_merge",
    "tsv_merge_fast",
]


class TaskSingularVectorsOptions(NoOptions):
    """TSV-M: α 1 and the top 1/K of each task matrix's singular vectors (the paper's)."""

    scaling: Annotated[float, MATRIX_SCALING] = 1.0
    rank_fraction: Annotated[
        float | None,
        Field(
            gt=0.0,
            le=1.0,
            description="the fraction of each task matrix's rank kept (default 1/K for K "
            "models: the concatenation has the matrix's full rank)",
            json_schema_extra={"label": "must be in (0, 1] (the fraction of the rank kept)"},
        ),
    ] = None
    precision: Annotated[Precision, GRAM_PRECISION] = "auto"


def tsv_merge(
    taus: list[NDArray[np.float64]],
    rank_fraction: float | None,
    precision: Precision = "auto",
) -> NDArray[np.float64]:
    """The TSV-M update ``U_⊥ Σ V_⊥ᵀ`` of the task matrices ``taus``.

    Parameters
    ----------
    taus
        The task matrices, ``[out, in]``, float64, of one shape (at least one).
    rank_fraction
        The fraction of each one's rank kept (``None``: ``1/K``).
    precision
        ``"auto"``: :func:`tsv_merge_fast`, or the float64 SVDs where it is not assured;
        ``"float64"``: the SVDs (see the module's description).

    Returns
    -------
    NDArray[np.float64]
        ``[out, in]``.
    """
    if precision == "auto":
        fast = tsv_merge_fast(taus, rank_fraction)
        if fast is not None:
            return fast
    return _tsv_svd(taus, _rank_kept(taus, rank_fraction))


def _rank_kept(taus: list[NDArray[np.float64]], rank_fraction: float | None) -> int:
    fraction = 1.0 / len(taus) if rank_fraction is None else rank_fraction
    return max(1, int(min(taus[0].shape) * fraction))


def _tsv_svd(taus: list[NDArray[np.float64]], k: int) -> NDArray[np.float64]:
    """The float64 definition: K thin SVDs, the polar factors by SVD."""
    m, n = taus[0].shape
    us, ss, vts = [], [], []
    for tau in taus:
        u, s, vt = np.linalg.svd(tau, full_matrices=False)
        us.append(u[:, :k])
        ss.append(s[:k])
        vts.append(vt[:k])
    s_all = np.concatenate(ss)
    floor = np.finfo(np.float64).eps * max(m, n) * float(s_all.max(initial=0.0))
    keep = s_all > floor
    if not keep.any():
        return np.zeros((m, n))
    u_all = np.concatenate(us, axis=1)[:, keep]
    vt_all = np.concatenate(vts, axis=0)[keep]
    out: NDArray[np.float64] = (polar(u_all) * s_all[keep]) @ polar(vt_all)
    return out


def tsv_merge_fast(
    taus: list[NDArray[np.float64]], rank_fraction: float | None
) -> NDArray[np.float64] | None:
    """The TSV-M update by float64 Gram eigendecompositions, or ``None`` where the
    a-posteriori estimate of its error exceeds :data:`FAST_PATH_BOUND` (see the module's
    description).

    Parameters
    ----------
    taus
        The task matrices, ``[out, in]``, float64, of one shape (at least one).
    rank_fraction
        The fraction of each one's rank kept (``None``: ``1/K``).

    Returns
    -------
    NDArray[np.float64] | None
        ``[out, in]``, or ``None``: merge by the float64 SVDs.
    """
    m, n = taus[0].shape
    if m == 0 or n == 0:
        return None
    k = _rank_kept(taus, rank_fraction)
    tall = [t if m >= n else t.T for t in taus]
    norms = [float(np.linalg.norm(t)) for t in tall]
    if max(norms) == 0.0:
        return np.zeros((m, n))
    us, ss, vs = [], [], []
    estimate = 0.0
    for tau, norm in zip(tall, norms, strict=True):
        if norm == 0.0:
            continue  # a zero task matrix: every singular value is zero, none is kept
        triplets = gram_triplets(tau, k, GRAM_SMALL_LIMIT)
        if triplets is None:
            return None  # a kept singular value near zero, or equal eigenvalues at the cut
        us.append(triplets.u)
        ss.append(triplets.s)
        vs.append(triplets.v)
        for term in triplets.terms:
            estimate += term
    s_all = np.concatenate(ss)
    if not float(s_all.min()) > 2.0 * GRAM_EPS * max(m, n) * float(s_all.max()):
        return None  # near the SVD path's floor for "numerically zero": its choice
    u_polar = gram_polar(np.concatenate(us, axis=1))
    v_polar = gram_polar(np.concatenate(vs, axis=1))
    if u_polar is None or v_polar is None:
        return None
    estimate += u_polar.estimate + v_polar.estimate
    if not estimate <= FAST_PATH_BOUND:
        return None
    out: NDArray[np.float64] = (u_polar.q * s_all) @ v_polar.q.T
    return out if m >= n else out.T


class TaskSingularVectors(TaskMatrixMethod):
    name: ClassVar[str] = "tsv_m"
    summary: ClassVar[str] = (
        "TSV-M (Gargiulo et al., CVPR 2025): per matrix each task's top singular vectors "
        "(1/K of the rank), concatenated, whitened to orthonormal, rebuilt, × α"
    )
    options: ClassVar[type[NoOptions]] = TaskSingularVectorsOptions
    headline: ClassVar[tuple[str, ...]] = ("scaling", "rank_fraction")

    def merge_matrices(
        self, name: str, matrices: TaskMatrices, inputs: MergeInputs
    ) -> NDArray[np.float64]:
        options = inputs.options.own(TaskSingularVectorsOptions)
        return tsv_merge(matrices.taus, options.rank_fraction, options.precision)
