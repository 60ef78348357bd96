"""The options of one merge, checked once for both front doors (in memory and streaming)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass, field

from .._errors import MergeError
from .._tensors import OUTPUT_DTYPES
from .._util import parse_size

__all__ = [
    "DEFAULT_DENSITY",
    "DEFAULT_SCALING",
    "ELECTING_METHODS",
    "HEAD_POLICIES",
    "METHODS",
    "PRECISIONS",
    "RANDOM_METHODS",
    "SPARSIFYING_METHODS",
    "TASK_VECTOR_METHODS",
    "MergeOptions",
]

METHODS = (
    "regmean",
    "average",
    "fisher",
    "task_arithmetic",
    "ties",
    "dare",
    "dare_ties",
    "regmean_plusplus",
)
HEAD_POLICIES = ("keep", "drop")
PRECISIONS = ("auto", "float32", "float64")
#: Methods that merge task vectors ``θ_i − θ_base`` against a ``base`` model, scaled by λ.
TASK_VECTOR_METHODS = ("task_arithmetic", "ties", "dare", "dare_ties")
#: Methods that keep a fraction ``density`` of every task vector's entries.
SPARSIFYING_METHODS = ("ties", "dare", "dare_ties")
#: Methods that drop entries at random (seeded by ``seed``): DARE.
RANDOM_METHODS = ("dare", "dare_ties")
#: Methods that elect a sign per entry and average the agreeing entries (TIES).
ELECTING_METHODS = ("ties", "dare_ties")
#: λ when none is given: where task vectors are summed, lmdx's task-arithmetic default 0.3
#: (also FusionBench's DARE config), so that DARE at density 1 is task arithmetic; where
#: they are averaged (sign election), the TIES paper's recommended λ = 1.
DEFAULT_SCALING = {"task_arithmetic": 0.3, "dare": 0.3, "ties": 1.0, "dare_ties": 1.0}
#: ``density`` when none is given: the TIES paper's top 20 %; FusionBench's DARE configs
#: (sparsity ratio 0.5).
DEFAULT_DENSITY = {"ties": 0.2, "dare": 0.5, "dare_ties": 0.5}


@dataclass(frozen=True)
class MergeOptions:
    """What to merge and how; :meth:`checked` validates user input into one.

    Attributes
    ----------
    method
        ``"regmean"``, ``"average"``, ``"fisher"``, ``"task_arithmetic"``, ``"ties"``,
        ``"dare"``, ``"dare_ties"`` or ``"regmean_plusplus"``
        (:mod:`lmdx.merge.regmean_plusplus`).
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
        λ of the task-vector methods (:data:`DEFAULT_SCALING` when not given); ε of
        Fisher averaging; the RegMean solves' relative ridge and whether the solver may
        raise it.
    density
        ``ties``: the fraction of each task vector's entries kept (largest magnitudes);
        ``dare``/``dare_ties``: the probability of keeping each entry. In (0, 1].
    seed
        ``dare``/``dare_ties``: the seed of the random drops (a whole number >= 0).
    precision
        RegMean's solves: ``"auto"`` (per layer float32 where a certificate bounds the
        relative output error by 1e-6, else float64), ``"float32"`` (always, with the
        estimate reported) or ``"float64"`` (see :func:`lmdx.regmean_merge_layer`).
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
    density: float = 1.0
    seed: int = 0
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
        scaling: float | None = None,
        density: float | None = None,
        seed: int | None = None,
        fisher_eps: float = 1e-8,
        ridge: float = 0.0,
        allow_regularization: bool = True,
        precision: str = "auto",
        dtype: str = "auto",
        max_shard_size: int | str = "2GB",
        n_threads: int | None = None,
    ) -> MergeOptions:
        """Options for merging ``k`` models; :class:`MergeError` names what is wrong.

        ``scaling``, ``density`` and ``seed`` are None for the method's default and refused
        by methods that do not use them."""
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
            scaling=_scaling(method, scaling),
            density=_density(method, density),
            seed=_seed(method, seed),
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


def _unused(key: str, method: str, users: Sequence[str]) -> MergeError:
    return MergeError(f"{key}: only used by {', '.join(users)}, not {method!r}; leave it out")


def _scaling(method: str, scaling: float | None) -> float:
    if scaling is None:
        return DEFAULT_SCALING.get(method, MergeOptions.scaling)
    if method not in TASK_VECTOR_METHODS:
        raise _unused("scaling", method, TASK_VECTOR_METHODS)
    if isinstance(scaling, bool) or not math.isfinite(scaling):
        raise MergeError(f"scaling: expected a finite number, got {scaling!r}")
    return float(scaling)


def _density(method: str, density: float | None) -> float:
    if density is None:
        return DEFAULT_DENSITY.get(method, MergeOptions.density)
    if method not in SPARSIFYING_METHODS:
        raise _unused("density", method, SPARSIFYING_METHODS)
    if isinstance(density, bool) or not 0.0 < density <= 1.0:
        raise MergeError(
            f"density: must be in (0, 1] (the fraction of each task vector kept), got {density!r}"
        )
    return float(density)


def _seed(method: str, seed: int | None) -> int:
    if seed is None:
        return MergeOptions.seed
    if method not in RANDOM_METHODS:
        raise _unused("seed", method, RANDOM_METHODS)
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or seed < 0:
        raise MergeError(f"seed: expected a whole number >= 0, got {seed!r}")
    return int(seed)
