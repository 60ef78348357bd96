"""The task-vector methods: ``task_arithmetic``, ``ties``, ``dare`` and ``dare_ties``
merge the task vectors ``τ_i = θ_i − θ_0`` against the pre-trained ``base`` ``θ_0``, tensor
by tensor, in float64 (vectorized NumPy):

* ``task_arithmetic``: ``θ_0 + λ Σ c_i τ_i``.
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

The tensors the base lacks are averaged (or copied, if not floating point); task heads
follow the ``heads`` policy.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Sequence
from typing import Annotated, Any, ClassVar

import numpy as np
from numpy.typing import NDArray
from pydantic import Field

from ..._errors import MergeError
from ..._tensors import as_float64, as_tensor_array
from ..._util import matches
from ..method import MergeInputs, MergeMethod, NoOptions, Step, StepSizes, checked_input
from ..source import TensorSource, base_as_named
from .average import AVERAGE

__all__ = [
    "SCALING",
    "Dare",
    "DareOptions",
    "DareTies",
    "DareTiesOptions",
    "Sparsifier",
    "TaskArithmetic",
    "TaskVectorMethod",
    "TaskVectorOptions",
    "Ties",
    "TiesOptions",
    "base_as_models_name_it",
    "dare_drop",
    "dare_keep",
    "elected_mean",
    "finite_task_vector",
    "largest",
    "random_draws",
    "task_vector_tensor",
    "top_k_magnitude",
]

#: The field of λ, the scaling of a merged task vector (every task-vector method's).
SCALING = Field(description="λ: θ_base + λ × (merged task vector)")
_DENSITY = Field(
    gt=0.0,
    le=1.0,
    description="ties: the fraction of each task vector's entries kept (largest magnitudes); "
    "dare, dare_ties: the probability of keeping each entry",
    json_schema_extra={"label": "must be in (0, 1] (the fraction of each task vector kept)"},
)
_SEED = Field(
    ge=0,
    description="the seed of DARE's random drops: the same seed gives the same bits, in "
    "memory or streaming, on any thread count",
    json_schema_extra={"label": "must be a whole number >= 0"},
)


class TaskVectorOptions(NoOptions):
    """Task arithmetic's λ (lmdx's default 0.3)."""

    scaling: Annotated[float, SCALING] = 0.3


class TiesOptions(NoOptions):
    """TIES: λ = 1 and the top 20 % kept (the TIES paper's recommendations)."""

    scaling: Annotated[float, SCALING] = 1.0
    density: Annotated[float, _DENSITY] = 0.2


class DareOptions(NoOptions):
    """DARE: λ = 0.3 (so that density 1 is task arithmetic) and FusionBench's density
    0.5."""

    scaling: Annotated[float, SCALING] = 0.3
    density: Annotated[float, _DENSITY] = 0.5
    seed: Annotated[int, _SEED] = 0


class DareTiesOptions(NoOptions):
    """DARE-TIES: DARE's drops, TIES's λ = 1."""

    scaling: Annotated[float, SCALING] = 1.0
    density: Annotated[float, _DENSITY] = 0.5
    seed: Annotated[int, _SEED] = 0


#: A task vector's sparsification: ``(model index, τ_i) -> τ̂_i``, in float64; it may
#: work in place (``τ_i`` is a new array of the merge's own).
Sparsifier = Callable[[int, NDArray[np.float64]], NDArray[np.float64]]


def finite_task_vector(name: str, i: int, tau: NDArray[np.float64]) -> NDArray[np.float64]:
    """Model ``i``'s task vector ``tau`` of tensor ``name``, or :class:`MergeError` if any
    entry is NaN or Inf: a method that ranks, drops or factors the entries would lose it
    silently (a dropped NaN vanishes; LAPACK's NaN singular values keep nothing)."""
    if not np.isfinite(tau).all():
        raise MergeError(
            f"tensor {name!r}: the task vector of model {i} (its values minus the base's) "
            "is not finite; check that model and the base for NaN/Inf"
        )
    return tau


def task_vector_tensor(
    name: str,
    base: Any,
    tensors: Sequence[Any],
    coefficients: Sequence[float] | None,
    scaling: float,
    *,
    sparsify: Sparsifier | None = None,
    elects: bool = False,
) -> NDArray[np.float64]:
    """One tensor merged from its task vectors ``τ_i = θ_i − θ_0`` (``base`` is ``θ_0``; see
    the module's description), in float64: ``θ_0 + λ Σ c_i τ_i`` (``λ``: ``scaling``), with
    each ``τ_i`` sparsified first by ``sparsify`` (TIES's trim, DARE's drop and rescale,
    ...; a non-finite task vector is refused then, since a dropped NaN would vanish
    silently) and, with ``elects``, the sum replaced by the mean of the entries agreeing
    with the elected sign (TIES)."""
    theta0 = as_float64(base, f"base: {name}")
    coefficients = coefficients or (1.0,) * len(tensors)

    def tau(i: int, t: Any) -> NDArray[np.float64]:
        out: NDArray[np.float64] = as_float64(t, name) - theta0
        if sparsify is None:
            return out
        return sparsify(i, finite_task_vector(name, i, out))

    if sparsify is None and not elects:
        # Task arithmetic in two buffers (no array per model; the same operations, so the
        # same numbers): work = θ_i − θ_0 (widened in the subtraction), × c_i, into delta.
        delta = np.zeros_like(theta0)
        work = np.empty_like(theta0)
        for ci, t in zip(coefficients, tensors, strict=True):
            np.subtract(as_tensor_array(t, name), theta0, out=work)
            work *= ci
            delta += work
        del work
        delta *= scaling
        delta += theta0  # θ_0 + λ Σ c_i τ_i
        return delta
    taus = (tau(i, t) for i, t in enumerate(tensors))
    if elects:
        delta = elected_mean(taus, coefficients)
    else:
        delta = np.zeros_like(theta0)
        for ci, t in zip(coefficients, taus, strict=True):
            t *= ci  # in place: every task vector here is a new array of this function's
            delta += t
    merged: NDArray[np.float64] = theta0 + scaling * delta
    return merged


def largest(magnitude: NDArray[np.float64], k: int) -> NDArray[np.bool_]:
    """The mask of the ``k`` largest entries of the flat ``magnitude``; entries tied at the
    threshold are taken in order (lowest index first), so the mask is deterministic."""
    n = magnitude.size
    keep = np.zeros(n, dtype=bool)
    if k >= n:
        keep[:] = True
    elif k > 0:
        threshold = np.partition(magnitude, n - k)[n - k]  # the k-th largest magnitude
        np.greater(magnitude, threshold, out=keep)
        short = k - int(np.count_nonzero(keep))
        if short > 0:
            keep[np.flatnonzero(magnitude == threshold)[:short]] = True
    return keep


def top_k_magnitude(tau: NDArray[np.float64], density: float) -> NDArray[np.float64]:
    """``tau`` with all but its ``int(density × tau.size)`` entries of largest magnitude set
    to 0 (TIES's trim, mergekit's ``magnitude``). Entries tied at the threshold are kept
    in C order (lowest flat index first), so the result is deterministic. ``k = 0`` keeps
    nothing."""
    k = int(density * tau.size)
    if k >= tau.size:
        return tau
    flat = tau.reshape(-1)
    return np.where(largest(np.abs(flat), k), flat, 0.0).reshape(tau.shape)


def random_draws(name: str, model: int, shape: tuple[int, ...], seed: int) -> NDArray[np.float64]:
    """Uniform draws in [0, 1), one per entry of model ``model``'s task vector of tensor
    ``name``: PCG64 seeded by ``SeedSequence([seed, model, *w])`` with ``w`` the eight
    little-endian 32-bit words of SHA-256(``name``), so they depend on nothing else (not
    the order of steps, the threads or the front door)."""
    words = np.frombuffer(hashlib.sha256(name.encode("utf-8")).digest(), dtype="<u4")
    entropy = [int(seed), int(model), *(int(w) for w in words)]
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))
    return rng.random(shape)


