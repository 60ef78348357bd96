"""The arithmetic of one merge step: a RegMean input group, or one averaged, Fisher-weighted
or task-arithmetic tensor. Every step computes in float64 with the native kernels and is
shared by every front door (models in memory, checkpoints on disk, Ray workers).

* ``regmean`` (Jin et al., 2023): every linear weight with statistics in all K files is
  solved in closed form, ``W_Mᵀ = (Σ c_i G̃_i)⁻¹ Σ c_i G̃_i W_iᵀ`` with
  ``G̃_i = α·G_i/n_i + (1−α)·diag(G_i/n_i)``; modules that share an input Gram (q/k/v)
  are solved together (one factorization). Everything else is averaged.
* ``average``: ``Σ c_i θ_i / Σ c_i``.
* ``fisher``: ``Σ c_i (F_i+ε) θ_i / Σ c_i (F_i+ε)`` with ``F_i`` the mean squared
  gradients from :func:`lmdx.collect_fisher`.
* ``task_arithmetic``: ``θ_0 + λ Σ c_i (θ_i − θ_0)`` from a base model ``θ_0``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._errors import MergeError
from .._tensors import as_float64, as_numpy, as_tensor_array, cast_float, is_tensor
from .._util import matches
from ..average import fisher_average, weighted_average
from ..regmean import regmean_merge_layer
from ..stats.file import Statistics
from .options import MergeOptions

__all__ = [
    "average_tensor",
    "cast_merged",
    "checked_finite",
    "fisher_tensor",
    "poorly_determined",
    "regmean_groups",
    "solve_group",
    "task_arithmetic_tensor",
]


def checked_finite(name: str, arr: Any, dtype: str | None = None) -> Any:
    """``arr`` (a NumPy array or torch tensor) unchanged, or :class:`MergeError` naming
    tensor ``name`` if any value is not finite (``dtype``: the dtype it was cast to)."""
    if is_tensor(arr):
        finite = bool(arr.isfinite().all()) if arr.is_floating_point() else True
    else:
        arr = np.asarray(arr)
        finite = bool(np.isfinite(arr).all())
    if not finite:
        cast = f" in {dtype}" if dtype else ""
        raise MergeError(
            f"merged tensor {name!r} is not finite{cast}; check the inputs (NaN/Inf in a model "
            "or statistics), or write a wider output dtype (output.dtype: float32) where "
            "values exceed the narrow type's range"
        )
    return arr


def cast_merged(name: str, value: Any, dtype: str) -> NDArray[Any]:
    """A merged tensor (float64 NumPy, or any float array or torch tensor) as a NumPy
    array of ``dtype``, rounded as torch rounds, checked finite after the cast (a value
    finite in float64 may overflow a narrower type): the one cast every front door
    applies."""
    out = cast_float(as_numpy(value), dtype)
    checked_finite(name, out, dtype)
    return out


def _named(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> NDArray[np.float64]:
    """Call an averaging kernel; its input errors name the tensor."""
    try:
        return np.asarray(fn(*args, **kwargs))
    except ValueError as exc:
        raise MergeError(f"tensor {name!r}: {exc}") from None


def average_tensor(name: str, tensors: Sequence[Any], options: MergeOptions) -> NDArray[np.float64]:
    """``Σ c_i θ_i / Σ c_i`` of one tensor, in float64."""
    return _named(
        name, weighted_average, tensors, options.coefficients, n_threads=options.n_threads
    )


def fisher_tensor(
    name: str, tensors: Sequence[Any], stats: Sequence[Statistics], options: MergeOptions
) -> NDArray[np.float64]:
    """One parameter's Fisher-weighted average, the Fisher sums divided by the counts."""
    fishers = [s.fisher(name) / max(s.count(), 1.0) for s in stats]
    return _named(
        name,
        fisher_average,
        tensors,
        fishers,
        options.coefficients,
        eps=options.fisher_eps,
        n_threads=options.n_threads,
    )


def task_arithmetic_tensor(
    name: str, base: Any, tensors: Sequence[Any], options: MergeOptions
) -> NDArray[np.float64]:
    """``θ_0 + λ Σ c_i (θ_i − θ_0)`` of one tensor, in float64."""
    theta0 = as_float64(base, f"base: {name}")
    delta = np.zeros_like(theta0)
    for ci, t in zip(options.coefficients or [1.0] * len(tensors), tensors, strict=True):
        delta += ci * (as_float64(t, name) - theta0)
    return theta0 + options.scaling * delta


