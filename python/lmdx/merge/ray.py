"""A method's group steps run by Ray tasks, a few steps ahead of the writer (methods with
``ray = "groups"``: RegMean's groups).

Each step is one task (one CPU), submitted in the order the writer needs the steps, at
most ``workers`` running and ``2 × workers`` ahead of the writer; a finished task gives
its CPU back, so more workers than CPUs only queue, and the task of a lost node runs
again (once) on a node that remains. A worker process opens the input checkpoints and
statistics once (on a cluster every node must see the same paths; no base, data or LoRA
of the merged update travels) and runs the step's
:meth:`~lmdx.merge.method.MergeMethod.compute` exactly as the local engine does, so the
merged tensors are bit-identical to a local run.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import _ray
from .._errors import LmdxError, MergeError, MissingFileError, RayClusterError
from ..config import release_memory
from ..files.checkpoint import Checkpoint
from ..stats.file import Statistics
from ..stats.join import join_statistics
from .method import Merged, MergeInputs, Step
from .options import MergeOptions
from .plan import MergePlan

__all__ = ["RayGroupSolver"]

#: The inputs a worker process opened last: (paths and their stat) -> (checkpoints, stats).
_OPENED: dict[tuple[Any, ...], tuple[list[Checkpoint], list[Statistics]]] = {}


def _open(
    models: list[str], stats: list[list[str]], labels: list[str]
) -> tuple[list[Checkpoint], list[Statistics]]:
    """The inputs, opened once per worker process (again if a path changed since); a
    model's statistics are one file or folder, or the parts to join."""
    files = [p for parts in stats for p in parts]
    missing = [p for p in (*models, *files) if not os.path.exists(p)]
    if missing:
        node = _ray.import_ray().util.get_node_ip_address()
        raise MissingFileError(
            f"Ray node {node} does not see {', '.join(missing)}: every node must see the "
            "models and statistics at the paths this process uses (a shared filesystem, or "
            f"copies there): {', '.join((*models, *files))}"
        )
    key = tuple((p, os.stat(p).st_mtime_ns) for p in (*models, *files)) + tuple(labels)
    if key not in _OPENED:
        _OPENED.clear()
        _OPENED[key] = (
            [Checkpoint(m, lab) for m, lab in zip(models, labels, strict=True)],
            [
                Statistics.load(parts[0])
                if len(parts) == 1
                else join_statistics([Statistics.load(p) for p in parts])
                for parts in stats
            ],
        )
    return _OPENED[key]


def _solve(
    inputs: tuple[list[str], list[list[str]], list[str], MergeOptions], step: Step
) -> Merged:
    """One step run by its method (a Ray task) on the inputs opened here; NumPy arrays
    (bfloat16 too) cross Ray's object store as they are."""
    models, stats, labels, options = inputs
    ckpts, st = _open(models, stats, labels)
    try:
        merged = step.method.compute(
            step, MergeInputs(step.method, options, list(ckpts), labels, st)
        )
        # the Grams it read stay here: the driver's cost meter reads its own
        return Merged(merged.tensors, merged.report)
    finally:
        # A worker outlives its task: it keeps no pooled matrices beyond the memory its
        # task asked Ray for.
        release_memory()


