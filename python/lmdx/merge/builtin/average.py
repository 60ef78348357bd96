"""``average``: the (coefficient-weighted) average of every parameter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from ..methods import average_tensor
from ..output_blocks import average_block_size, average_in_blocks
from ..registry import MergeMethod

if TYPE_CHECKING:
    from ..inputs import MergeInputs
    from ..plan import Step, StepSizes
    from ..source import TensorSource

__all__ = ["Average"]


class Average(MergeMethod):
    """``Σ c_i θ_i / Σ c_i`` per parameter; the tensors other methods do not solve are
    merged so too."""

    name: ClassVar[str] = "average"
    summary: ClassVar[str] = "a (coefficient-weighted) average of the parameters"

    def tensor(self, name: str, tensors: Sequence[Any], inputs: MergeInputs) -> NDArray[np.float64]:
        return average_tensor(name, tensors, inputs.options)

    def tensor_in_blocks(
        self, name: str, sources: Sequence[TensorSource], inputs: MergeInputs
    ) -> NDArray[Any] | None:
        return average_in_blocks(name, sources, inputs.options)

    def memory(self, step: Step, sizes: StepSizes, inputs: MergeInputs) -> int:
        """The whole average's (:meth:`MergeMethod.memory`), or one block of rows' where it
        is averaged in blocks (over ``solve_memory``)."""
        whole = super().memory(step, sizes, inputs)
        if (
            inputs.lora is not None
        ):  # merges that also build a LoRA of the merged update: never blocked
            return whole
        name = step.tensors[0]
        block = average_block_size(name, inputs.sources, inputs.options.solve_memory)
        if block is None:
            return whole
        return whole * block // int(sizes.ref.shape(name)[0])
