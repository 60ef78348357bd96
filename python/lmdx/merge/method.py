"""What a merge method is and what it is handed: the ground floor of :mod:`lmdx.merge`.

A method is a subclass of :class:`MergeMethod`, registered with
:func:`lmdx.merge.register_method` (or installed as a package: the entry-point group
``lmdx.merge_methods``, :mod:`lmdx.merge.registry`); the built-in ones
(:mod:`lmdx.merge.builtin`) are written exactly so. The smallest method merges one tensor
at a time::

    class KeepFirst(MergeMethod):
        name = "keep_first"
        summary = "the first model's tensors"

        def tensor(self, name, tensors, inputs):
            return np.asarray(tensors[0], dtype=np.float64)

    register_method(KeepFirst())

What a method declares (class attributes): ``name``; ``summary`` (its line in the model card
and ``lmdx methods``); ``options``, a pydantic model of the method's own options (types,
defaults, checks; each field's description is its help text, and a field's
``json_schema_extra={"label": ...}`` the words of its error message); ``stats``, the kind
of statistics it needs one of per model (``"regmean-gram"``, ``"fisher"`` or None);
``needs_base`` (the pre-trained model, for task vectors), ``takes_data`` (each model's
texts at merge time) and ``ray`` (whether its group steps may run on Ray workers); and,
by :meth:`~MergeMethod.surrogates`, whether its options let models without statistics
use surrogate ones.

What it does (methods, all with defaults), in the order a merge asks:
:meth:`~MergeMethod.check` (the inputs, before any work), :meth:`~MergeMethod.order` (of
the outputs), :meth:`~MergeMethod.group_steps` (steps over several tensors),
:meth:`~MergeMethod.tensor_method` (the method of every other tensor),
:meth:`~MergeMethod.memory` (a step's memory estimate), :meth:`~MergeMethod.plan_notes`,
:meth:`~MergeMethod.report` (its entries in ``lmdx_merge.json``),
:meth:`~MergeMethod.start`, then per step :meth:`~MergeMethod.compute` (its tensors and
report entries: :class:`Merged`; by default one tensor by :meth:`~MergeMethod.tensor`, the
arithmetic) and :meth:`~MergeMethod.after_step`, and :meth:`~MergeMethod.finish`. A method
never touches the engine: whatever it computes comes back in a :class:`Merged`.

The plan's steps carry the method that runs them (:class:`Step`): a registered one, or
:data:`COPY` for a tensor that is not floating point (an integer buffer), which no user
chooses and which is no registered method.

This module imports nothing else of :mod:`lmdx.merge` at run time; every other module of
it stands on this one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, ConfigDict

from .._errors import MergeError
from .._tensors import as_numpy, cast_float, is_tensor
from ..files.parse import STRICT

if TYPE_CHECKING:
    from ..stats.file import Statistics
    from .lora import LoraExport
    from .options import MergeOptions
    from .source import TensorSource

__all__ = [
    "COPY",
    "MergeInputs",
    "MergeMethod",
    "Merged",
    "NoOptions",
    "PostStep",
    "Step",
    "StepSizes",
    "add_entries",
    "cast_merged",
    "checked_finite",
    "checked_input",
    "on_tensor",
    "rounds_merged",
    "tensor_step",
    "uncast",
]


class NoOptions(BaseModel):
    """The options of a method that has none of its own (the base of every method's
    options: unknown keys and ``true`` for 1 are refused, values must be finite)."""

    model_config = ConfigDict(**STRICT, frozen=True)


@dataclass
class MergeInputs:
    """Everything a merge reads, checked (:func:`lmdx.merge.inputs.open_inputs`): the
    method and its options, the models as tensor sources with their names, the statistics
    (one per model, for methods that need them), the base (methods that merge task
    vectors), the data (methods that take data), the LoRA of the merged update being built
    (``lora_rank``), ``state``: what the method keeps for its merge (set by its own
    :meth:`~MergeMethod.check`, :meth:`~MergeMethod.group_steps` and
    :meth:`~MergeMethod.start`; no other code reads it) and the registered ``methods``."""

    method: MergeMethod
    options: MergeOptions
    sources: list[TensorSource]
    labels: list[str]
    stats: list[Statistics] | None = None
    base: TensorSource | None = None
    data: Sequence[Any] | None = None
    tokenizer: Any = None
    lora: LoraExport | None = None
    state: dict[str, Any] = field(default_factory=dict)
    #: the registered methods by name, for a method whose options name another (RegMean's
    #: prior its anchor)
    methods: Mapping[str, MergeMethod] = field(default_factory=dict)


@dataclass
class Step:
    """One unit of work of a plan, run by ``method``: a RegMean input group, one tensor,
    a block (RegMean++), ..."""

    method: MergeMethod
    tensors: list[str]  # input tensor names (a group: its members' weights; a block: all)
    modules: list[str] = field(default_factory=list)
    layout: str = "linear"
    dim: int = 0
    memory: int = 0  # estimated bytes while the step runs
    block: int | None = None  # a method merging blocks in order: the block's index

    @property
    def kind(self) -> str:
        """The name of the method that runs the step."""
        return self.method.name


@dataclass(frozen=True)
class StepSizes:
    """What a step's memory estimate is made of: K models, the step's ``n`` elements,
    ``read`` bytes per model (+ ``widened``: float32 copies of 16-bit weights), ``out``
    bytes of its cast result, and whether Grams are ``packed`` (read from files)."""

    ref: TensorSource
    k: int
    out_size: int  # bytes per output element (0: the input's dtype)
    packed: bool
    n: int
    read: int
    widened: int
    out: int

    @classmethod
    def of_step(
        cls, step: Step, ref: TensorSource, k: int, out_size: int, packed: bool
    ) -> StepSizes:
        n = sum(int(np.prod(ref.shape(t))) for t in step.tensors)
        read = sum(ref.nbytes(t) for t in step.tensors)
        half = any(ref.dtype(t) in ("bfloat16", "float16") for t in step.tensors)
        out = n * out_size if out_size else read
        return cls(ref, k, out_size, packed, n, read, 4 * n if half else 0, out)

    def of(self, step: Step, *, packed: bool) -> StepSizes:
        """The sizes of another ``step`` of the same merge."""
        return StepSizes.of_step(step, self.ref, self.k, self.out_size, packed)


def add_entries(report: dict[str, Any], entries: Mapping[str, Any]) -> None:
    """Report ``entries`` added into ``report``: a dict value updates the report's dict of
    that key, a list extends its list, anything else is set."""
    for key, value in entries.items():
        if isinstance(value, dict):
            report.setdefault(key, {}).update(value)
        elif isinstance(value, list):
            report.setdefault(key, []).extend(value)
        else:
            report[key] = value


@dataclass
class Merged:
    """What a step produced: its merged tensors (NumPy, or a copied tensor as its source
    holds it, in the input dtype: :func:`cast_merged`) and its entries in the merge report
    (:func:`add_entries`: e.g. ``{"layers": {module: solver info}}``); ``grams``: by
    module, the K input Grams the step read (as stored, already checked), which what each
    task pays then measures on without reading them again (:mod:`lmdx.merge.cost`)."""

    tensors: dict[str, Any]
    report: dict[str, Any] = field(default_factory=dict)
    grams: dict[str, Sequence[Any]] = field(default_factory=dict)

    def update(self, other: Merged) -> None:
        """``other``'s tensors and report entries added to these."""
        self.tensors.update(other.tensors)
        add_entries(self.report, other.report)
        self.grams.update(other.grams)


