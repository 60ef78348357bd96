"""The arithmetic of one merge step: a RegMean input group, or one averaged, Fisher-weighted
or task-vector (task arithmetic, TIES, DARE) tensor. Every step computes in float64 (the
native kernels; vectorized NumPy for the task vectors) and is shared by every front door
(models in memory, checkpoints on disk, Ray workers).

* ``regmean`` (Jin et al., 2023): every linear weight with statistics in all K files is
  solved in closed form, ``W_Mᵀ = (Σ c_i G̃_i)⁻¹ Σ c_i G̃_i W_iᵀ`` with
  ``G̃_i = α·G_i/n_i + (1−α)·diag(G_i/n_i)``; modules that share an input Gram (q/k/v)
  are solved together (one factorization). Everything else is averaged.
* ``average``: ``Σ c_i θ_i / Σ c_i``.
* ``fisher``: ``Σ c_i (F_i+ε) θ_i / Σ c_i (F_i+ε)`` with ``F_i`` the mean squared
  gradients from :func:`lmdx.collect_fisher`.
* ``task_arithmetic``: ``θ_0 + λ Σ c_i τ_i`` with the task vectors ``τ_i = θ_i − θ_0``
  against a base model ``θ_0`` (float64).
* ``ties`` (TIES-Merging, Yadav et al., 2023; mergekit's ``ties``, whose per-tensor trim
  and coefficient-weighted mean it follows; the paper's code trims over the whole
  flattened model and divides by the number of agreeing models): per tensor and per
  model keep the ``int(density × numel)`` entries of ``τ_i`` of largest magnitude (ties at
  the threshold: the lowest flat indices in C order), elect per entry the sign of
  ``Σ c_i τ̂_i`` (``+`` where it is 0), and average the trimmed ``c_i τ̂_i`` that are non-zero
  and have the elected sign: ``Σ_agree c_i τ̂_i / Σ_agree c_i`` (0 where none agrees);
  ``θ_0 + λ`` times that.
* ``dare`` (DARE, Yu et al., 2024): drop each entry of ``τ_i`` with probability
  ``1 − density``, rescale the survivors by ``1/density``, then task arithmetic (density
  1 is ``task_arithmetic`` bit for bit). The drops of model ``i``'s tensor ``name`` come
  from NumPy's PCG64 seeded by ``SeedSequence([seed, i, *w])``, ``w`` the eight
  little-endian 32-bit words of SHA-256(``name`` in UTF-8): keep where ``random() <
  density``; so they depend on nothing else (not the order of steps, the threads or the
  front door).
* ``dare_ties`` (mergekit's name): DARE's drop and rescale, then TIES's sign election and
  mean of the agreeing entries (as the DARE paper's code applies DARE before TIES-Merging;
  mergekit's ``dare_ties`` sums the agreeing entries unless ``normalize: true``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
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
from .registry import method_named

__all__ = [
    "GRAM_ROUNDOFF",
    "average_tensor",
    "cast_merged",
    "checked_finite",
    "dare_keep",
    "fisher_tensor",
    "noise_floor",
    "poorly_determined",
    "regmean_groups",
    "solve_group",
    "task_vector_tensor",
    "top_k_magnitude",
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


def task_vector_tensor(
    name: str, base: Any, tensors: Sequence[Any], options: MergeOptions
) -> NDArray[np.float64]:
    """One tensor merged from its task vectors ``τ_i = θ_i − θ_0`` (``base`` is ``θ_0``) by
    ``options.method`` (``task_arithmetic``, ``ties``, ``dare``, ``dare_ties`` or another
    registered :class:`~lmdx.merge.builtin.task_vectors.TaskVectorMethod`; see the module's
    description), in float64: ``θ_0 + λ Σ c_i τ_i``, with ``τ_i`` sparsified
    first (``ties``, ``dare``, ``dare_ties``) and the sum replaced by the mean of the
    entries agreeing with the elected sign (``ties``, ``dare_ties``)."""
    method = method_named(options.method)
    sparsify = getattr(method, "sparsify", None)
    theta0 = as_float64(base, f"base: {name}")
    coefficients = options.coefficients or (1.0,) * len(tensors)
    taus = (
        _sparsified(name, i, as_float64(t, name) - theta0, options, sparsify)
        for i, t in enumerate(tensors)
    )
    if getattr(method, "elects", False):
        delta = _elected_mean(taus, coefficients)
    else:
        delta = np.zeros_like(theta0)
        for ci, tau in zip(coefficients, taus, strict=True):
            tau *= ci  # in place: every task vector here is a new array of this function's
            delta += tau
    merged: NDArray[np.float64] = theta0 + options.scaling * delta
    return merged


def _sparsified(
    name: str, i: int, tau: NDArray[np.float64], options: MergeOptions, sparsify: str | None
) -> NDArray[np.float64]:
    """Model ``i``'s task vector of tensor ``name`` sparsified: ``"top_k"`` (TIES's trim),
    ``"drop"`` (DARE's drop and rescale) or None (unchanged: task arithmetic)."""
    if sparsify is None:
        return tau
    if not np.isfinite(tau).all():  # a dropped or trimmed NaN would vanish silently
        raise MergeError(
            f"tensor {name!r}: the task vector of model {i} (its values minus the base's) is "
            "not finite; check that model and the base for NaN/Inf"
        )
    if sparsify == "drop":
        if options.density >= 1.0:
            return tau
        keep = dare_keep(name, i, tau.shape, options.density, options.seed)
        tau = np.asarray(tau)  # in place below: ``tau`` is this merge's own array
        tau /= options.density
        np.copyto(tau, 0.0, where=~keep)
        return tau
    return top_k_magnitude(tau, options.density)


def top_k_magnitude(tau: NDArray[np.float64], density: float) -> NDArray[np.float64]:
    """``tau`` with all but its ``int(density × tau.size)`` entries of largest magnitude set
    to 0 (TIES's trim, mergekit's ``magnitude``). Entries tied at the threshold are kept
    in C order (lowest flat index first), so the result is deterministic. ``k = 0`` keeps
    nothing."""
    n = tau.size
    k = int(density * n)
    if k >= n:
        return tau
    flat = tau.reshape(-1)
    magnitude = np.abs(flat)
    keep = np.zeros(n, dtype=bool)
    if k > 0:
        threshold = np.partition(magnitude, n - k)[n - k]  # the k-th largest magnitude
        np.greater(magnitude, threshold, out=keep)
        short = k - int(np.count_nonzero(keep))
        if short > 0:
            keep[np.flatnonzero(magnitude == threshold)[:short]] = True
    return np.where(keep, flat, 0.0).reshape(tau.shape)


def dare_keep(
    name: str, model: int, shape: tuple[int, ...], density: float, seed: int
) -> NDArray[np.bool_]:
    """DARE's mask of model ``model``'s task vector of tensor ``name``: each entry kept with
    probability ``density``, from PCG64 seeded by ``SeedSequence([seed, model, *w])`` with
    ``w`` the eight little-endian 32-bit words of SHA-256(``name``) (keep where
    ``random() < density``)."""
    words = np.frombuffer(hashlib.sha256(name.encode("utf-8")).digest(), dtype="<u4")
    entropy = [int(seed), int(model), *(int(w) for w in words)]
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))
    return rng.random(shape) < density


