"""The merge engine: runs a plan's steps on demand, one at a time, and hands each merged
tensor to a sink (a dict in memory or a folder on disk).

Every merged float tensor is computed in float64 (:mod:`lmdx.merge.methods`), checked
finite and cast to its input's dtype; a RegMean group's other members wait, already
cast, until they are asked for. Peak memory is one step's inputs plus its results. (Reading
the next RegMean group while one solves was measured and not kept: on 2 cores the reading
and hashing compete with the solve's threads, no faster, 0.2 GB more; bench/RESULTS.md.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

from .._util import progress_bar
from ..config import default_threads
from ..stats.file import Statistics
from .lora import LoraExport, low_rank_inputs, solve_group_low_rank
from .methods import cast_merged, poorly_determined, solve_group
from .options import MergeOptions
from .output_blocks import output_block_size, solve_in_output_blocks
from .plan import MergePlan, Step
from .registry import method_named, step_method, tensor_step_kind
from .source import TensorSource

if TYPE_CHECKING:
    from .inputs import MergeInputs

__all__ = [
    "BlockSolver",
    "Executor",
    "GroupSolver",
    "Sink",
    "run",
    "solve_regmean_step",
]


class GroupSolver(Protocol):
    """Solves RegMean groups elsewhere (Ray actors): stored tensors and solver report."""

    def result(self, step: Step) -> tuple[dict[str, Any], dict[str, Any]]: ...

    def close(self) -> None: ...


class BlockSolver(Protocol):
    """Merges the models' repeated blocks in order (RegMean++:
    :class:`lmdx.merge.regmean_plusplus.BlockMerger`): it is handed every merged tensor
    outside the blocks, solves a block's linear modules and takes the merged block."""

    def record(self, name: str, tensor: Any) -> None: ...

    def solve(
        self, step: Step
    ) -> tuple[dict[str, Any], list[tuple[list[str], dict[str, Any]]]]: ...

    def finish(self, step: Step, merged: Mapping[str, Any]) -> None: ...


class Sink(Protocol):
    """Where merged tensors go, in plan order."""

    def write(self, index: int, tensor: Any) -> None: ...


class Executor:
    """Computes merged tensors on demand, one step at a time, each by the registered
    method its kind names (:meth:`lmdx.merge.registry.MergeMethod.compute`).

    ``report["layers"]`` collects the RegMean solver's information per module,
    ``report["poorly_determined"]`` the RegMean systems that are poorly determined (too
    few statistics rows per input, ill-conditioned) with what to do. With ``inputs.lora``,
    every merged tensor is also offered to that LoRA of the merged update (in float64).
    ``remote`` solves RegMean groups elsewhere (Ray); ``blocks`` merges RegMean++'s
    blocks and is handed every merged tensor outside them.
    """

    def __init__(
        self,
        inputs: MergeInputs,
        plan: MergePlan,
        report: dict[str, Any],
        remote: GroupSolver | None = None,
        blocks: BlockSolver | None = None,
    ) -> None:
        self.inputs = inputs
        self.sources, self.stats = inputs.sources, inputs.stats
        self.options, self.report, self.remote = inputs.options, report, remote
        self.blocks, self.lora = blocks, inputs.lora
        self.labels = plan.labels
        self.step_of = {t: s for s in plan.steps for t in s.tensors}
        self.ready: dict[str, Any] = {}
        report.setdefault("layers", {})
        report.setdefault("poorly_determined", [])

    def result(self, name: str) -> Any:
        """Merged tensor ``name`` (NumPy, or the source's own tensor for a copied one, in its
        input dtype); computed once, handed out once."""
        if name not in self.ready:
            self._run(name)
        return self.ready.pop(name)

    def _run(self, name: str) -> None:
        step = self.step_of.get(name)
        if step is None:  # a head tensor (kept from the first model)
            self.ready[name] = self.sources[0].read(name)
            if self.lora is not None:
                self.lora.observe(name, self.ready[name])
            return
        step_method(step.kind).compute(step, self)
        if self.blocks is not None and step.block is None:
            self.blocks.record(name, self.ready[name])

    def merge_tensor(self, name: str, kind: str) -> Any:
        """Merged tensor ``name`` by the one-tensor method ``kind``, cast to its input
        dtype."""
        if self.lora is None:  # large ones in blocks of rows
            blocked = method_named(kind).tensor_in_blocks(name, self.sources, self.inputs)
            if blocked is not None:
                return blocked
        reads = [s.read(name) for s in self.sources]
        value = method_named(kind).tensor(name, reads, self.inputs)
        if self.lora is not None:
            self.lora.observe(name, value)
        return cast_merged(name, value, self.sources[0].dtype(name))

    def regmean_step(self, step: Step) -> None:
        """One RegMean group, solved here or by ``remote``."""
        assert self.stats is not None
        if self.remote is not None:
            stored, layers = self.remote.result(step)
            self.record(step.modules[0], layers)
            self.ready.update(stored)
            return
        solved, layers = solve_regmean_step(
            step, self.sources, self.stats, self.labels, self.options, self.lora
        )
        self.record(step.modules[0], layers)
        self.ready.update(solved)

    def block_step(self, step: Step) -> None:
        """A whole block (RegMean++): its linear modules solved on Grams from the merged
        prefix, every other tensor merged alone (:func:`lmdx.merge.registry.tensor_step_kind`:
        averaged, or copied if not floating point)."""
        assert self.blocks is not None
        merged, groups = self.blocks.solve(step)
        for members, layers in groups:
            self.record(members[0], layers)
        for name in step.tensors:
            if name not in merged:
                alone = Step(tensor_step_kind(self.inputs, name), [name])
                step_method(alone.kind).compute(alone, self)
                merged[name] = self.ready.pop(name)
        self.blocks.finish(step, merged)
        self.ready.update(merged)

    def record(self, module: str, layers: dict[str, Any]) -> None:
        """The solver's report of a RegMean group (``module``: its first member)."""
        self.report["layers"].update(layers)
        note = poorly_determined(module, layers[module], self.inputs.options.alpha)
        if note is not None:
            self.report["poorly_determined"].append(note)