def _finite(arr: Any) -> bool:
    if is_tensor(arr) and not arr.is_floating_point():
        return True
    # NumPy's isfinite, also for torch tensors (viewed, not copied): 2-13x torch's
    # isfinite().all() on a 23M-entry embedding (float32 5 ms against 68 ms, 2 cores)
    arr = as_numpy(arr) if is_tensor(arr) else np.asarray(arr)
    if arr.dtype.kind in "biu":  # integers and booleans are finite
        return True
    return bool(np.isfinite(arr).all())  # (bfloat16, kind "V", included)


def checked_input(name: str, label: str, arr: Any) -> Any:
    """Model ``label``'s tensor ``name`` unchanged, or :class:`MergeError` naming both if
    any value is NaN or Inf: methods that rank, factor or normalise the values would
    otherwise fail deep inside (an SVD that does not converge, a cosine, a step that never
    converges) or lose it."""
    if not _finite(arr):
        raise MergeError(
            f"tensor {name!r} of {label} holds NaN or Inf; lmdx merges finite weights: fix or "
            "replace that model"
        )
    return arr


def checked_finite(name: str, arr: Any, dtype: str | None = None) -> Any:
    """``arr`` (a NumPy array or torch tensor) unchanged, or :class:`MergeError` naming
    tensor ``name`` if any value is not finite (``dtype``: the dtype it was cast to)."""
    if not _finite(arr):
        cast = f" in {dtype}" if dtype else ""
        raise MergeError(
            f"merged tensor {name!r} is not finite{cast}: its values exceed the type's range "
            "(a scaling option too large? a wider output dtype, output.dtype: float32?) or "
            "the statistics hold NaN/Inf (the models' tensors are checked as they are read)"
        )
    return arr


