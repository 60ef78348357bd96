"""The options of one merge, checked once for both front doors (in memory and streaming)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from .._errors import MergeError
from .._tensors import OUTPUT_DTYPES
from .._util import parse_size

__all__ = ["HEAD_POLICIES", "METHODS", "PRECISIONS", "MergeOptions"]

METHODS = ("regmean", "average", "fisher", "task_arithmetic", "regmean_plusplus")
HEAD_POLICIES = ("keep", "drop")
PRECISIONS = ("auto", "float64")


@dataclass(frozen=True)
class MergeOptions:
    """What to merge and how; :meth:`checked` validates user input into one.

    Attributes
    ----------
    method
        ``"regmean"``, ``"average"``, ``"fisher"``, ``"task_arithmetic"`` or
        ``"regmean_plusplus"`` (:mod:`lmdx.merge.regmean_plusplus`).
    alpha
        RegMean's (and RegMean++'s) off-diagonal scale in [0, 1].
    coefficients
        Per-model non-negative coefficients (None: all equal).
    exclude
        ``fnmatch`` patterns of module names RegMean must not solve (averaged instead).
    heads
        ``fnmatch`` patterns of parameter names that are task heads (not merged).
    head_policy
        Writing a folder: ``"keep"`` every model's head or ``"drop"`` them.
    scaling, fisher_eps, ridge, allow_regularization
        λ of task arithmetic; ε of Fisher averaging; the RegMean solves' relative ridge
        and whether the solver may raise it.
    precision
        RegMean's right-hand-side products: ``"auto"`` (float32 where the estimated error
        stays below 1e-6 of the weights, else float64) or ``"float64"``.
    dtype
        Writing a folder: ``"auto"`` (each tensor's input dtype) or a float dtype.
    max_shard_size
        Writing a folder: largest output shard, bytes.
    n_threads
        Threads of the native kernels (None: :func:`lmdx.default_threads`).
    """

    method: str = "regmean"
    alpha: float = 1.0
    coefficients: tuple[float, ...] | None = None
    exclude: tuple[str, ...] = ()
    heads: tuple[str, ...] = ()
    head_policy: str = "keep"
    scaling: float = 0.3
    fisher_eps: float = 1e-8
    ridge: float = 0.0
    allow_regularization: bool = True
    precision: str = "auto"
    dtype: str = "auto"
    max_shard_size: int = 2 * 10**9
    n_threads: int | None = field(default=None)

    @classmethod
    def checked(
        cls,
        k: int,
        *,
        method: str = "regmean",
        alpha: float = 1.0,
        coefficients: Sequence[float] | None = None,
        exclude: Sequence[str] = (),
        heads: Sequence[str] = (),
        head_policy: str = "keep",
        scaling: float = 0.3,
        fisher_eps: float = 1e-8,
        ridge: float = 0.0,
        allow_regularization: bool = True,
        precision: str = "auto",
        dtype: str = "auto",
        max_shard_size: int | str = "2GB",
        n_threads: int | None = None,
    ) -> MergeOptions:
        """Options for merging ``k`` models; :class:`MergeError` names what is wrong."""
        if method not in METHODS:
            raise MergeError(f"method: expected one of {METHODS}, got {method!r}")
        if head_policy not in HEAD_POLICIES:
            raise MergeError(f"head_policy: expected 'keep' or 'drop', got {head_policy!r}")
        if dtype not in OUTPUT_DTYPES:
            raise MergeError(f"dtype: expected one of {OUTPUT_DTYPES}, got {dtype!r}")
        if not 0.0 <= alpha <= 1.0:
            raise MergeError(f"alpha: must be in [0, 1], got {alpha}")
        if precision not in PRECISIONS:
            raise MergeError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
        if k < 2:
            raise MergeError(f"need at least 2 models to merge, got {k}")
        try:
            shard = parse_size(max_shard_size)
        except ValueError:
            raise MergeError(
                f"max_shard_size: expected e.g. '2GB' or bytes, got {max_shard_size!r}"
            ) from None
        return cls(
            method=method,
            alpha=float(alpha),
            coefficients=_coefficients(coefficients, k),
            exclude=tuple(exclude),
            heads=tuple(heads),
            head_policy=head_policy,
            scaling=float(scaling),
            fisher_eps=float(fisher_eps),
            ridge=float(ridge),
            allow_regularization=bool(allow_regularization),
            precision=precision,
            dtype=dtype,
            max_shard_size=shard,
            n_threads=n_threads,
        )


def _coefficients(coefficients: Sequence[float] | None, k: int) -> tuple[float, ...] | None:
    if coefficients is None:
        return None
    coef = tuple(float(c) for c in coefficients)
    if len(coef) != k:
        raise MergeError(f"coefficients: {len(coef)} values for {k} models")
    if any(not math.isfinite(c) or c < 0 for c in coef) or sum(coef) <= 0:
        raise MergeError(f"coefficients: must be finite, >= 0 and not all 0, got {list(coef)}")
    return coef