def regmean_groups(
    stats: Sequence[Statistics],
    weights: set[str] | Mapping[str, Any],
    skip: set[str],
    options: MergeOptions,
) -> list[list[str]]:
    """The modules RegMean solves, grouped: modules that share one input Gram in every
    statistics file are solved together (one factorization). ``weights``: the weight
    names the models have; ``skip``: weights never solved (tied ones). The statistics
    cover the same modules (checked by the plan)."""
    by_group: dict[tuple[str, ...], list[str]] = {}
    for m, info in stats[0].modules.items():
        w = info["weight"]
        if matches(m, options.exclude) or matches(w, options.heads) or w in skip:
            continue
        if w not in weights:
            raise MergeError(f"statistics name module {m!r} but the models have no {w!r}")
        key = (*(s.group_of(m) for s in stats), info["layout"])
        by_group.setdefault(key, []).append(m)
    return list(by_group.values())


#: A RegMean system counts as poorly determined below this many statistics rows per input
#: dimension, or at a condition estimate of at least CONDITION_LIMIT.
ROWS_PER_INPUT = 2.0
CONDITION_LIMIT = 1e6


def poorly_determined(module: str, layer: Mapping[str, Any]) -> dict[str, Any] | None:
    """Why the RegMean system of ``module`` (its solver report from :func:`solve_group`) is
    poorly determined, with what to do; None when it is not."""
    rows, dim = float(layer["rows"]), int(layer["dim"])
    rcond = float(layer["rcond_estimate"])
    condition = float(layer["condition_estimate"]) or (1.0 / rcond if rcond > 0 else math.inf)
    bound = "≈" if layer["condition_estimate"] else "≥"
    reasons = []
    if rows < ROWS_PER_INPUT * dim:
        reasons.append(f"{rows:g} statistics rows for {dim} inputs")
    if condition >= CONDITION_LIMIT:
        reasons.append(f"condition {bound} {condition:.1e}")
    if int(layer["attempts"]) > 1:
        reasons.append(f"factored only with a ridge of {float(layer['ridge']):g}")
    if not reasons:
        return None
    return {
        "module": module,
        "rows": rows,
        "dim": dim,
        "condition": condition,
        "why": "; ".join(reasons),
        "advice": "collect statistics on more data (more texts or a longer max_length), "
        "lower alpha (e.g. 0.9), or exclude the module",
    }


def solve_group(
    members: Sequence[str],
    weights: Sequence[Sequence[Any]],
    grams: Sequence[NDArray[np.float64]],
    stats: Sequence[Statistics],
    labels: Sequence[str],
    options: MergeOptions,
) -> tuple[dict[str, NDArray[np.float64]], dict[str, Any]]:
    """RegMean of one group: ``weights[i]`` are model i's weights of ``members``,
    ``grams[i]`` its input Gram as :meth:`Statistics.gram_stored` returns it.

    Returns weight name -> merged float64 weight, and module name -> the solver's
    information (ridge used, attempts, which module's input it shares).
    """
    layout = stats[0].modules[members[0]]["layout"]
    axis = 0 if layout == "linear" else 1
    weights_k = []
    sizes: list[int] = []
    for ws in weights:
        arrays = [as_tensor_array(w, f"{m}.weight") for m, w in zip(members, ws, strict=True)]
        sizes = [int(a.shape[axis]) for a in arrays]
        weights_k.append(np.concatenate(arrays, axis=axis) if len(arrays) > 1 else arrays[0])
        del arrays
    counts = [s.count(members[0]) for s in stats]
    for i, n in enumerate(counts):
        if n <= 0:
            raise MergeError(f"statistics of {labels[i]}: module {members[0]!r} saw no rows")
    name = (
        members[0] if len(members) == 1 else f"{members[0]} (+{len(members) - 1} sharing its input)"
    )
    res = regmean_merge_layer(
        grams,
        weights_k,
        counts,
        alpha=options.alpha,
        coefficients=options.coefficients,
        layout=layout,
        precision=options.precision,  # type: ignore[arg-type]
        ridge=options.ridge,
        allow_regularization=options.allow_regularization,
        name=name,
        n_threads=options.n_threads,
    )
    dim = int(weights_k[0].shape[1 - axis])  # the layer's input dimension
    del weights_k
    info = res.info
    solved = {
        "ridge": float(info.ridge),
        "attempts": int(info.attempts),
        "precision": str(info.precision),
        "rcond_estimate": float(info.rcond_estimate),
        "condition_estimate": float(info.condition_estimate),
        "relative_spread": float(info.relative_spread),
        "rows": min(counts),
        "dim": dim,
    }
    out = {}
    layers = {}
    start = 0
    for m, size in zip(members, sizes, strict=True):
        part = slice(start, start + size)
        out[stats[0].modules[m]["weight"]] = res.weight[part] if axis == 0 else res.weight[:, part]
        start += size
        layers[m] = {**solved, "shared_with": members[0] if m != members[0] else None}
    return out, layers
