"""RegMean merge of one linear layer (Jin et al., ICLR 2023, arXiv 2212.09849)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, NamedTuple

import numpy as np
from numpy.typing import NDArray

from . import _core
from ._tensors import as_float64, as_tensor_array
from .config import resolve_threads
from .moments import Moments
from .spd import solver_errors, warn_if_escalated

__all__ = [
    "PRECISION_DESCRIPTION",
    "RegMeanResult",
    "SolvePrecision",
    "regmean_low_rank_solve",
    "regmean_merge_layer",
]

#: The precisions of a RegMean solve (``regmean_merge_layer``'s ``precision``).
SolvePrecision = Literal["auto", "float32", "float32-rhs", "float64"]
#: What each precision does, in one line (the merge options' help).
PRECISION_DESCRIPTION = (
    "auto: per layer float32 where a certificate bounds the relative output error by 1e-6, "
    "else the float32 right-hand side with the float64 factorization and solve where its "
    "certificate does, else float64; float32, float32-rhs: always (estimate reported); "
    "float64: always"
)


class RegMeanResult(NamedTuple):
    """Merged weight (float64, same layout as the inputs) and the solver's ``info``."""

    weight: NDArray[np.float64]
    info: Any


def regmean_merge_layer(
    grams: Sequence[Any],
    weights: Sequence[Any],
    counts: Sequence[float] | None = None,
    *,
    alpha: float = 1.0,
    coefficients: Sequence[float] | None = None,
    layout: Literal["linear", "conv1d"] = "linear",
    precision: SolvePrecision = "auto",
    noise_floor: float = 0.0,
    ridge: float = 0.0,
    allow_regularization: bool = True,
    name: str = "layer",
    n_threads: int | None = None,
) -> RegMeanResult:
    """Merge one linear layer of K models with RegMean.

    With ``Ĝ_i = G_i / n_i`` and ``G̃_i = α·Ĝ_i + (1−α)·diag(Ĝ_i)``::

        W_Mᵀ = (Σ_i c_i G̃_i)⁻¹ Σ_i c_i G̃_i W_iᵀ

    solved by Cholesky (never an explicit inverse), without forming the K reduced Grams,
    for the deviation from the coefficient-weighted average
    ``W̄ = Σ c_i W_i / Σ c_i``::

        W_Mᵀ = W̄ᵀ + (Σ_i c_i G̃_i + ridge·I)⁻¹ Σ_i c_i G̃_i (W_i − W̄)ᵀ

    The same where ``Σ c_i G̃_i`` is positive definite; but a model merged with itself and
    weights equal in every model come back bit-exact, and input directions no statistics
    reached keep the average (a ridge does not pull them toward zero).

    The core keeps a layer's large matrices (4 MB and more, at most 1 GiB in all) for the
    next call with the same shapes, which then faults no fresh memory; results never
    depend on it. A merge frees them when it ends; after merging layers yourself,
    :func:`lmdx.release_memory` does.

    Parameters
    ----------
    grams
        K input Gram matrices ``G_i = Σ x xᵀ``: arrays of shape (d_in, d_in), or their
        upper triangles packed row by row (shape ``(d_in (d_in + 1) / 2,)``, as statistics
        files store them: no full matrix is formed), or :class:`Moments` (then ``counts``
        come from them).
    weights
        K weights: shape (d_out, d_in) for ``layout="linear"`` (torch ``nn.Linear``) or
        (d_in, d_out) for ``layout="conv1d"`` (Hugging Face GPT-2 ``Conv1D``).
    counts
        K row counts ``n_i`` the Grams were summed over (required for arrays).
    alpha
        Off-diagonal scaling in [0, 1]; 1 is plain RegMean, 0 a per-input-feature
        weighted average.
    coefficients
        Optional K non-negative per-model coefficients ``c_i``.
    precision
        ``"auto"``: layers large enough to be threaded are factored, multiplied and solved
        in float32, then certified: float64 residuals on 16 random probe columns estimate
        the relative output error ``‖W − W₆₄‖_S / ‖W₆₄‖_S`` against the float64 formula
        (``S = Σ c_i G̃_i``, ``‖A‖²_S = tr(A S Aᵀ)``: the relative RMS change of the
        layer's outputs on the statistics' rows), times a safety margin of 4. The float32
        result is kept where that estimate is ``<= 1e-6``; otherwise (or where the float32
        factorization fails) the layer is factored and solved in float64 with the float32
        right-hand side (its error, without the float32 factor's, certified the same way)
        and, where that certificate exceeds 1e-6 too -- or float32 was predicted far out
        of reach before its products -- solved in float64. ``"float32"`` keeps
        the float32 result whatever its estimate (a failed float32 factorization still
        falls back to float64), ``"float32-rhs"`` the float32 right-hand side's;
        ``"float64"`` solves in float64 (weight error far below 1e-6).
        ``info.precision`` says what was used (``"identical"``: the weights are equal in
        every model and are returned as they are) and ``info.output_error_estimate`` the
        certified estimate (0 for float64 and identical). See ``docs/accuracy.md``.
    noise_floor
        The relative rounding of the Grams' entries: their accumulation precision
        (``2**-24`` for statistics collected with float32 products summed in float64,
        ``lmdx.merge.builtin.regmean_solve.GRAM_ROUNDOFF``; 0 for exact Grams).
        Directions whose eigenvalue of ``Σ c_i G̃_i`` is at most
        ``√d_in·(noise_floor·mean(diag) + 2⁻⁵²·λ_max)`` are below what the statistics (and
        the eigendecomposition) can tell from their own rounding: they keep the average,
        as directions the statistics never saw (an eigendecomposition of the system, only
        for layers whose factorization shows a pivot near that floor or needs a ridge;
        ``info.unseen_directions`` counts them).
    ridge
        As in :func:`lmdx.spd_solve`.
    allow_regularization
        As in :func:`lmdx.spd_solve`: a singular sum (an input feature never active in any
        model) is regularized with a warning unless this is False.
    name
        Layer name for errors and warnings.

    Returns
    -------
    RegMeanResult
        ``weight`` (float64, shape of the inputs) and ``info`` (a ``RegMeanInfo``: the
        solver's ``SolveInfo`` fields plus ``precision``, ``condition_estimate``,
        ``output_error_estimate``, ``relative_spread``, ``unseen_directions``).
    """
    grams = list(grams)
    gram_arrays = []
    resolved_counts: list[float] = []
    for i, g in enumerate(grams):
        if isinstance(g, Moments):
            gram_arrays.append(g.gram())
            resolved_counts.append(g.count)
        else:
            gram_arrays.append(as_float64(g, f"{name}: grams[{i}]"))  # full or packed
    if counts is not None:
        if len(counts) != len(grams):
            raise ValueError(
                f"{name}: counts has {len(counts)} entries but there are {len(grams)} grams"
            )
        resolved_counts = [float(c) for c in counts]
    elif len(resolved_counts) != len(grams):
        raise ValueError(f"{name}: counts are required when grams are arrays")
    weight_arrays = [as_tensor_array(w, f"{name}: weights[{i}]") for i, w in enumerate(weights)]
    with solver_errors:
        merged, info = _core.core.regmean_merge_layer(
            grams=gram_arrays,
            weights=weight_arrays,
            counts=resolved_counts,
            alpha=float(alpha),
            coefficients=None if coefficients is None else [float(c) for c in coefficients],
            layout=str(layout),
            precision=str(precision),
            noise_floor=float(noise_floor),
            ridge=float(ridge),
            allow_regularization=bool(allow_regularization),
            name=str(name),
            n_threads=resolve_threads(n_threads),
        )
    warn_if_escalated(info, name)
    return RegMeanResult(merged, info)


