"""Element-wise weighted and Fisher-weighted averages of K same-shaped tensors."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from . import _core
from ._tensors import as_tensor_array
from .config import resolve_threads

__all__ = ["fisher_average", "weighted_average"]


def weighted_average(
    tensors: Sequence[Any],
    coefficients: Sequence[float] | None = None,
    *,
    dtype: str = "float64",
    n_threads: int | None = None,
) -> NDArray[Any]:
    """``Σ c_i x_i / Σ c_i`` element-wise, accumulated in float64.

    Parameters
    ----------
    tensors
        K arrays or tensors of one shape (float32/float64; narrower floats are widened),
        finite (else ``ValueError`` naming the first that is not).
    coefficients
        Optional K non-negative coefficients, not all zero (default: all 1).
    dtype
        ``"float64"``, or ``"float32"``: the float64 average rounded once to nearest, in
        the same pass (what casting the float64 result gives, without it).

    Returns
    -------
    numpy.ndarray
        An array of ``dtype`` and the common shape.
    """
    arrays = [as_tensor_array(t, f"tensors[{i}]") for i, t in enumerate(tensors)]
    coef = None if coefficients is None else [float(c) for c in coefficients]
    return np.asarray(
        _core.core.weighted_average(
            tensors=arrays, coefficients=coef, dtype=dtype, n_threads=resolve_threads(n_threads)
        )
    )


def fisher_average(
    params: Sequence[Any],
    fishers: Sequence[Any],
    coefficients: Sequence[float] | None = None,
    *,
    eps: float = 0.0,
    n_threads: int | None = None,
) -> NDArray[np.float64]:
    """Fisher-weighted average ``Σ c_i (F_i+ε) θ_i / Σ c_i (F_i+ε)`` element-wise (float64).

    Parameters
    ----------
    params
        K parameter tensors ``θ_i`` of one shape.
    fishers
        K diagonal Fisher estimates ``F_i >= 0`` (mean squared gradients), same shape.
    coefficients
        Optional K non-negative per-model coefficients ``c_i``.
    eps
        Added to every Fisher value; must be > 0 where all Fishers are 0.
    """
    p = [as_tensor_array(t, f"params[{i}]") for i, t in enumerate(params)]
    f = [as_tensor_array(t, f"fishers[{i}]") for i, t in enumerate(fishers)]
    coef = None if coefficients is None else [float(c) for c in coefficients]
    return np.asarray(
        _core.core.fisher_average(
            params=p,
            fishers=f,
            coefficients=coef,
            eps=float(eps),
            n_threads=resolve_threads(n_threads),
        )
    )
