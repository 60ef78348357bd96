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
from .task_matrices import MATRIX_SCALING, TaskMatrices, TaskMatrixMethod, polar

__all__ = ["TaskSingularVectors", "TaskSingularVectorsOptions", "tsv_merge"]


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


def tsv_merge(taus: list[NDArray[np.float64]], rank_fraction: float | None) -> NDArray[np.float64]:
    """The TSV-M update ``U_⊥ Σ V_⊥ᵀ`` of the task matrices ``taus`` (``[out, in]``, float64;
    see the module's description; at least one)."""
    m, n = taus[0].shape
    r = min(m, n)
    fraction = 1.0 / len(taus) if rank_fraction is None else rank_fraction
    k = max(1, int(r * fraction))
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
        fraction = inputs.options.own(TaskSingularVectorsOptions).rank_fraction
        return tsv_merge(matrices.taus, fraction)