#: Set while a post-step runs its method (:func:`uncast`): the merged values stay float64.
_UNCAST: ContextVar[bool] = ContextVar("lmdx_merge_uncast", default=False)


@contextlib.contextmanager
def uncast() -> Iterator[None]:
    """Within the block, :func:`cast_merged` keeps the merged values in float64 (checked
    finite): a post-step (SVC) works on what the method computed and casts once, after
    it, instead of on values already rounded to a 16-bit input dtype."""
    token = _UNCAST.set(True)
    try:
        yield
    finally:
        _UNCAST.reset(token)


def rounds_merged() -> bool:
    """Whether :func:`cast_merged` rounds to the input dtype here (not within
    :func:`uncast`): a method that computes a result in its input dtype directly may do
    so only then."""
    return not _UNCAST.get()


def cast_merged(name: str, value: Any, dtype: str) -> NDArray[Any]:
    """A merged tensor (float64 NumPy, or any float array or torch tensor) as a NumPy
    array of ``dtype``, rounded as torch rounds, checked finite after the cast (a value
    finite in float64 may overflow a narrower type): the one cast every front door
    applies (within :func:`uncast`, float64 and not rounded)."""
    out = cast_float(as_numpy(value), "float64" if _UNCAST.get() else dtype)
    checked_finite(name, out, dtype)
    return out