def dare_keep(
    name: str, model: int, shape: tuple[int, ...], density: float, seed: int
) -> NDArray[np.bool_]:
    """DARE's mask of model ``model``'s task vector of tensor ``name``: each entry kept with
    probability ``density``, where its :func:`random_draws` is ``< density``."""
    return random_draws(name, model, shape, seed) < density


def dare_drop(name: str, density: float, seed: int) -> Sparsifier:
    """DARE's drop and rescale of tensor ``name``'s task vectors: entries kept as
    :func:`dare_keep` says, divided by ``density`` (density 1: unchanged)."""

    def drop(i: int, tau: NDArray[np.float64]) -> NDArray[np.float64]:
        if density >= 1.0:
            return tau
        keep = dare_keep(name, i, tau.shape, density, seed)
        tau = np.asarray(tau)  # in place below: ``tau`` is this merge's own array
        tau /= density
        np.copyto(tau, 0.0, where=~keep)
        return tau

    return drop


def elected_mean(
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


def base_as_models_name_it(
    base: TensorSource, ref: TensorSource, inputs: MergeInputs
) -> tuple[TensorSource, dict[str, Any]]:
    """``base`` under the names of the models' tensors, and what to say about it.

    A bare encoder is read with the models' ``base_model_prefix``
    (:func:`~lmdx.merge.source.base_as_named`). The models' tensors
    the base still lacks are said: task heads (``heads`` patterns) are kept per model or
    dropped, as always; any other such tensor has no task vector and is averaged (copied
    from the first model if not floating point)."""
    base, prefix = base_as_named(base, ref)
    names = ref.names()
    note: dict[str, Any] = {} if prefix is None else {"prefix": prefix}
    lacks = [n for n in names if n not in base]
    if lacks and len(lacks) == len(names):
        raise MergeError(
            f"base {base.label} has none of the models' tensors (e.g. {names[0]!r}): it is not "
            "the model they were fine-tuned from"
        )
    heads = inputs.options.heads.patterns
    kinds = {
        "heads": [n for n in lacks if matches(n, heads)],
        "averaged": [n for n in lacks if not matches(n, heads) and ref.is_float(n)],
        "copied": [n for n in lacks if not matches(n, heads) and not ref.is_float(n)],
    }
    note.update({k: v for k, v in kinds.items() if v})
    if note:
        where = base.label if base.path is None else str(base.path)
        note["line"] = _said(where, note, inputs.options.heads.policy)
    return base, note


def _said(label: str, note: dict[str, Any], head_policy: str) -> str:
    """The note about the base in one line (the report, ``lmdx merge`` and its dry run)."""

    def some(names: list[str]) -> str:
        more = f" and {len(names) - 3} more" if len(names) > 3 else ""
        return ", ".join(names[:3]) + more

    parts = []
    if "prefix" in note:
        parts.append(f"its tensors read as the models' {note['prefix']}.* (base_model_prefix)")
    if "heads" in note:
        done = "kept per model" if head_policy == "keep" else "dropped"
        parts.append(f"lacks the task heads {some(note['heads'])} ({done})")
    if "averaged" in note:
        parts.append(f"lacks {some(note['averaged'])} (averaged over the models: no task vector)")
    if "copied" in note:
        parts.append(f"lacks {some(note['copied'])} (copied from the first model)")
    return f"base {label}: " + "; ".join(parts)


class TaskVectorMethod(MergeMethod):
    """A method merging task vectors against ``base``, tensor by tensor: each task vector
    sparsified by :meth:`sparsifier` (none: task arithmetic), then summed or, with
    ``elects``, the agreeing entries averaged after TIES's sign election."""

    needs_base: ClassVar[bool] = True
    elects: ClassVar[bool] = False

    def check(self, inputs: MergeInputs) -> None:
        """The base as the models name its tensors (:func:`base_as_models_name_it`)."""
        assert inputs.base is not None
        inputs.base, note = base_as_models_name_it(inputs.base, inputs.sources[0], inputs)
        if note:
            inputs.state["base"] = note

    def plan_notes(self, inputs: MergeInputs, steps: Sequence[Step]) -> list[str]:
        note = inputs.state.get("base")
        return [note["line"]] if note else []

    def report(self, inputs: MergeInputs) -> dict[str, Any]:
        """The options, and what the base lacks or how its names were read."""
        out = super().report(inputs)
        if "base" in inputs.state:
            out["base"] = inputs.state["base"]
        return out

    def tensor_method(self, inputs: MergeInputs, name: str) -> MergeMethod:
        """This method, or the average for a tensor the base lacks (no task vector)."""
        lacks = inputs.state.get("base", {}).get("averaged", [])
        return AVERAGE if name in lacks else self

    def sparsifier(self, name: str, inputs: MergeInputs) -> Sparsifier | None:
        """How tensor ``name``'s task vectors are sparsified (None: not at all)."""
        return None

    def tensor(self, name: str, tensors: Sequence[Any], inputs: MergeInputs) -> NDArray[np.float64]:
        assert inputs.base is not None
        own: Any = inputs.options.method_options
        return task_vector_tensor(
            name,
            checked_input(name, "the base", inputs.base.read(name)),
            tensors,
            inputs.options.coefficients,
            own.scaling,
            sparsify=self.sparsifier(name, inputs),
            elects=self.elects,
        )

    def memory(self, step: Step, sizes: StepSizes, inputs: MergeInputs) -> int:
        """The base's read too, ``θ_0``, the sum and the float64 work arrays: one task
        vector at a time (task arithmetic, DARE: the vector, its random draws and rescaled
        copy) or all K sparsified vectors at once (the sign election needs them together)."""
        work = sizes.k + 7 if self.elects else 6
        return (sizes.k + 1) * (sizes.read + sizes.widened) + 8 * sizes.n * work + sizes.out


class TaskArithmetic(TaskVectorMethod):
    name: ClassVar[str] = "task_arithmetic"
    summary: ClassVar[str] = "task arithmetic (Ilharco et al., 2023): base + λ Σ (θ_i − base)"
    options: ClassVar[type[NoOptions]] = TaskVectorOptions
    headline: ClassVar[tuple[str, ...]] = ("scaling",)


class Ties(TaskVectorMethod):
    name: ClassVar[str] = "ties"
    summary: ClassVar[str] = (
        "TIES-Merging (Yadav et al., 2023): per tensor the largest task-vector entries "
        "kept, a sign elected per entry, the agreeing entries averaged, base + λ × that"
    )
    options: ClassVar[type[NoOptions]] = TiesOptions
    headline: ClassVar[tuple[str, ...]] = ("density", "scaling")
    elects: ClassVar[bool] = True

    def sparsifier(self, name: str, inputs: MergeInputs) -> Sparsifier | None:
        density = inputs.options.own(TiesOptions).density
        return lambda i, tau: top_k_magnitude(tau, density)


class Dare(TaskVectorMethod):
    name: ClassVar[str] = "dare"
    summary: ClassVar[str] = (
        "DARE (Yu et al., 2024): task-vector entries dropped at random and the rest "
        "rescaled by 1/density, then task arithmetic"
    )
    options: ClassVar[type[NoOptions]] = DareOptions
    headline: ClassVar[tuple[str, ...]] = ("density", "scaling", "seed")

    def sparsifier(self, name: str, inputs: MergeInputs) -> Sparsifier | None:
        own = inputs.options.own(DareOptions)
        return dare_drop(name, own.density, own.seed)


class DareTies(TaskVectorMethod):
    name: ClassVar[str] = "dare_ties"
    summary: ClassVar[str] = (
        "DARE-TIES: DARE's random drop and rescale, then TIES's sign election and mean of "
        "the agreeing entries"
    )
    options: ClassVar[type[NoOptions]] = DareTiesOptions
    headline: ClassVar[tuple[str, ...]] = ("density", "scaling", "seed")
    elects: ClassVar[bool] = True

    def sparsifier(self, name: str, inputs: MergeInputs) -> Sparsifier | None:
        own = inputs.options.own(DareTiesOptions)
        return dare_drop(name, own.density, own.seed)
