"""Regularized solves of symmetric positive-definite systems (Cholesky, float64)."""

from __future__ import annotations

import warnings
from types import TracebackType
from typing import Any, NamedTuple

import numpy as np
from numpy.typing import NDArray

from . import _core
from ._errors import NotPositiveDefiniteError, RegularizationWarning
from ._tensors import as_float64
from .config import resolve_threads

__all__ = ["SolveResult", "spd_solve"]


class SolveResult(NamedTuple):
    """Solution ``x`` and ``info`` (a ``SolveInfo``: ridge used, attempts, pivots)."""

    x: NDArray[np.float64]
    info: Any


class _SolverErrors:
    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if kind is not None and issubclass(kind, _core.core.NotPositiveDefiniteError):
            raise NotPositiveDefiniteError(str(error)) from None


#: ``with solver_errors:`` around every call into a solver of the core re-raises the native
#: module's ``NotPositiveDefiniteError`` as :class:`lmdx.NotPositiveDefiniteError`, message
#: unchanged (the native module imports nothing from the package, so it has its own type).
#: A plain object rather than a generator-based context manager: small solves are called
#: often, and this costs ~0.1 µs a call instead of ~1 µs.
solver_errors = _SolverErrors()


def warn_if_escalated(info: Any, name: str) -> None:
    if info.escalated:
        warnings.warn(
            f"{name}: not numerically positive definite; solved with relative ridge "
            f"{info.ridge:g} (x mean diagonal {info.mean_diagonal:g}) after "
            f"{info.attempts} attempts. Pass allow_regularization=False to make this an error.",
            RegularizationWarning,
            stacklevel=3,
        )


def spd_solve(
    a: Any,
    b: Any,
    *,
    alpha: float = 1.0,
    ridge: float = 0.0,
    allow_regularization: bool = True,
    name: str = "system",
    n_threads: int | None = None,
) -> SolveResult:
    """Solve ``(α·A + (1−α)·diag(A) + ridge·mean(diag A)·I) x = b`` by Cholesky.

    Parameters
    ----------
    a
        Symmetric matrix, shape (d, d); one triangle is read.
    b
        Right-hand side(s), shape (d,) or (d, k).
    alpha
        Off-diagonal scaling in [0, 1] (RegMean's reduction); 1 leaves ``a`` as is.
    ridge
        Ridge relative to the mean diagonal of ``a``.
    allow_regularization
        If the system is not numerically positive definite, raise the relative ridge
        (×10 from 1e-10) until it factors and warn (:class:`RegularizationWarning`);
        if False, raise :class:`NotPositiveDefiniteError` instead.
    name
        Names the system in errors and warnings.

    Returns
    -------
    SolveResult
        ``x`` with the shape of ``b`` and ``info`` (``ridge``, ``escalated``, ``attempts``,
        ``min_pivot``, ``max_pivot``, ``rcond_estimate``).
    """
    with solver_errors:
        x, info = _core.core.spd_solve(
            a=as_float64(a, "a"),
            b=as_float64(b, "b"),
            alpha=float(alpha),
            ridge=float(ridge),
            allow_regularization=bool(allow_regularization),
            name=str(name),
            n_threads=resolve_threads(n_threads),
        )
    warn_if_escalated(info, name)
    return SolveResult(x, info)
