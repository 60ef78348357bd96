"""The task-vector methods: ``task_arithmetic``, ``ties``, ``dare`` and ``dare_ties``
merge ``τ_i = θ_i − θ_base`` against the pre-trained ``base`` (formulas:
:mod:`lmdx.merge.methods`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import numpy as np
from numpy.typing import NDArray
from pydantic import Field

from ..._errors import MergeError
from ..._util import matches
from ...files.hf import base_model_info
from ..methods import task_vector_tensor
from ..registry import MergeMethod, NoOptions
from ..source import PrefixedSource, TensorSource

if TYPE_CHECKING:
    from ..inputs import MergeInputs
    from ..plan import Step, StepSizes

__all__ = [
    "Dare",
    "DareOptions",
    "DareTies",
    "DareTiesOptions",
    "TaskArithmetic",
    "TaskVectorMethod",
    "TaskVectorOptions",
    "Ties",
    "TiesOptions",
    "base_as_models_name_it",
]

_SCALING = Field(description="λ: θ_base + λ × (merged task vector)")
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

    scaling: Annotated[float, _SCALING] = 0.3


class TiesOptions(NoOptions):
    """TIES: λ = 1 and the top 20 % kept (the TIES paper's recommendations)."""

    scaling: Annotated[float, _SCALING] = 1.0
    density: Annotated[float, _DENSITY] = 0.2


class DareOptions(NoOptions):
    """DARE: λ = 0.3 (so that density 1 is task arithmetic) and FusionBench's density
    0.5."""

    scaling: Annotated[float, _SCALING] = 0.3
    density: Annotated[float, _DENSITY] = 0.5
    seed: Annotated[int, _SEED] = 0


class DareTiesOptions(NoOptions):
    """DARE-TIES: DARE's drops, TIES's λ = 1."""

    scaling: Annotated[float, _SCALING] = 1.0
    density: Annotated[float, _DENSITY] = 0.5
    seed: Annotated[int, _SEED] = 0


def base_as_models_name_it(
    base: TensorSource, ref: TensorSource, inputs: MergeInputs
) -> tuple[TensorSource, dict[str, Any]]:
    """``base`` under the names of the models' tensors, and what to say about it.

    A bare encoder (``BertModel``: ``embeddings.*``) is the base of task classes
    (``BertForSequenceClassification``: ``bert.embeddings.*``): its names get the models'
    ``base_model_prefix``, as transformers loads one into the other. The models' tensors
    the base still lacks are said: task heads (``heads`` patterns) are kept per model or
    dropped, as always; any other such tensor has no task vector and is averaged (copied
    from the first model if not floating point)."""
    prefix, _ = base_model_info(ref.config)
    names = ref.names()
    note: dict[str, Any] = {}
    if prefix and not any(n in base for n in names):
        mapped = PrefixedSource(base, prefix)
        if any(n in mapped for n in names):
            base = mapped
            note["prefix"] = prefix
    lacks = [n for n in names if n not in base]
    if lacks and len(lacks) == len(names):
        raise MergeError(
            f"base {base.label} has none of the models' tensors (e.g. {names[0]!r}): it is not "
            "the model they were fine-tuned from"
        )
    heads = inputs.options.heads
    kinds = {
        "heads": [n for n in lacks if matches(n, heads)],
        "averaged": [n for n in lacks if not matches(n, heads) and ref.is_float(n)],
        "copied": [n for n in lacks if not matches(n, heads) and not ref.is_float(n)],
    }
    note.update({k: v for k, v in kinds.items() if v})
    if note:
        where = base.label if base.path is None else str(base.path)
        note["line"] = _said(where, note, inputs.options.head_policy)
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
    """A method merging task vectors against ``base``, tensor by tensor. ``sparsify``:
    ``None``, ``"top_k"`` (TIES's trim) or ``"drop"`` (DARE's random drop and rescale);
    ``elects``: the sign election and mean of the agreeing entries (TIES)."""

    needs_base: ClassVar[bool] = True
    sparsify: ClassVar[str | None] = None
    elects: ClassVar[bool] = False

    def check(self, inputs: MergeInputs) -> None:
        """The base as the models name its tensors (:func:`base_as_models_name_it`)."""
        assert inputs.base is not None
        inputs.base, note = base_as_models_name_it(inputs.base, inputs.sources[0], inputs)
        if note:
            inputs.notes["base"] = note

    def plan_notes(self, inputs: MergeInputs) -> list[str]:
        note = inputs.notes.get("base")
        return [note["line"]] if note else []

    def report(self, inputs: MergeInputs) -> dict[str, Any]:
        """The options, and what the base lacks or how its names were read."""
        out = super().report(inputs)
        if "base" in inputs.notes:
            out["base"] = inputs.notes["base"]
        return out

    def tensor_kind(self, inputs: MergeInputs, name: str) -> str:
        """This method, or ``average`` for a tensor the base lacks (no task vector)."""
        lacks = inputs.notes.get("base", {}).get("averaged", [])
        return "average" if name in lacks else self.name

    def tensor(self, name: str, tensors: Sequence[Any], inputs: MergeInputs) -> NDArray[np.float64]:
        assert inputs.base is not None
        return task_vector_tensor(name, inputs.base.read(name), tensors, inputs.options)

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
    sparsify: ClassVar[str | None] = "top_k"
    elects: ClassVar[bool] = True


class Dare(TaskVectorMethod):
    name: ClassVar[str] = "dare"
    summary: ClassVar[str] = (
        "DARE (Yu et al., 2024): task-vector entries dropped at random and the rest "
        "rescaled by 1/density, then task arithmetic"
    )
    options: ClassVar[type[NoOptions]] = DareOptions
    headline: ClassVar[tuple[str, ...]] = ("density", "scaling", "seed")
    sparsify: ClassVar[str | None] = "drop"


class DareTies(TaskVectorMethod):
    name: ClassVar[str] = "dare_ties"
    summary: ClassVar[str] = (
        "DARE-TIES: DARE's random drop and rescale, then TIES's sign election and mean of "
        "the agreeing entries"
    )
    options: ClassVar[type[NoOptions]] = DareTiesOptions
    headline: ClassVar[tuple[str, ...]] = ("density", "scaling", "seed")
    sparsify: ClassVar[str | None] = "drop"
    elects: ClassVar[bool] = True
