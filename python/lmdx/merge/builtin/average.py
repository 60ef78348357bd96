"""``average``: the (coefficient-weighted) average of every parameter, ``Σ c_i θ_i / Σ c_i``;
the tensors other methods do not solve are merged so too.

Tensors larger than the merge's ``solve_memory`` (a Llama-3.1-8B's embeddings: 128256 ×
4096) are averaged block by block of rows, each block's rows read alone; an average is
element-wise, so the blocks give the whole average's numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
from numpy.typing import NDArray

from ..._errors import MergeError
from ..._tensors import itemsize
from ...average import weighted_average
from ...files import Checkpoint
from ..method import (
    MergeInputs,
    MergeMethod,
    Step,
    StepSizes,
    cast_merged,
    checked_input,
    on_tensor,
    rounds_merged,
)
from ..options import MergeOptions
from ..source import StateDictSource, TensorSource, read_rows

__all__ = ["AVERAGE", "Average", "average_block_size", "average_in_blocks", "average_tensor"]


def average_tensor(name: str, tensors: Sequence[Any], options: MergeOptions) -> NDArray[np.float64]:
    """``Σ c_i θ_i / Σ c_i`` of one tensor, in float64."""
    return on_tensor(
        name, weighted_average, tensors, options.coefficients, n_threads=options.threads
    )


def average_block_size(name: str, sources: Sequence[TensorSource], budget: int) -> int | None:
    """The rows of tensor ``name`` to average at once within ``budget`` bytes (per row:
    K reads and their float32 widenings, the float64 average, the cast result), or None
    when the whole average fits (or the tensor has fewer than two dimensions, or a source
    is neither a checkpoint nor in memory)."""
    first = sources[0]
    shape = tuple(int(n) for n in first.shape(name))
    if len(shape) < 2 or not all(isinstance(s, (Checkpoint, StateDictSource)) for s in sources):
        return None
    stored = max(itemsize(s.dtype(name)) for s in sources)
    per_row = int(np.prod(shape[1:])) * (len(sources) * (stored + 4) + 8 + stored)
    if per_row * shape[0] <= budget:
        return None
    return int(max(1, budget // per_row))


def average_in_blocks(
    name: str, sources: Sequence[TensorSource], options: MergeOptions
) -> NDArray[Any] | None:
    """The coefficient-weighted average of tensor ``name``, cast to its stored dtype,
    computed :func:`average_block_size` rows at a time within ``options.solve_memory``
    bytes, each block's rows read alone; None when it is averaged whole."""
    block = average_block_size(name, sources, options.solve_memory)
    if block is None:
        return None
    first = sources[0]
    shape = tuple(int(n) for n in first.shape(name))
    merged: NDArray[Any] | None = None
    for r0 in range(0, shape[0], block):
        r1 = min(shape[0], r0 + block)
        rows = [checked_input(name, s.label, read_rows(s, name, r0, r1)) for s in sources]
        value = average_tensor(name, rows, options)
        part = cast_merged(name, value, first.dtype(name))
        if merged is None:
            merged = np.empty(shape, dtype=part.dtype)
        merged[r0:r1] = part
    return merged


class Average(MergeMethod):
    """``Σ c_i θ_i / Σ c_i`` per parameter; the tensors other methods do not solve are
    merged so too."""

    name: ClassVar[str] = "average"
    summary: ClassVar[str] = "a (coefficient-weighted) average of the parameters"

    def tensor(self, name: str, tensors: Sequence[Any], inputs: MergeInputs) -> NDArray[np.float64]:
        return average_tensor(name, tensors, inputs.options)

    def merge_tensor(self, name: str, inputs: MergeInputs) -> NDArray[Any]:
        """A float32 tensor (no LoRA being built, not within a post-step) averaged into
        float32 in one pass of the core, which checks the inputs through the result: the
        numbers of the float64 average cast (the default path, bit for bit), without the
        separate checks, float64 result and cast (measured: bench/RESULTS.md, "the
        per-tensor floor"). Every other tensor as any method's."""
        sources = inputs.sources
        if inputs.lora is not None or not rounds_merged() or sources[0].dtype(name) != "float32":
            return super().merge_tensor(name, inputs)
        blocked = self.tensor_in_blocks(name, sources, inputs)
        if blocked is not None:
            return blocked
        reads = [s.read(name) for s in sources]
        options = inputs.options
        try:
            return weighted_average(
                reads, options.coefficients, dtype="float32", n_threads=options.threads
            )
        except ValueError as exc:
            for s, r in zip(sources, reads, strict=True):  # a NaN or Inf: named by model
                checked_input(name, s.label, r)
            raise MergeError(f"tensor {name!r}: {exc}") from None

    def tensor_in_blocks(
        self, name: str, sources: Sequence[TensorSource], inputs: MergeInputs
    ) -> NDArray[Any] | None:
        return average_in_blocks(name, sources, inputs.options)

    def memory(self, step: Step, sizes: StepSizes, inputs: MergeInputs) -> int:
        """The whole average's (:meth:`MergeMethod.memory`), or one block of rows' where it
        is averaged in blocks (over ``solve_memory``)."""
        whole = super().memory(step, sizes, inputs)
        if inputs.lora is not None:  # merges that also build a LoRA: never in blocks
            return whole
        name = step.tensors[0]
        block = average_block_size(name, inputs.sources, inputs.options.solve_memory)
        if block is None:
            return whole
        return whole * block // int(sizes.ref.shape(name)[0])


#: The one average: the method of the tensors RegMean, Fisher, RegMean++ and the
#: task-vector methods (where the base lacks one) do not merge themselves.
AVERAGE = Average()
