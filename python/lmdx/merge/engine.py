"""The merge engine: runs a plan's steps on demand, one at a time, and hands each merged
tensor to a sink (a dict in memory or a folder on disk).

Every step is run by the method it carries (:meth:`lmdx.merge.method.MergeMethod.compute`)
or, for a method whose group steps run on Ray, by a remote solver; what it returns
(:class:`lmdx.merge.method.Merged`) is merged tensors, already cast to their input
dtype, and report entries, which go into the report. A step's other tensors wait until
they are asked for. Peak memory is one step's inputs plus its results. (Reading the next
group while one solves was measured and not kept: on 2 cores the reading and hashing
compete with the solve's threads, no faster, 0.2 GB more; bench/RESULTS.md.)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from .._util import progress_bar
from .method import Merged, MergeInputs, Step, add_entries
from .plan import MergePlan

__all__ = ["Executor", "RemoteSolver", "Sink", "run"]


class RemoteSolver(Protocol):
    """Runs steps elsewhere (Ray workers): a step's :class:`Merged`, computed there."""

    def result(self, step: Step) -> Merged: ...

    def close(self) -> None: ...


class Sink(Protocol):
    """Where merged tensors go, in plan order."""

    def write(self, index: int, tensor: Any) -> None: ...


class Executor:
    """Computes merged tensors on demand, one step at a time, each by the method the step
    carries; the steps of a method that runs its group steps on Ray (``ray = "groups"``)
    by ``remote`` when given. Every step's report entries go into ``report`` and its
    tensors, with the Grams it read, to ``observe`` (what each task pays,
    :mod:`lmdx.merge.cost`); the merge's
    method sees every step's result (:meth:`~lmdx.merge.method.MergeMethod.after_step`).
    With ``inputs.lora``, a kept head tensor is also offered to that LoRA."""

    def __init__(
        self,
        inputs: MergeInputs,
        plan: MergePlan,
        report: dict[str, Any],
        remote: RemoteSolver | None = None,
        observe: Callable[[Mapping[str, Any], Mapping[str, Any]], None] | None = None,
    ) -> None:
        self.inputs, self.report, self.remote = inputs, report, remote
        self.observe = observe
        self.step_of = {t: s for s in plan.steps for t in s.tensors}
        self.ready: dict[str, Any] = {}

    def result(self, name: str) -> Any:
        """Merged tensor ``name`` (NumPy, or the source's own tensor for a copied one, in its
        input dtype); computed once, handed out once."""
        if name not in self.ready:
            self._run(name)
        return self.ready.pop(name)

    def _run(self, name: str) -> None:
        step = self.step_of.get(name)
        if step is None:  # a head tensor (kept from the first model)
            self.ready[name] = self.inputs.sources[0].read(name)
            if self.inputs.lora is not None:
                self.inputs.lora.observe(name, self.ready[name])
            return
        if self.remote is not None and step.method.ray == "groups":
            merged = self.remote.result(step)
        else:
            merged = step.method.compute(step, self.inputs)
        self.record(merged.report)
        if self.observe is not None:
            self.observe(merged.tensors, merged.grams)
        self.ready.update(merged.tensors)
        self.inputs.method.after_step(step, merged, self.inputs)

    def record(self, entries: Mapping[str, Any]) -> None:
        """Report entries of a step or the method (:func:`lmdx.merge.method.add_entries`)."""
        add_entries(self.report, entries)


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
