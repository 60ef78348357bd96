"""The task-vector methods: ``task_arithmetic``, ``ties``, ``dare`` and ``dare_ties``
merge ``τ_i = θ_i − θ_base`` against the pre-trained ``base`` (formulas:
:mod:`lmdx.merge.methods`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import numpy as np
from numpy.typing import NDArray
from pydantic import Field

from ..methods import task_vector_tensor
from ..registry import MergeMethod, NoOptions

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


class TaskVectorMethod(MergeMethod):
    """A method merging task vectors against ``base``, tensor by tensor. ``sparsify``:
    ``None``, ``"top_k"`` (TIES's trim) or ``"drop"`` (DARE's random drop and rescale);
    ``elects``: the sign election and mean of the agreeing entries (TIES)."""

    needs_base: ClassVar[bool] = True
    sparsify: ClassVar[str | None] = None
    elects: ClassVar[bool] = False

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
