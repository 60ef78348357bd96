"""``regmean`` (Jin et al., ICLR 2023): every linear layer solved in closed form from the
Gram matrices of its inputs; modules sharing one input Gram (q/k/v) in one system."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

from ..._errors import MergeError
from ..._util import matches
from ..methods import regmean_groups
from ..output_blocks import output_block_size, regmean_memory, solve_precision
from ..plan import Step, StepSizes
from ..registry import MergeMethod, NoOptions
from .solve_options import SolveOptions

if TYPE_CHECKING:
    from ..engine import Executor
    from ..inputs import MergeInputs

__all__ = ["RegMean"]


class RegMean(MergeMethod):
    """Linear weights with statistics in every file solved (``W_Mᵀ = (Σ c_i G̃_i)⁻¹ Σ c_i
    G̃_i W_iᵀ``, :func:`lmdx.merge.methods.solve_group`), everything else averaged."""

    name: ClassVar[str] = "regmean"
    summary: ClassVar[str] = (
        "RegMean (Jin et al., ICLR 2023, arXiv 2212.09849): every linear layer solved in "
        "closed form from the Gram matrices of its inputs"
    )
    options: ClassVar[type[NoOptions]] = SolveOptions
    stats: ClassVar[str | None] = "regmean-gram"
    ray: ClassVar[str] = "groups"

    def group_steps(self, inputs: MergeInputs, body: Sequence[str], tied: set[str]) -> list[Step]:
        stats = inputs.stats
        assert stats is not None
        steps = []
        for members in regmean_groups(stats, set(body), tied, inputs.options):
            info = stats[0].modules[members[0]]
            for i, s in enumerate(stats):
                if s.count(members[0]) <= 0:
                    lab = inputs.labels[i]
                    raise MergeError(
                        f"statistics {s.source or lab} (of {lab}): module {members[0]!r} saw "
                        "no rows; collect them on data that reaches it, or exclude it"
                    )
            steps.append(
                Step(
                    self.name,
                    [stats[0].modules[m]["weight"] for m in members],
                    members,
                    info["layout"],
                    int(stats[0].groups[stats[0].group_of(members[0])]["dim"]),
                )
            )
        return steps

    def tensor_kind(self, inputs: MergeInputs, name: str) -> str:
        return "average"

    def compute(self, step: Step, executor: Executor) -> None:
        executor.regmean_step(step)

    def memory(self, step: Step, sizes: StepSizes, inputs: MergeInputs) -> int:
        """:func:`~lmdx.merge.output_blocks.regmean_memory`, in blocks of output rows where
        the group is solved so (over ``solve_memory``)."""
        # Merges that also build a LoRA of the merged update are never solved in blocks.
        block = (
            None
            if inputs.lora is not None
            else output_block_size(step, inputs.sources, inputs.options)
        )
        return regmean_memory(step, sizes, block, solve_precision(inputs.options))

    def report(self, inputs: MergeInputs) -> dict[str, Any]:
        """The options, and the linear weights the statistics could not cover (averaged)
        with why."""
        out = super().report(inputs)
        stats = inputs.stats or []
        missing = {n: why for s in stats for n, why in s.not_solved.items()}
        heads = inputs.options.heads
        missing = {n: why for n, why in sorted(missing.items()) if not matches(n, heads)}
        if missing:
            out["not_solved"] = missing
        return out
