"""``regmean_plusplus`` (RegMean++): the models' repeated blocks merged in order, each on
Grams taken through the merged blocks before it (:mod:`lmdx.merge.regmean_plusplus`), on
every model's own data at merge time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, ClassVar

from pydantic import Field

from ..output_blocks import regmean_memory, solve_precision
from ..plan import Step, StepSizes
from ..registry import MergeMethod, NoOptions
from ..regmean_plusplus import BlockMerger, activation_budget, model_blocks, prepare_batches
from .solve_options import SolveOptions

if TYPE_CHECKING:
    from ..engine import Executor
    from ..inputs import MergeInputs
    from ..plan import MergePlan

__all__ = ["RegMeanPlusPlus", "RegMeanPlusPlusOptions"]


class RegMeanPlusPlusOptions(SolveOptions):
    """RegMean's solve options and how each model's texts are read and run."""

    max_texts: Annotated[int, Field(ge=1)] | None = Field(
        None,
        description="the first max_texts of each model's texts (default: all)",
        json_schema_extra={"label": "must be a whole number >= 1"},
    )
    max_length: Annotated[
        int,
        Field(
            ge=1,
            description="tokens per text",
            json_schema_extra={"label": "must be a whole number of tokens >= 1"},
        ),
    ] = 128
    batch_size: Annotated[
        int,
        Field(
            ge=1,
            description="texts per forward pass",
            json_schema_extra={"label": "must be a whole number >= 1"},
        ),
    ] = 16
    max_activation_memory: int | str | None = Field(
        None,
        description="the most bytes of activations held between blocks (e.g. 8GB; "
        "default: all); beyond it they are recomputed",
    )


class RegMeanPlusPlus(MergeMethod):
    """Every block's linear modules RegMean-solved on Grams from the merged prefix (the
    rest of the block averaged), block after block."""

    name: ClassVar[str] = "regmean_plusplus"
    summary: ClassVar[str] = (
        "RegMean++: the blocks merged in order, each block's linear layers solved in closed "
        "form on Grams taken through the merged blocks before it"
    )
    options: ClassVar[type[NoOptions]] = RegMeanPlusPlusOptions
    takes_data: ClassVar[bool] = True
    ray: ClassVar[str] = "refused"

    def check(self, inputs: MergeInputs) -> None:
        inputs.blocks = model_blocks(inputs.sources[0])

    def group_steps(self, inputs: MergeInputs, body: Sequence[str], tied: set[str]) -> list[Step]:
        assert inputs.blocks is not None
        steps = []
        for index, block in enumerate(inputs.blocks):
            inside = [n for n in body if n.startswith(block.prefix + ".")]
            steps.append(
                Step(
                    self.name,
                    inside,
                    list(block.linear),
                    dim=max(block.linear.values(), default=0),
                    block=index,
                )
            )
        return steps

    def order(self, inputs: MergeInputs, names: list[str]) -> list[str]:
        """Every tensor outside the blocks first, then block by block (each in its original
        order): the order RegMean++ produces them in."""
        assert inputs.blocks is not None
        index = {}
        for i, block in enumerate(inputs.blocks):
            for n in names:
                if n.startswith(block.prefix + "."):
                    index[n] = i
        return sorted(names, key=lambda n: index.get(n, -1))

    def tensor_kind(self, inputs: MergeInputs, name: str) -> str:
        return "average"

    def compute(self, step: Step, executor: Executor) -> None:
        executor.block_step(step)

    def memory(self, step: Step, sizes: StepSizes, inputs: MergeInputs) -> int:
        """One model's block (the one running), the merged block, K full Grams per linear
        module and the solve of its largest module (the activations are not included: see
        :mod:`lmdx.merge.regmean_plusplus`)."""
        assert inputs.blocks is not None and step.block is not None
        dims = inputs.blocks[step.block].linear
        ref = inputs.sources[0]
        weights = [f"{m}.weight" for m in dims if f"{m}.weight" in step.tensors]
        largest = max(weights, key=ref.nbytes, default=None)
        solve = 0
        if largest is not None:
            module = largest.removesuffix(".weight")
            one = Step("regmean", [largest], [module], dim=dims[module])
            precision = solve_precision(inputs.options)
            solve = regmean_memory(one, sizes.of(one, packed=False), precision=precision)
        k = sizes.k
        return 2 * sizes.read + sizes.widened + k * sum(8 * d * d for d in dims.values()) + solve

    def engine_helper(self, inputs: MergeInputs, plan: MergePlan, progress: bool) -> BlockMerger:
        """The block merger the engine hands the blocks to, its data tokenized into
        batches."""
        assert inputs.blocks is not None
        own = inputs.options.own(RegMeanPlusPlusOptions)
        batches = prepare_batches(
            inputs.sources,
            inputs.data,
            inputs.tokenizer,
            max_texts=own.max_texts,
            max_length=own.max_length,
            batch_size=own.batch_size,
        )
        return BlockMerger(
            inputs.sources,
            inputs.blocks,
            batches,
            inputs.options,
            plan.labels,
            tied=set(plan.tied) | set(plan.tied.values()),
            max_activation_memory=activation_budget(own.max_activation_memory),
            progress=progress,
        )
