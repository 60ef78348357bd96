"""RegMean groups solved on Ray actors, a few groups ahead of the writer.

Each actor opens the input checkpoints and statistics itself (on a cluster every node
must see the same paths) and solves one group at a time exactly as the local engine does
(same kernels, same cast), so the merged tensors are bit-identical to a local run.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .. import _ray
from .._errors import MergeError
from ..files.checkpoint import Checkpoint
from ..stats.file import Statistics
from .engine import solve_regmean_step
from .options import MergeOptions
from .plan import Step

__all__ = ["RayGroupSolver"]


class _Actor:
    """A Ray actor's state: the inputs and statistics, opened once."""

    def __init__(
        self, models: list[str], stats: list[str], labels: list[str], options: MergeOptions
    ) -> None:
        self.ckpts = [Checkpoint(m, lab) for m, lab in zip(models, labels, strict=True)]
        self.stats = [Statistics.load(p) for p in stats]
        self.labels, self.options = labels, options

    def solve(self, step: Step) -> tuple[dict[str, Any], dict[str, Any]]:
        # NumPy arrays (bfloat16 too) cross Ray's object store as they are
        return solve_regmean_step(step, self.ckpts, self.stats, self.labels, self.options)


class RayGroupSolver:
    """RegMean groups submitted to ``workers`` Ray actors in the order the writer needs
    them, at most ``2 × workers`` ahead (bounding the results held here)."""

    def __init__(
        self,
        models: list[str],
        stats: list[str],
        labels: list[str],
        options: MergeOptions,
        steps: Sequence[Step],
        order: Sequence[str],
        workers: int,
        address: str | None,
    ) -> None:
        ray = self.ray = _ray.import_ray()
        self.started = _ray.start_ray(address, workers)
        cls = ray.remote(num_cpus=1, max_restarts=1, max_task_retries=1)(_Actor)
        self.actors = [cls.remote(models, stats, labels, options) for _ in range(workers)]
        step_of = {t: st for st in steps if st.kind == "regmean" for t in st.tensors}
        seen: set[int] = set()
        self.queue: list[Step] = []
        for name in order:  # groups in the order their first member is written
            st = step_of.get(name)
            if st is not None and id(st) not in seen:
                seen.add(id(st))
                self.queue.append(st)
        self.position = {id(st): i for i, st in enumerate(self.queue)}
        self.refs: dict[int, Any] = {}
        self.next = 0
        self.window = 2 * workers

    def _submit_until(self, index: int) -> None:
        while self.next < len(self.queue) and self.next <= index + self.window:
            actor = self.actors[self.next % len(self.actors)]
            self.refs[self.next] = actor.solve.remote(self.queue[self.next])
            self.next += 1

    def result(self, step: Step) -> tuple[dict[str, Any], dict[str, Any]]:
        """The merged tensors of ``step`` (NumPy, in their input dtype; read-only) and the
        solver's report per module."""
        i = self.position[id(step)]
        self._submit_until(i)
        ref = self.refs.pop(i)
        try:
            solved, layers = self.ray.get(ref)
        except self.ray.exceptions.RayError as exc:
            raise MergeError(
                f"RegMean of {step.modules[0]!r} failed on its Ray worker: "
                f"{_ray.failure(self.ray, exc)}"
            ) from exc
        return dict(solved), layers

    def close(self) -> None:
        _ray.kill_actors(self.ray, self.actors, self.started)
