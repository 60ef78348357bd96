"""The options of one merge, checked once for both front doors (in memory and streaming).

The options every method shares (coefficients, patterns, output) are :class:`MergeOptions`'s
own fields; a method's own options are its pydantic model (:attr:`lmdx.merge.method.
MergeMethod.options`), the single definition of their types, defaults, checks and help, from
which the front doors' keyword arguments, the configuration schema and the report follow
(checked by :func:`lmdx.merge.registry.method_options`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ValidationError

from .._errors import MergeError
from .._tensors import OUTPUT_DTYPES
from .._util import parse_size

__all__ = [
    "DEFAULT_SOLVE_MEMORY",
    "HEAD_POLICIES",
    "SOLVE_MEMORY_ENV",
    "MergeOptions",
    "OptionError",
    "check_output",
    "option_error",
    "solve_memory_budget",
]

_Own = TypeVar("_Own", bound=BaseModel)

HEAD_POLICIES = ("keep", "drop")
#: The environment variable giving ``solve_memory``'s default (e.g. ``8GB``).
SOLVE_MEMORY_ENV = "LMDX_SOLVE_MEMORY"
#: ``solve_memory`` without the option or the environment variable: 4 GB.
DEFAULT_SOLVE_MEMORY = 4 * 10**9


class OptionError(MergeError):
    """A merge option the method refuses: ``key``, what is wrong (``what``) and the
    ``value`` given. Its message is the front doors' (``key: what, got value``);
    :meth:`in_file` words it as a configuration file's key."""

    def __init__(self, key: str, what: str, value: Any, unused: bool = False) -> None:
        self.key, self.what, self.value, self.unused = key, what, value, unused
        if unused:
            super().__init__(f"{key}: only {what}; leave it out")
        else:
            super().__init__(f"{key}: {what[:1].lower()}{what[1:]}, got {value!r}")

    def in_file(self) -> str:
        """The message for a configuration file: ``key what, got value``."""
        if self.unused:
            return f"{self.key} is only {self.what}"
        shown = repr(self.value)
        shown = shown if len(shown) <= 60 else shown[:57] + "..."
        return f"{self.key} {self.what[:1].lower()}{self.what[1:]}, got {shown}"


def option_error(key: str, model: type[BaseModel], exc: ValidationError) -> OptionError:
    """The first problem pydantic found in option ``key`` of ``model``: the field's
    ``label`` (its ``json_schema_extra``), else pydantic's words, and the value."""
    err = exc.errors(include_url=False)[0]
    extra = model.model_fields[key].json_schema_extra if key in model.model_fields else None
    label = extra.get("label") if isinstance(extra, dict) else None
    msg = str(label) if label else str(err["msg"]).removeprefix("Value error, ")
    return OptionError(key, msg, err.get("input"))