def solve_regmean_step(
    step: Step,
    sources: Sequence[TensorSource],
    stats: Sequence[Statistics],
    labels: Sequence[str],
    options: MergeOptions,
    lora: LoraExport | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One RegMean group read from ``sources`` (its weights) and ``stats`` (its Grams as
    stored, checked against their content hashes) and solved: its merged weights (NumPy,
    cast to their input dtype) and the solver's report per module. Local runs and Ray
    actors both call this. LoRA adapters over one base are solved on their factors
    (:func:`lmdx.merge.lora.solve_group_low_rank`); ``lora`` receives the merged updates."""
    factors = low_rank_inputs(step, sources)
    if factors is not None:
        solved, updates, layers = solve_group_low_rank(
            step, sources, factors, stats, labels, options
        )
        if lora is not None:
            for w, update in updates.items():
                lora.add_update(w, update)
    else:
        # The K models' weights and Grams are read, and the Grams checked against their
        # SHA-256, on the CPUs available: reading and hashing release the GIL. A group too
        # large for the solve's memory budget is read and solved in blocks of output rows.
        block = None if lora is not None else output_block_size(step, sources, options)
        with ThreadPoolExecutor(min(len(stats), default_threads()), "lmdx-read") as pool:
            grams_read = pool.map(lambda s: s.gram_stored(step.modules[0]), stats)
            weights = [] if block else [[s.read(w) for w in step.tensors] for s in sources]
            grams = list(grams_read)
        if block:
            return solve_in_output_blocks(step, sources, stats, grams, labels, options, block)
        solved, layers = solve_group(step.modules, weights, grams, stats, labels, options)
        del weights, grams
        if lora is not None:
            for w, value in solved.items():
                lora.observe(w, value)
    return {w: cast_merged(w, v, sources[0].dtype(w)) for w, v in solved.items()}, layers


def run(
    plan: MergePlan, produce: Callable[[str], Any], sink: Sink, desc: str, progress: bool
) -> None:
    """Every output of ``plan``, in order: ``produce(source name)`` into ``sink``."""
    bar = progress_bar(len(plan.outputs), desc, progress, unit="tensor")
    try:
        for i, out in enumerate(plan.outputs):
            sink.write(i, produce(out.source))
            bar.update(1)
    finally:
        bar.close()