def _elected_mean(
    taus: Iterable[NDArray[np.float64]], coefficients: Sequence[float]
) -> NDArray[np.float64]:
    """TIES's sign election and disjoint mean (mergekit's ``sum`` consensus with
    normalization): the elected sign per entry is that of ``Σ c_i τ_i`` (``+`` at 0); the
    result is ``Σ c_i τ_i / Σ c_i`` over the models whose ``c_i τ_i`` is non-zero with that
    sign (0 where none is). ``taus`` are new arrays, scaled by ``c_i`` in place."""
    weighted = []
    for ci, tau in zip(coefficients, taus, strict=True):
        tau *= ci
        weighted.append(tau)
    total = np.zeros_like(weighted[0])
    for w in weighted:
        total += w
    elected = np.where(total >= 0, 1.0, -1.0)
    del total
    mixed = np.zeros_like(weighted[0])
    divisor = np.zeros_like(weighted[0])
    work = np.empty_like(mixed)
    agree = np.empty(np.shape(mixed), dtype=bool)
    for ci, w in zip(coefficients, weighted, strict=True):
        np.multiply(w, elected, out=work)  # > 0 exactly where w is non-zero with the sign
        np.greater(work, 0.0, out=agree)
        np.multiply(w, agree, out=work)
        mixed += work
        np.multiply(agree, ci, out=work)
        divisor += work
    np.copyto(divisor, 1.0, where=divisor == 0)
    mixed /= divisor
    return mixed


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


