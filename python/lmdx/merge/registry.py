"""The merge methods, one registered object each: what a method needs, its options and its
arithmetic. The plan, the engine, the option checks, the configuration schema, the CLI help
and the model card ask the registry; nothing else in :mod:`lmdx.merge` names a method.

A method is a subclass of :class:`MergeMethod` registered with :func:`register_method`; the
built-in ones (:mod:`lmdx.merge.builtin`) are registered exactly so. The smallest method
merges one tensor at a time::

    class KeepFirst(MergeMethod):
        name = "keep_first"
        summary = "the first model's tensors"

        def tensor(self, name, tensors, inputs):
            return np.asarray(tensors[0], dtype=np.float64)

    register_method(KeepFirst())

What a method declares (class attributes): ``name``; ``summary`` (its line in the model card
and ``lmdx merge --help``); ``options``, a pydantic model of the method's own options (types,
defaults, checks; each field's description is its help text, and a field's
``json_schema_extra={"label": ...}`` the words of its error message); ``stats``, the kind
of statistics it needs one of per model (``"regmean-gram"``, ``"fisher"`` or None);
``needs_base`` (the pre-trained model, for task vectors), ``takes_data`` (each model's
texts at merge time) and ``ray`` (whether its steps may run on Ray workers). What it does
(methods, all with defaults): :meth:`MergeMethod.check` (inputs, before any work),
:meth:`~MergeMethod.group_steps` (steps over several tensors),
:meth:`~MergeMethod.order` (the order of the outputs), :meth:`~MergeMethod.tensor_kind`
(the method of every other tensor), :meth:`~MergeMethod.tensor` (one tensor's
arithmetic), :meth:`~MergeMethod.compute` (one step in the engine),
:meth:`~MergeMethod.memory` (a step's memory estimate), :meth:`~MergeMethod.engine_helper`
(what runs its group steps) and :meth:`~MergeMethod.report` (its entries in
``lmdx_merge.json``).

A plan's step names the method that runs it (:func:`step_method`): a registered one, or
:data:`COPY` for a tensor that is not floating point (an integer buffer), which no user
chooses and which is not among :func:`methods`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, ConfigDict

from .._errors import MergeError

if TYPE_CHECKING:
    from .engine import Executor
    from .inputs import MergeInputs
    from .plan import MergePlan, Step, StepSizes
    from .source import TensorSource

__all__ = [
    "COPY",
    "MergeMethod",
    "NoOptions",
    "method_named",
    "method_names",
    "methods",
    "option_users",
    "register_method",
    "step_method",
    "tensor_step_kind",
]


class NoOptions(BaseModel):
    """The options of a method that has none of its own (the base of every method's
    options: unknown keys and ``true`` for 1 are refused, values must be finite)."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)


