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
from .task_matrices import MATRIX_SCALING, TaskMatrices, TaskMatrixMethod, polar

__all__ = ["IsoC", "IsoCOptions", "IsoCts", "IsoCtsOptions", "iso_c_merge", "iso_cts_merge"]


class IsoCOptions(NoOptions):
    """ISO-C: α 1 (FusionBench's)."""

    scaling: Annotated[float, MATRIX_SCALING] = 1.0


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


def iso_c_merge(taus: list[NDArray[np.float64]]) -> NDArray[np.float64]:
    """ISO-C's update ``σ̄ U Vᵀ`` of ``M = Σ taus`` (``[out, in]``, float64)."""
    total = np.sum(taus, axis=0)
    u, s, vt = np.linalg.svd(total, full_matrices=False)
    out: NDArray[np.float64] = (float(s.mean()) * u) @ vt
    return out


def iso_cts_merge(taus: list[NDArray[np.float64]], common_fraction: float) -> NDArray[np.float64]:
    """ISO-CTS's update ``σ̄ U_⊥ V_⊥ᵀ`` of the task matrices ``taus`` (``[out, in]``,
    float64; see the module's description)."""
    k = len(taus)
    r = min(taus[0].shape)
    common = int(r * common_fraction)
    per_task = min(round((r - common) / k), r // k)
    common = r - k * per_task
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
        return iso_c_merge(matrices.taus)


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
        fraction = inputs.options.own(IsoCtsOptions).common_space_fraction
        return iso_cts_merge(matrices.taus, fraction)