class RayGroupSolver:
    """Group steps submitted as Ray tasks in the order the writer needs them: at most
    ``workers`` running and ``2 × workers`` ahead (bounding the results held here), each
    asking Ray for the memory the plan estimates for it."""

    def __init__(
        self,
        models: list[str],
        stats: list[list[str]],
        labels: list[str],
        options: MergeOptions,
        steps: Sequence[Step],
        order: Sequence[str],
        workers: int,
        address: str | None,
    ) -> None:
        ray = self.ray = _ray.import_ray()
        self.refs: dict[int, Any] = {}
        self.ended: set[int] = set()  # groups whose task ended, not yet taken
        self.started = _ray.start_ray(address, workers)
        self.task = ray.remote(num_cpus=1, max_retries=1)(_solve)

        self.inputs = ray.put((models, stats, labels, options))
        step_of = {t: st for st in steps if st.method.ray == "groups" for t in st.tensors}
        seen: set[int] = set()
        self.queue: list[Step] = []
        for name in order:  # groups in the order their first member is written
            st = step_of.get(name)
            if st is not None and id(st) not in seen:
                seen.add(id(st))
                self.queue.append(st)
        self.position = {id(st): i for i, st in enumerate(self.queue)}
        # Each group asks for the memory its solve needs (the plan's estimate, at most what
        # the largest node offers; none where Ray offers no memory resource): two large
        # groups do not run at once on a node that cannot hold both.
        cap = int(_ray.largest_node(ray, "memory"))
        self.memory = [min(st.memory, cap) if cap > 0 else 0 for st in self.queue]
        self.next = 0
        self.workers = workers
        self.window = 2 * workers

    @classmethod
    def for_merge(
        cls, inputs: MergeInputs, plan: MergePlan, workers: int, address: str | None
    ) -> RayGroupSolver:
        """The solver of a streaming merge's group steps (checkpoints and statistics files:
        every worker opens them itself)."""
        stats = inputs.stats
        assert stats is not None
        paths = [s.files for s in stats]
        if any(p is None for p in paths):
            raise MergeError(
                "ray_workers: the statistics must be files or folders (paths); surrogate "
                "statistics (surrogate: true) are formed in this process: merge without Ray"
            )
        return cls(
            [str(Path(str(c.path)).absolute()) for c in inputs.sources],
            [[str(Path(p).absolute()) for p in parts or ()] for parts in paths],
            plan.labels,
            inputs.options,
            plan.steps,
            [o.source for o in plan.outputs],
            workers,
            address,
        )

    @staticmethod
    def check_address(address: str | None) -> None:
        """Raise :class:`~lmdx.RayClusterError` within seconds if ``address`` (a cluster
        to join; None: a local Ray) does not answer; call it before any output exists."""
        if address is not None and not _ray.import_ray().is_initialized():
            _ray.check_address(address)

    def _submit(self, index: int) -> None:
        """Submit groups up to ``index`` (always), then more while fewer than ``workers``
        are running, up to ``window`` past ``index``."""
        while self.next < len(self.queue) and self.next <= index + self.window:
            if self.next > index:
                running = len(self.refs) - len(self.ended)
                if running >= self.workers:
                    return
            step = self.queue[self.next]
            task = self.task
            if self.memory[self.next]:
                task = task.options(memory=self.memory[self.next])
            self.refs[self.next] = task.remote(self.inputs, step)
            self.next += 1

    def _name(self, i: int) -> str:
        step = self.queue[i]
        return f"the {step.kind} group of {(step.modules or step.tensors)[0]!r}"

    def result(self, step: Step) -> Merged:
        """What ``step`` produced on its worker: its merged tensors (NumPy, in their input
        dtype; read-only) and report entries."""
        i = self.position[id(step)]
        while True:  # wake up whenever a group ends, to submit the next ones
            self._submit(i)
            ref = self.refs[i]
            out = [ref, *(r for j, r in self.refs.items() if j != i and j not in self.ended)]
            done = _ray.wait_ready(self.ray, out, 1, lambda: self._name(i), self.memory[i])
            self.ended.update(j for j, r in self.refs.items() if r in done)
            if ref in done:
                break
        del self.refs[i]
        self.ended.discard(i)
        try:
            merged: Merged = self.ray.get(ref)
        except self.ray.exceptions.RayError as exc:
            cause = getattr(exc, "cause", None)
            if isinstance(cause, LmdxError):  # what a local merge raises, as it would
                raise cause from None
            raise RayClusterError(
                f"{self._name(i)} failed on its Ray worker: {_ray.failure(self.ray, exc)}"
            ) from None
        return Merged(dict(merged.tensors), merged.report)

    def close(self) -> None:
        """Cancel the groups still out; shut Ray down if this solver started it."""
        _ray.stop_ray(self.ray, list(self.refs.values()), self.started)
        self.refs.clear()