class MergeMethod:
    """One merge method; subclass, set the class attributes, override what differs, and
    :func:`register_method` an instance."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    options: ClassVar[type[BaseModel]] = NoOptions
    stats: ClassVar[str | None] = None
    needs_base: ClassVar[bool] = False
    takes_data: ClassVar[bool] = False
    #: Where its group steps run with ``ray_workers``: ``"groups"`` (on Ray actors, through
    #: :func:`lmdx.merge.engine.solve_regmean_step`), ``"local"`` (in this process) or
    #: ``"refused"`` (the merge must run in one process).
    ray: ClassVar[str] = "local"
    #: The options ``lmdx merge`` names in its one-line summary (e.g. TIES's density).
    headline: ClassVar[tuple[str, ...]] = ()

    def check(self, inputs: MergeInputs) -> None:
        """Refuse inputs this method cannot merge, before any work (:class:`MergeError`);
        the checks every method shares (statistics, base, data) are done already."""

    def group_steps(self, inputs: MergeInputs, body: Sequence[str], tied: set[str]) -> list[Step]:
        """Steps that merge several tensors together (RegMean groups, blocks); the other
        tensors of ``body`` get one step each (:meth:`tensor_kind`)."""
        return []

    def order(self, inputs: MergeInputs, names: list[str]) -> list[str]:
        """The order the merged tensors are produced in (default: the models')."""
        return names

    def tensor_kind(self, inputs: MergeInputs, name: str) -> str:
        """The method that merges floating-point tensor ``name`` when no group step covers
        it: this method (default) or another registered one (``"average"``)."""
        return self.name

    def tensor(self, name: str, tensors: Sequence[Any], inputs: MergeInputs) -> NDArray[np.float64]:
        """Merged tensor ``name`` from every model's ``tensors`` (torch tensors or NumPy
        arrays, in model order), in float64; ``inputs`` has the options
        (``inputs.options``), statistics and base."""
        raise MergeError(f"method {self.name!r} merges no single tensors")

    def tensor_in_blocks(
        self, name: str, sources: Sequence[TensorSource], inputs: MergeInputs
    ) -> NDArray[Any] | None:
        """Merged tensor ``name``, already cast, computed block by block of rows read alone
        when the whole would not fit the memory budget; None (default): merge it whole
        with :meth:`tensor`."""
        return None

    def compute(self, step: Step, executor: Executor) -> None:
        """Run ``step``: put its merged tensors in ``executor.ready`` (default: one tensor
        by :meth:`tensor`, through :meth:`Executor.merge_tensor`)."""
        name = step.tensors[0]
        executor.ready[name] = executor.merge_tensor(name, step.kind)

    def memory(self, step: Step, sizes: StepSizes, inputs: MergeInputs) -> int:
        """Estimated bytes while ``step`` runs: K reads (and widened copies of 16-bit
        weights), the float64 result and the cast result."""
        return sizes.k * (sizes.read + sizes.widened) + 8 * sizes.n + sizes.out

    def plan_notes(self, inputs: MergeInputs) -> list[str]:
        """Lines the plan says about the inputs (``lmdx merge --dry-run``); none by default."""
        return []

    def engine_helper(self, inputs: MergeInputs, plan: MergePlan, progress: bool) -> Any:
        """What the engine hands this method's group steps to, built once the plan is made
        (RegMean++'s block merger, :class:`lmdx.merge.engine.BlockSolver`); None: nothing.
        Its ``summary()``, if any, goes into the report under the method's name."""
        return None

    def report(self, inputs: MergeInputs) -> dict[str, Any]:
        """The method's entries in the merge report: its options as resolved."""
        return dict(inputs.options.method_options.model_dump())


class Copy(MergeMethod):
    """The first model's tensor as it is, for tensors that are not floating point (integer
    buffers such as position ids): the plan's steps for them, never a user's choice."""

    name: ClassVar[str] = "copy"
    summary: ClassVar[str] = "the first model's tensor, copied (tensors not floating point)"

    def compute(self, step: Step, executor: Executor) -> None:
        name = step.tensors[0]
        first = executor.sources[0].read(name)
        executor.ready[name] = first.clone() if hasattr(first, "clone") else first


#: The method of every step that copies a tensor that is not floating point.
COPY = Copy()

_METHODS: dict[str, MergeMethod] = {}


def register_method(method: MergeMethod) -> MergeMethod:
    """Make ``method`` available by its name to every front door, the configuration files
    and ``lmdx merge``; returns it. Registering a name again replaces that method."""
    if not method.name.isidentifier():
        raise MergeError(f"register_method: name {method.name!r} is not an identifier")
    if method.name == COPY.name:
        raise MergeError(
            f"register_method: name {method.name!r} is taken by the copies of tensors that "
            "are not floating point; choose another"
        )
    if not issubclass(method.options, NoOptions):
        raise MergeError(
            f"register_method: {method.name}: options must derive from lmdx.merge.NoOptions"
        )
    if method.stats not in (None, "regmean-gram", "fisher"):
        raise MergeError(f"register_method: {method.name}: unknown statistics {method.stats!r}")
    _builtins()[method.name] = method  # the built-in methods first
    return method


def _builtins() -> dict[str, MergeMethod]:
    from . import builtin  # noqa: F401  (registers the built-in methods on first use)

    return _METHODS


def methods() -> Mapping[str, MergeMethod]:
    """Every registered method by name, built-in ones first (in registration order)."""
    return dict(_builtins())


def method_names() -> tuple[str, ...]:
    """The names of the registered methods."""
    return tuple(_builtins())


def method_named(name: str) -> MergeMethod:
    """The method registered as ``name``; :class:`MergeError` lists the known ones."""
    found = _builtins().get(name)
    if found is None:
        raise MergeError(f"method: expected one of {method_names()}, got {name!r}")
    return found


def option_users(key: str) -> list[str]:
    """The registered methods that take option ``key``."""
    return [m.name for m in _builtins().values() if key in m.options.model_fields]


def step_method(kind: str) -> MergeMethod:
    """The method that runs a plan step of ``kind``: :data:`COPY` or a registered one."""
    return COPY if kind == COPY.name else method_named(kind)


def tensor_step_kind(inputs: MergeInputs, name: str) -> str:
    """The kind of the step that merges tensor ``name`` alone: the method
    :meth:`MergeMethod.tensor_kind` names for a floating-point tensor, else :data:`COPY`."""
    if inputs.sources[0].is_float(name):
        return inputs.method.tensor_kind(inputs, name)
    return COPY.name
