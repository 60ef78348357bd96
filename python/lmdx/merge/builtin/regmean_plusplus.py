"""``regmean_plusplus`` (RegMean++): the models' repeated blocks merged in order, each on
Grams taken through the merged blocks before it (:mod:`lmdx.merge.regmean_plusplus`), on
every model's own data at merge time."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Annotated, Any, ClassVar

from pydantic import Field

from ..method import Merged, MergeInputs, MergeMethod, NoOptions, Step, StepSizes, tensor_step
from ..regmean_plusplus import BlockMerger, activation_budget, model_blocks, prepare_batches
from ..skeleton import Block
from .average import AVERAGE
from .regmean import regmean_groups, solve_step
from .regmean_solve import SolveOptions, regmean_memory, solve_precision

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
    shows_progress: ClassVar[bool] = True  # its bar counts blocks

    def check(self, inputs: MergeInputs) -> None:
        inputs.state["blocks"] = model_blocks(inputs.sources[0])

    @staticmethod
    def _blocks(inputs: MergeInputs) -> list[Block]:
        blocks: list[Block] = inputs.state["blocks"]
        return blocks

    def group_steps(self, inputs: MergeInputs, body: Sequence[str], tied: set[str]) -> list[Step]:
        inputs.state["tied"] = tied
        steps = []
        for index, block in enumerate(self._blocks(inputs)):
            inside = [n for n in body if n.startswith(block.prefix + ".")]
            steps.append(
                Step(
                    self,
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
        index = {}
        for i, block in enumerate(self._blocks(inputs)):
            for n in names:
                if n.startswith(block.prefix + "."):
                    index[n] = i
        return sorted(names, key=lambda n: index.get(n, -1))

    def tensor_method(self, inputs: MergeInputs, name: str) -> MergeMethod:
        return AVERAGE

    def compute(self, step: Step, inputs: MergeInputs) -> Merged:
        """A whole block: its linear modules RegMean-solved on the Grams its block merger
        collects through the merged prefix (:func:`lmdx.merge.builtin.regmean.solve_step`),
        every other tensor merged alone (averaged, or copied if not floating point)."""
        merger: BlockMerger = inputs.state["merger"]
        merged = Merged({})
        grams = merger.grams(step)
        if grams is not None:
            on_grams = replace(inputs, stats=grams, lora=None)
            for members in regmean_groups(
                grams, set(step.tensors), inputs.state["tied"], inputs.options
            ):
                info = grams[0].modules[members[0]]
                weights = [grams[0].modules[m]["weight"] for m in members]
                group = Step(self, weights, members, info["layout"], int(info["dim"]))
                merged.update(solve_step(group, on_grams))
        for name in step.tensors:
            if name not in merged.tensors:
                alone = tensor_step(inputs, name)
                merged.update(alone.method.compute(alone, inputs))
        merger.finish(step, merged.tensors)
        return merged

    def memory(self, step: Step, sizes: StepSizes, inputs: MergeInputs) -> int:
        """One model's block (the one running), the merged block, K full Grams per linear
        module and the solve of its largest module (the activations are not included: see
        :mod:`lmdx.merge.regmean_plusplus`)."""
        assert step.block is not None
        dims = self._blocks(inputs)[step.block].linear
        ref = inputs.sources[0]
        weights = [f"{m}.weight" for m in dims if f"{m}.weight" in step.tensors]
        largest = max(weights, key=ref.nbytes, default=None)
        solve = 0
        if largest is not None:
            module = largest.removesuffix(".weight")
            one = Step(self, [largest], [module], dim=dims[module])
            precision = solve_precision(inputs.options)
            solve = regmean_memory(one, sizes.of(one, packed=False), precision=precision)
        k = sizes.k
        return 2 * sizes.read + sizes.widened + k * sum(8 * d * d for d in dims.values()) + solve

    def plan_notes(self, inputs: MergeInputs, steps: Sequence[Step]) -> list[str]:
        return [
            "blocks merged in order on each model's data; the activations held between "
            "blocks (K × tokens × hidden size) are not in the memory estimate "
            "(max_activation_memory bounds them)"
        ]

    def step_label(self, step: Step) -> str:
        if step.block is None:
            return super().step_label(step)
        return f"block {step.block} ({len(step.modules)} linear modules)"

    def start(self, inputs: MergeInputs, progress: bool) -> None:
        """The block merger the blocks are merged with, its data tokenized into batches."""
        own = inputs.options.own(RegMeanPlusPlusOptions)
        assert inputs.data is not None  # checked: lmdx.merge.inputs.check_needs
        batches = prepare_batches(
            inputs.sources,
            inputs.data,
            inputs.tokenizer,
            max_texts=own.max_texts,
            max_length=own.max_length,
            batch_size=own.batch_size,
        )
        inputs.state["merger"] = BlockMerger(
            inputs.sources,
            self._blocks(inputs),
            batches,
            inputs.options,
            inputs.labels,
            max_activation_memory=activation_budget(own.max_activation_memory),
            progress=progress,
        )

    def after_step(self, step: Step, merged: Merged, inputs: MergeInputs) -> None:
        """The tensors outside the blocks, to the block merger (its prefix needs them)."""
        if step.block is None:
            for name, tensor in merged.tensors.items():
                inputs.state["merger"].record(name, tensor)

    def finish(self, inputs: MergeInputs) -> dict[str, Any]:
        """What the block merger ran (blocks, batches held or recomputed, forwards)."""
        return {self.name: inputs.state["merger"].summary()}
