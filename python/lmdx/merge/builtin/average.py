"""``average``: the (coefficient-weighted) average of every parameter."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from ..methods import average_tensor
from ..output_blocks import average_in_blocks
from ..registry import MergeMethod

if TYPE_CHECKING:
    from ..inputs import MergeInputs
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
