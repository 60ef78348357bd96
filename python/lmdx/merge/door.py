"""The setup both front doors share (:func:`lmdx.merge_models` in memory,
:func:`lmdx.stream_merge` on disk): options checked, inputs opened and checked, the plan
made, the report started, the engine run; the doors differ only in where tensors come from
and go to."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .._errors import MergeError
from ..config import release_memory
from .cost import CostMeter, flagged_refusal, open_cost
from .engine import Executor, RemoteSolver, Sink, run
from .method import MergeInputs
from .plan import MergePlan, make_plan

__all__ = ["PreparedMerge", "check_new_folder", "prepare_merge"]


def check_new_folder(out: str | os.PathLike[str]) -> Path:
    """``out`` as a path; :class:`MergeError` if it exists (a merge never writes into an
    existing folder). Every front door calls this before any work."""
    path = Path(out)
    if path.exists():
        raise MergeError(f"output {path}: already exists; choose a new directory")
    return path


@dataclass
class PreparedMerge:
    """A merge checked and planned, ready to run."""

    inputs: MergeInputs
    plan: MergePlan
    cost: CostMeter | None = None

    def report(self, streaming: bool) -> dict[str, Any]:
        """The merge report as it starts: method, models, the shared options, the method's
        entries (:meth:`lmdx.merge.method.MergeMethod.report`); ``layers`` and
        ``poorly_determined`` are filled by methods that solve systems."""
        inputs, plan = self.inputs, self.plan
        options = inputs.options
        report: dict[str, Any] = {
            "method": options.method,
            "streaming": streaming,
            "models": plan.labels,
            "coefficients": None if options.coefficients is None else list(options.coefficients),
            "exclude": list(options.exclude),
            "heads": list(options.heads.patterns),
            "head_tensors": plan.heads,
            "solve_memory": options.solve_memory,
            "layers": {},
            "poorly_determined": [],
        }
        if plan.tied:
            report["tied"] = plan.tied
        report.update(inputs.method.report(inputs))
        return report

    def run(
        self,
        report: dict[str, Any],
        sink: Sink,
        progress: bool,
        remote: RemoteSolver | None = None,
        streaming: bool = False,
        measure_only: bool = False,
    ) -> None:
        """Every output of the plan into ``sink``; ``report`` gets the steps' entries and
        the method's last ones (:meth:`~lmdx.merge.method.MergeMethod.finish`) and, with a
        cost meter, ``cost`` (:mod:`lmdx.merge.cost`). A merge whose contributors the
        meter flags is refused (:class:`MergeError`, before the door writes or returns
        anything) unless the options accept it or the merge is only measured
        (``measure_only``)."""
        method = self.inputs.method
        method.start(self.inputs, progress)
        observe = None if self.cost is None else self.cost.observe
        executor = Executor(self.inputs, self.plan, report, remote, observe)
        desc = f"merge ({method.name}{', streaming' if streaming else ''})"
        try:
            run(self.plan, executor.result, sink, desc, progress and not method.shows_progress)
            executor.record(method.finish(self.inputs))
        finally:
            release_memory()  # the matrices the core kept between layers
        if self.cost is not None:
            report["cost"] = cost = self.cost.report()
            if cost["flagged"] and not measure_only:
                if not self.inputs.options.accept_flagged:
                    raise MergeError(flagged_refusal(cost))
                cost["accepted"] = True


def prepare_merge(
    inputs: MergeInputs,
    *,
    folder: bool,
    before_plan: Callable[[MergeInputs], None] | None = None,
    stats: Sequence[Any] | None = None,
    cost: bool | str | None = None,
) -> PreparedMerge:
    """The plan of the opened ``inputs`` (:func:`lmdx.merge.inputs.open_inputs`, the input
    step both doors share), after ``before_plan``: the door's own checks on them; with
    the meter of what each task pays (:func:`lmdx.merge.cost.open_cost`: ``stats`` the
    door's argument, ``cost`` True, False or None: when the method's statistics are
    Grams)."""
    if before_plan is not None:
        before_plan(inputs)
    plan = make_plan(inputs, folder=folder)
    return PreparedMerge(inputs, plan, open_cost(inputs, stats, cost))