@dataclass(frozen=True)
class MergeOptions:
    """What to merge and how; :meth:`checked` validates user input into one.

    Attributes
    ----------
    method
        The registered method's name (``"regmean"``, ``"average"``, ``"fisher"``,
        ``"task_arithmetic"``, ``"ties"``, ``"dare"``, ``"dare_ties"``,
        ``"regmean_plusplus"`` or one registered with
        :func:`lmdx.merge.register_method`).
    coefficients
        Per-model non-negative coefficients (None: all equal).
    exclude
        ``fnmatch`` patterns of module names RegMean must not solve (averaged instead).
    heads
        ``fnmatch`` patterns of parameter names that are task heads (not merged).
    head_policy
        Writing a folder: ``"keep"`` every model's head or ``"drop"`` them.
    dtype
        Writing a folder: ``"auto"`` (each tensor's input dtype) or a float dtype.
    max_shard_size
        Writing a folder: largest output shard, bytes.
    n_threads
        Threads of the native kernels (None: :func:`lmdx.default_threads`).
    solve_memory
        Memory budget of one merge step, bytes: a RegMean group over it is solved in
        blocks of output rows, a larger tensor averaged in blocks of rows (same numbers);
        on Ray, each group's task asks for the memory it needs. Default:
        ``LMDX_SOLVE_MEMORY`` or 4 GB (:func:`solve_memory_budget`).
    method_options
        The method's own options (its pydantic model); read as attributes of this object
        too (``options.alpha``), or typed by :meth:`own`.
    """

    method: str = "regmean"
    coefficients: tuple[float, ...] | None = None
    exclude: tuple[str, ...] = ()
    heads: tuple[str, ...] = ()
    head_policy: str = "keep"
    dtype: str = "auto"
    max_shard_size: int = 2 * 10**9
    n_threads: int | None = None
    solve_memory: int = DEFAULT_SOLVE_MEMORY
    method_options: BaseModel = field(default_factory=BaseModel)

    #: The keyword arguments of the front doors that are these options.
    SHARED: ClassVar[tuple[str, ...]] = (
        "coefficients",
        "exclude",
        "heads",
        "head_policy",
        "dtype",
        "max_shard_size",
        "n_threads",
        "solve_memory",
    )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "method_options":
            raise AttributeError(name)
        own = self.method_options
        if name in type(own).model_fields:
            return getattr(own, name)
        raise AttributeError(f"method {self.method!r} has no option {name!r}")

    def own(self, model: type[_Own]) -> _Own:
        """The method's own options as ``model`` (its pydantic model or a base of it), for
        a method's code to read them typed: ``inputs.options.own(SolveOptions).alpha``.
        :class:`MergeError` if they are not one."""
        if not isinstance(self.method_options, model):
            raise MergeError(
                f"method {self.method!r} takes no {model.__name__} (its options are "
                f"{type(self.method_options).__name__})"
            )
        return self.method_options

    @classmethod
    def checked(
        cls,
        k: int,
        *,
        method: str = "regmean",
        coefficients: Sequence[float] | None = None,
        exclude: Sequence[str] = (),
        heads: Sequence[str] = (),
        head_policy: str = "keep",
        dtype: str = "auto",
        max_shard_size: int | str = "2GB",
        n_threads: int | None = None,
        solve_memory: int | str | None = None,
        method_options: BaseModel | None = None,
    ) -> MergeOptions:
        """Options for merging ``k`` models; :class:`MergeError` names what is wrong.
        ``method_options``: the method's own, checked
        (:func:`lmdx.merge.registry.method_options`)."""
        shard = check_output(head_policy, dtype, max_shard_size)
        if k < 2:
            raise MergeError(f"need at least 2 models to merge, got {k}")
        return cls(
            method=method,
            coefficients=_coefficients(coefficients, k),
            exclude=tuple(exclude),
            heads=tuple(heads),
            head_policy=head_policy,
            dtype=dtype,
            max_shard_size=shard,
            n_threads=n_threads,
            solve_memory=solve_memory_budget(solve_memory),
            method_options=BaseModel() if method_options is None else method_options,
        )


def solve_memory_budget(value: int | str | None = None) -> int:
    """The ``solve_memory`` budget in bytes: ``value`` (``"8GB"`` or bytes), or else
    ``LMDX_SOLVE_MEMORY``, or else :data:`DEFAULT_SOLVE_MEMORY`."""
    key = "solve_memory"
    if value is None:
        value = os.environ.get(SOLVE_MEMORY_ENV) or DEFAULT_SOLVE_MEMORY
        key = SOLVE_MEMORY_ENV
    try:
        return parse_size(value)
    except ValueError:
        raise MergeError(f"{key}={value!r}: expected a size such as 8GB or 500MB") from None


def check_output(head_policy: str, dtype: str, max_shard_size: int | str) -> int:
    """Check the options of writing a folder; returns the shard size in bytes."""
    if head_policy not in HEAD_POLICIES:
        raise MergeError(f"head_policy: expected 'keep' or 'drop', got {head_policy!r}")
    if dtype not in OUTPUT_DTYPES:
        raise MergeError(f"dtype: expected one of {OUTPUT_DTYPES}, got {dtype!r}")
    try:
        return parse_size(max_shard_size)
    except ValueError:
        raise MergeError(
            f"max_shard_size: expected e.g. '2GB' or bytes, got {max_shard_size!r}"
        ) from None


def _coefficients(coefficients: Sequence[float] | None, k: int) -> tuple[float, ...] | None:
    if coefficients is None:
        return None
    coef = tuple(float(c) for c in coefficients)
    if len(coef) != k:
        raise MergeError(f"coefficients: {len(coef)} values for {k} models")
    if any(not math.isfinite(c) or c < 0 for c in coef) or sum(coef) <= 0:
        raise MergeError(f"coefficients: must be finite, >= 0 and not all 0, got {list(coef)}")
    return coef
