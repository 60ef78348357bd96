"""The options of one merge, checked once for both front doors (in memory and streaming).

The options every method shares (coefficients, patterns, output) are :class:`MergeOptions`'s
own fields; a method's own options are its pydantic model (:attr:`lmdx.merge.registry.
MergeMethod.options`), the single definition of their types, defaults, checks and help, from
which the front doors' keyword arguments, the configuration schema and the report follow.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
from pydantic import BaseModel, ValidationError

from .._errors import MergeError
from .._tensors import OUTPUT_DTYPES
from .._util import parse_size
from .registry import NoOptions, method_named, method_names, methods, option_users

__all__ = [
    "DEFAULT_SOLVE_MEMORY",
    "HEAD_POLICIES",
    "PRECISIONS",
    "SOLVE_MEMORY_ENV",
    "HeadsError",
    "MergeOptions",
    "OptionError",
    "all_options",
    "check_output",
    "method_options",
    "option_error",
    "solve_memory_budget",
    "unused_option",
]

_Own = TypeVar("_Own", bound=BaseModel)

HEAD_POLICIES = ("keep", "drop")
PRECISIONS = ("auto", "float32", "float64")
#: The environment variable giving ``solve_memory``'s default (e.g. ``8GB``).
SOLVE_MEMORY_ENV = "LMDX_SOLVE_MEMORY"
#: ``solve_memory`` without the option or the environment variable: 4 GB.
DEFAULT_SOLVE_MEMORY = 4 * 10**9


def __getattr__(name: str) -> Any:
    """``METHODS`` (every registered method's name) and ``TASK_VECTOR_METHODS`` (those
    that take task vectors against a base), read from the registry when asked for."""
    if name == "METHODS":
        return method_names()
    if name == "TASK_VECTOR_METHODS":
        return tuple(m.name for m in methods().values() if m.needs_base)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


class HeadsError(MergeError):
    """Models whose tensor ``name`` differs in shape (``detail`` says how). The message
    ends with how to exclude differing task heads, spelled for the keyword arguments
    (``heads=['classifier.*']``); :meth:`in_file` spells it for a configuration file."""

    def __init__(self, name: str, detail: str) -> None:
        self.detail = detail
        self.pattern = f"{name.rsplit('.', 1)[0]}.*" if "." in name else name
        super().__init__(self._worded(f"heads=[{self.pattern!r}]"))

    def _worded(self, spelling: str) -> str:
        return (
            f"{self.detail}; models must be fine-tuned from one checkpoint (exclude "
            f"differing task heads with {spelling})"
        )

    def in_file(self) -> str:
        """The message for a configuration file (``heads: {patterns: [...]}``)."""
        return self._worded(f"heads: {{patterns: [{self.pattern!r}]}}")


def option_error(key: str, model: type[BaseModel], exc: ValidationError) -> OptionError:
    """The first problem pydantic found in option ``key`` of ``model``: the field's
    ``label`` (its ``json_schema_extra``), else pydantic's words, and the value."""
    err = exc.errors(include_url=False)[0]
    extra = model.model_fields[key].json_schema_extra if key in model.model_fields else None
    label = extra.get("label") if isinstance(extra, dict) else None
    msg = str(label) if label else str(err["msg"]).removeprefix("Value error, ")
    return OptionError(key, msg, err.get("input"))


def unused_option(key: str, method: str) -> OptionError:
    """Option ``key`` given to a method that does not take it."""
    users = option_users(key)
    who = f"method {users[0]}" if len(users) == 1 else ", ".join(users)
    return OptionError(key, f"used by {who}, not {method}", None, unused=True)


def _ignored_elsewhere(key: str) -> bool:
    """Whether option ``key`` is accepted, and ignored, by methods that do not take it
    (``json_schema_extra={"elsewhere": "ignored"}``, as the RegMean solve's options)."""
    for m in methods().values():
        f = m.options.model_fields.get(key)
        extra = None if f is None else f.json_schema_extra
        if isinstance(extra, dict) and extra.get("elsewhere") == "ignored":
            return True
    return False


def _plain(value: Any) -> Any:
    """NumPy scalars as Python numbers (the options' schema is strict)."""
    return value.item() if isinstance(value, np.generic) else value


def _check_one(model: type[BaseModel], key: str, value: Any) -> None:
    """Option ``key`` of ``model`` checked alone (its error names it)."""
    try:
        model.model_validate({key: value})
    except ValidationError as exc:
        raise option_error(key, model, exc) from None


def method_options(method: str, given: Mapping[str, Any]) -> BaseModel:
    """``method``'s options from the ``given`` keys (None: the default), checked by its
    pydantic model; keys other methods take are refused (or, for the solver's, ignored)."""
    model = method_named(method).options
    own: dict[str, Any] = {}
    for key, value in given.items():
        if value is None:
            continue
        if key in model.model_fields:
            own[key] = _plain(value)
        elif not option_users(key):
            raise MergeError(f"unknown option {key!r}; the options are {sorted(all_options())}")
        else:  # a valid value of another method's option: refused, or ignored here
            _check_one(method_named(option_users(key)[0]).options, key, _plain(value))
            if not _ignored_elsewhere(key):
                raise unused_option(key, method)
    for key, value in own.items():
        _check_one(model, key, value)
    try:
        return model.model_validate(own)
    except ValidationError as exc:  # a check across fields
        raise MergeError(f"method {method}: {option_error('', model, exc)}") from None


def all_options() -> dict[str, Any]:
    """Every method option of the registered methods: name -> its pydantic field (the first
    method's that declares it)."""
    out: dict[str, Any] = {}
    for m in methods().values():
        for key, f in m.options.model_fields.items():
            out.setdefault(key, f)
    return out


@dataclass(frozen=True)
class MergeOptions:
    """What to merge and how; :meth:`checked` validates user input into one.

    Attributes
    ----------
    method
        The registered method's name (``"regmean"``, ``"average"``, ``"fisher"``,
        ``"task_arithmetic"``, ``"ties"``, ``"dare"``, ``"dare_ties"``,
        ``"regmean_plusplus"`` or one registered with
        :func:`lmdx.merge.registry.register_method`).
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
    method_options: BaseModel = field(default_factory=NoOptions)

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
        **options: Any,
    ) -> MergeOptions:
        """Options for merging ``k`` models; :class:`MergeError` names what is wrong.

        ``options`` are the method's own (None: the default); those of other methods are
        refused."""
        own = method_options(method, options)
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
            method_options=own,
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