def regmean_low_rank_solve(
    grams: Sequence[Any],
    factors: Sequence[Any],
    counts: Sequence[float],
    *,
    alpha: float = 1.0,
    coefficients: Sequence[float] | None = None,
    ridge: float = 0.0,
    allow_regularization: bool = True,
    name: str = "layer",
    n_threads: int | None = None,
) -> tuple[NDArray[np.float64], Any]:
    """The RegMean solve of K low-rank updates ``B_i A_i`` of one base weight.

    With ``S = Σ_i c_i G̃_i + λI`` (``G̃_i`` as in :func:`regmean_merge_layer`, reduced by
    the same native helper; ``λ`` the ridge the Cholesky factorization ends up with) and
    ``C = Σ c_i``::

        F = S⁻¹ [c_1 G̃_1 A_1ᵀ … c_K G̃_K A_Kᵀ] + λ S⁻¹ [c_1 A_1ᵀ/C … c_K A_Kᵀ/C]

    so that the RegMean merge of the weights ``W₀ + B_i A_i`` is
    ``W₀ + [B_1 … B_K] Fᵀ`` (``lmdx.merge.builtin.regmean``). ``O(d_in² Σ r_i)`` work
    besides the factorization.

    Parameters
    ----------
    grams
        K input Grams, full (d_in, d_in) or packed upper triangles (float64).
    factors
        K matrices ``A_i``, shape (r_i, d_in).
    counts
        K row counts ``n_i``.
    alpha, coefficients, ridge, allow_regularization, name, n_threads
        As in :func:`regmean_merge_layer`.

    Returns
    -------
    (F, info)
        ``F`` (float64, (d_in, R), ``R`` the sum of the ranks of the models with
        ``c_i > 0``, in model order) and the factorization's ``SolveInfo``.
    """
    gram_arrays = [as_float64(g, f"{name}: grams[{i}]") for i, g in enumerate(grams)]
    factor_arrays = [as_float64(a, f"{name}: factors[{i}]") for i, a in enumerate(factors)]
    with solver_errors:
        f, info = _core.core.regmean_low_rank_solve(
            grams=gram_arrays,
            factors=factor_arrays,
            counts=[float(c) for c in counts],
            alpha=float(alpha),
            coefficients=None if coefficients is None else [float(c) for c in coefficients],
            ridge=float(ridge),
            allow_regularization=bool(allow_regularization),
            name=str(name),
            n_threads=resolve_threads(n_threads),
        )
    warn_if_escalated(info, name)
    return f, info