def on_tensor(name: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> NDArray[Any]:
    """``fn(*args, **kwargs)`` (a native kernel) as a NumPy array; the kernel's input
    errors (:class:`ValueError`) become a :class:`MergeError` naming tensor ``name``."""
    try:
        return np.asarray(fn(*args, **kwargs))
    except ValueError as exc:
        raise MergeError(f"tensor {name!r}: {exc}") from None


class MergeMethod:
    """One merge method; subclass, set the class attributes, override what differs, and
    register an instance (:func:`lmdx.merge.register_method`)."""

    name: ClassVar[str] = ""
    summary: ClassVar[str] = ""
    options: ClassVar[type[BaseModel]] = NoOptions
    stats: ClassVar[str | None] = None
    needs_base: ClassVar[bool] = False
    takes_data: ClassVar[bool] = False
    #: Where its group steps run with ``ray_workers``: ``"groups"`` (each step's
    #: :meth:`compute` on a Ray worker that opens the checkpoints and statistics itself),
    #: ``"local"`` (in this process) or ``"refused"`` (the merge must run in one process).
    ray: ClassVar[str] = "local"
    #: The options ``lmdx merge`` names in its one-line summary (e.g. TIES's density).
    headline: ClassVar[tuple[str, ...]] = ()
    #: Whether the method shows its own progress (then the engine's bar is off).
    shows_progress: ClassVar[bool] = False

    def surrogates(self, own: BaseModel) -> bool:
        """Whether, with its own options ``own``, models without statistics get surrogate
        ones from their task vectors against the base (:mod:`lmdx.merge.surrogate`;
        default: never, every model needs its own)."""
        return False

    def uses_base(self, own: BaseModel) -> bool:
        """Whether, with its own options ``own``, the method reads the base (default:
        ``needs_base``; RegMean's surrogates and prior read it)."""
        return self.needs_base

    def check(self, inputs: MergeInputs) -> None:
        """Refuse inputs this method cannot merge, before any work (:class:`MergeError`);
        the checks every method shares (statistics, base, data) are done already."""

    def order(self, inputs: MergeInputs, names: list[str]) -> list[str]:
        """The order the merged tensors are produced in (default: the models')."""
        return names

    def group_steps(self, inputs: MergeInputs, body: Sequence[str], tied: set[str]) -> list[Step]:
        """Steps that merge several tensors of ``body`` together (RegMean groups, blocks;
        ``tied``: the names of tied weights); the other tensors get one step each
        (:func:`tensor_step`)."""
        return []

    def tensor_method(self, inputs: MergeInputs, name: str) -> MergeMethod:
        """The method that merges floating-point tensor ``name`` when no group step covers
        it: this one (default) or another (RegMean averages what it does not solve)."""
        return self

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

    def merge_tensor(self, name: str, inputs: MergeInputs) -> NDArray[Any]:
        """Merged tensor ``name`` by :meth:`tensor` (or :meth:`tensor_in_blocks`), offered
        to the LoRA of the merged update (in float64) and cast to its input dtype."""
        if inputs.lora is None:  # large ones in blocks of rows
            blocked = self.tensor_in_blocks(name, inputs.sources, inputs)
            if blocked is not None:
                return blocked
        reads = [checked_input(name, s.label, s.read(name)) for s in inputs.sources]
        value = self.tensor(name, reads, inputs)
        if inputs.lora is not None:
            inputs.lora.observe(name, value)
        return cast_merged(name, value, inputs.sources[0].dtype(name))

    def compute(self, step: Step, inputs: MergeInputs) -> Merged:
        """Run ``step``: its merged tensors and report entries (default: one tensor by
        :meth:`merge_tensor`)."""
        name = step.tensors[0]
        return Merged({name: self.merge_tensor(name, inputs)})

    def memory(self, step: Step, sizes: StepSizes, inputs: MergeInputs) -> int:
        """Estimated bytes while ``step`` runs: K reads (and widened copies of 16-bit
        weights), the float64 result and the cast result."""
        return sizes.k * (sizes.read + sizes.widened) + 8 * sizes.n + sizes.out

    def plan_notes(self, inputs: MergeInputs, steps: Sequence[Step]) -> list[str]:
        """Lines the plan says about the inputs (``lmdx merge --dry-run``): for a method
        with statistics, the tensors they do not cover, merged by another method."""
        others: dict[str, int] = {}
        for s in steps:
            if s.method is not self and s.method is not COPY:
                others[s.method.name] = others.get(s.method.name, 0) + len(s.tensors)
        if self.stats is None or not others:
            return []
        by = ", ".join(f"{n} by {name}" for name, n in others.items())
        return [
            f"tensors the statistics do not cover (biases, norms, embeddings, what was "
            f"excluded) merged {by}; a tensor equal in every model, such as a frozen layer, "
            "comes back as it is and needs no statistics"
        ]

    def step_label(self, step: Step) -> str:
        """How the plan names ``step`` (``lmdx merge --dry-run``'s largest steps)."""
        if not step.modules:
            return step.tensors[0]
        more = f" (+{len(step.modules) - 1} sharing its input)" if len(step.modules) > 1 else ""
        return step.modules[0] + more

    def report(self, inputs: MergeInputs) -> dict[str, Any]:
        """The method's entries in the merge report as it starts: its options as
        resolved."""
        return dict(inputs.options.method_options.model_dump())

    def start(self, inputs: MergeInputs, progress: bool) -> None:
        """Called once the plan is made, before the first step (RegMean++ tokenizes its
        data and builds its block merger); ``progress``: whether to show progress."""

    def after_step(self, step: Step, merged: Merged, inputs: MergeInputs) -> None:
        """Called with every step's result, in the order they run (RegMean++ hands the
        tensors outside its blocks to its block merger)."""

    def finish(self, inputs: MergeInputs) -> dict[str, Any]:
        """Report entries after the last step (RegMean++: what its block merger ran)."""
        return {}


class Copy(MergeMethod):
    """The first model's tensor as it is, for tensors that are not floating point (integer
    buffers such as position ids): the plan's steps for them, never a user's choice."""

    name: ClassVar[str] = "copy"
    summary: ClassVar[str] = "the first model's tensor, copied (tensors not floating point)"

    def compute(self, step: Step, inputs: MergeInputs) -> Merged:
        name = step.tensors[0]
        first = inputs.sources[0].read(name)
        return Merged({name: first.clone() if hasattr(first, "clone") else first})


#: The method of every step that copies a tensor that is not floating point.
COPY = Copy()


@dataclass(frozen=True)
class PostStep:
    """A step any method's merged model can go through, named after the method:
    ``method: <name>+<post-step>`` (SVC: ``ties+svc``). ``summary`` is its line in
    ``lmdx methods``, ``options`` its pydantic model (joined to the method's), and
    ``wrap(method)`` makes the method followed by it (a :class:`MergeMethod` named so)."""

    name: str
    summary: str
    options: type[NoOptions]
    wrap: Callable[[MergeMethod], MergeMethod]


def tensor_step(inputs: MergeInputs, name: str) -> Step:
    """The step that merges tensor ``name`` alone: by the method that
    :meth:`MergeMethod.tensor_method` names for a floating-point tensor, else by
    :data:`COPY`."""
    if inputs.sources[0].is_float(name):
        return Step(inputs.method.tensor_method(inputs, name), [name])
    return Step(COPY, [name])