#: Relative rounding of a Gram's entries for each statistics accumulation precision
#: (``Statistics.accumulation``): float32 products summed in float64 ("mixed"), or
#: float64 throughout. Statistics that record none are taken as exact.
GRAM_ROUNDOFF = {"mixed": 2.0**-24, "float64": 2.0**-53}


def noise_floor(stats: Sequence[Statistics]) -> float:
    """The RegMean solves' ``noise_floor``: the coarsest accumulation precision of
    ``stats`` (see :func:`lmdx.regmean_merge_layer`)."""
    return max(GRAM_ROUNDOFF.get(str(s.accumulation), 0.0) for s in stats)


#: A RegMean system counts as poorly determined below this many statistics rows per input
#: dimension, or at a condition estimate of at least CONDITION_LIMIT.
ROWS_PER_INPUT = 2.0
CONDITION_LIMIT = 1e6


def poorly_determined(module: str, layer: Mapping[str, Any], alpha: float) -> dict[str, Any] | None:
    """Why the RegMean system of ``module`` (its solver report from :func:`solve_group`,
    merged at ``alpha``) is poorly determined, with what to do; None when it is not, or
    when nothing was solved (``precision`` ``"identical"``: the weights are equal in every
    model and come back exactly, whatever the statistics)."""
    if layer.get("precision") == "identical":
        return None
    rows, dim = float(layer["rows"]), int(layer["dim"])
    rcond = float(layer["rcond_estimate"])
    condition = float(layer["condition_estimate"]) or (1.0 / rcond if rcond > 0 else math.inf)
    bound = "≈" if layer["condition_estimate"] else "≥"
    reasons = []
    if rows < ROWS_PER_INPUT * dim:
        reasons.append(f"{rows:g} statistics rows for {dim} inputs")
    if condition >= CONDITION_LIMIT:
        reasons.append(f"condition {bound} {condition:.1e}")
    unseen = int(layer.get("unseen_directions", 0))
    if unseen:
        reasons.append(
            f"{unseen} input directions below the statistics' noise floor kept the average"
        )
    elif int(layer["attempts"]) > 1:
        reasons.append(f"factored only with a ridge of {float(layer['ridge']):g}")
    if not reasons:
        return None
    return {
        "module": module,
        "rows": rows,
        "dim": dim,
        "condition": condition,
        "why": "; ".join(reasons),
        "advice": advice(alpha),
    }


def advice(alpha: float) -> str:
    """What to do about a poorly determined system merged at ``alpha``. The system is
    α Σ c_i Ĝ_i + (1 − α) × its diagonal, so its smallest eigenvalue is at least (1 − α) ×
    its smallest diagonal entry: from α = 1 the paper's 0.9; below, the α that doubles
    1 − α (0.9 → 0.8), or halves α at 0.5 and below; at α = 0 there is no off-diagonal
    left to lower."""
    more = "collect statistics on more data (more texts or a longer max_length)"
    if alpha <= 0.0:
        return f"{more} or exclude the module (alpha is 0 already: no off-diagonal to lower)"
    suggested = 0.9 if alpha >= 1.0 else round(2.0 * alpha - 1.0 if alpha > 0.5 else alpha / 2, 3)
    return (
        f"{more}, lower alpha from {alpha:g} (e.g. to {suggested:g}: the system's smallest "
        "eigenvalue is at least (1 − alpha) × its smallest diagonal entry), or exclude the module"
    )


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
        precision=options.precision,
        noise_floor=noise_floor(stats),
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
        "output_error_estimate": float(info.output_error_estimate),
        "unseen_directions": int(info.unseen_directions),
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
