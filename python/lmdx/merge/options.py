"""The options of one merge: one pydantic model for both front doors, the configuration
files and ``lmdx merge``.

Every option every merge shares is one field of :class:`SharedOptions` (or of its sections
:class:`HeadOptions` and :class:`OutputOptions`): its type, default, check and description,
and in its ``json_schema_extra`` the words of its error (``label``), the front doors'
keyword where it is not the field's name (``keyword``), whether it is an option of
writing a folder (``writes``: :func:`lmdx.merge_models` refuses it, :func:`lmdx.save_merged`
takes it) and whether ``lmdx merge`` has a flag for it (``flag``). A configuration file is
these options plus ``method``, ``models``, ``base`` and the method's own options
(:mod:`lmdx.merge.config`); the front doors take them as flat keywords
(:meth:`MergeOptions.from_keywords`). :class:`MergeOptions` adds what a merge is told
besides: the method, the per-model coefficients and the method's own options (its
pydantic model, :attr:`lmdx.merge.method.MergeMethod.options`, checked by
:func:`lmdx.merge.registry.method_options`).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Annotated, Any, Literal, TypeVar

import numpy as np
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    SerializeAsAny,
    ValidationError,
)
from pydantic.fields import FieldInfo

from .._errors import MergeError
from .._util import parse_size
from ..files.parse import STRICT

__all__ = [
    "DEFAULT_SOLVE_MEMORY",
    "MAX_THREADS",
    "SOLVE_MEMORY_ENV",
    "HeadOptions",
    "HeadsError",
    "MergeOptions",
    "OptionError",
    "OutputOptions",
    "SharedOptions",
    "option_error",
    "plain",
    "solve_memory_budget",
]

_Own = TypeVar("_Own", bound=BaseModel)

#: The environment variable giving ``solve_memory``'s default (e.g. ``8GB``).
SOLVE_MEMORY_ENV = "LMDX_SOLVE_MEMORY"
#: ``solve_memory`` without the option or the environment variable: 4 GB.
DEFAULT_SOLVE_MEMORY = 4 * 10**9
#: Most threads a merge may ask for (far above any machine's cores).
MAX_THREADS = 4096
_SIZE = "must be a size such as '2GB' or a number of bytes"


class OptionError(MergeError):
    """A merge option refused: ``key``, what is wrong (``what``) and the ``value`` given.
    Its message is the front doors' (``key: what, got value``); :meth:`in_file` words it
    as a configuration file's key."""

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


def _extra(field: FieldInfo | None) -> dict[str, Any]:
    extra = None if field is None else field.json_schema_extra
    return extra if isinstance(extra, dict) else {}


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
    label = _extra(model.model_fields.get(key)).get("label")
    msg = str(label) if label else str(err["msg"]).removeprefix("Value error, ")
    return OptionError(key, msg, err.get("input"))


def plain(value: Any) -> Any:
    """NumPy scalars as Python numbers (the options' schemas are strict)."""
    return value.item() if isinstance(value, np.generic) else value


def _patterns(value: Any) -> Any:
    """Name patterns: one pattern, or a list or tuple of them, as a list."""
    if isinstance(value, str):
        return [value]
    return list(value) if isinstance(value, tuple) else value


def _size(value: Any) -> int:
    """A size in bytes from ``"2GB"`` or a number of bytes."""
    if isinstance(value, (str, int)) and not isinstance(value, bool):
        try:
            return parse_size(value)
        except ValueError:
            pass
    raise ValueError(_SIZE)


def solve_memory_budget(value: Any = None) -> int:
    """The ``solve_memory`` budget in bytes: ``value`` (``"8GB"`` or bytes), or else
    ``LMDX_SOLVE_MEMORY``, or else :data:`DEFAULT_SOLVE_MEMORY`."""
    if value is not None:
        return _size(value)
    env = os.environ.get(SOLVE_MEMORY_ENV)
    if not env:
        return DEFAULT_SOLVE_MEMORY
    try:
        return parse_size(env)
    except ValueError:
        raise ValueError(
            f"{SOLVE_MEMORY_ENV}={env!r} (its default) must be a size such as 8GB or 500MB"
        ) from None


def _coefficients(value: Any) -> Any:
    """Per-model coefficients as a tuple of floats: finite, >= 0, not all 0."""
    if value is None or isinstance(value, (str, bytes, Mapping)):
        return value
    try:
        coef = tuple(float(plain(c)) for c in value)
    except (TypeError, ValueError):
        return value  # refused by the type
    if any(not math.isfinite(c) or c < 0 for c in coef) or sum(coef) <= 0:
        raise ValueError("must be finite, >= 0 and not all 0")
    return coef


Patterns = Annotated[list[str], BeforeValidator(_patterns)]
Size = Annotated[int, BeforeValidator(_size)]


class _Section(BaseModel):
    model_config = ConfigDict(**STRICT, frozen=True)


class HeadOptions(_Section):
    """Task heads: not merged; each model's own kept beside the merged body, or dropped."""

    patterns: Annotated[
        Patterns,
        Field(
            description="fnmatch patterns of the parameters that are task heads (not merged)",
            json_schema_extra={"label": "must be a list of name patterns", "keyword": "heads"},
        ),
    ] = []
    policy: Annotated[
        Literal["keep", "drop"],
        Field(
            description="keep: the merged folder loads as model 0 and every model's head is "
            "kept in heads/<i>.safetensors; drop: the backbone is written without heads",
            json_schema_extra={
                "label": "must be keep or drop",
                "keyword": "head_policy",
                "writes": True,
            },
        ),
    ] = "keep"
    per_task_folders: Annotated[
        bool,
        Field(
            description="also write one model folder per kept head, DIR/tasks/<i>",
            json_schema_extra={
                "label": "must be true or false",
                "keyword": "task_folders",
                "writes": True,
                "flag": True,
            },
        ),
    ] = False


class OutputOptions(_Section):
    """The merged folder's tensors, and the LoRA of the merged update."""

    dtype: Annotated[
        Literal["auto", "float32", "bfloat16", "float16"],
        Field(
            description="the merged tensors' dtype: auto (each tensor's input dtype) or a "
            "float dtype",
            json_schema_extra={"label": "must be auto/float32/bfloat16/float16", "writes": True},
        ),
    ] = "auto"
    max_shard_size: Annotated[
        Size,
        Field(
            description="largest output shard (e.g. 2GB)",
            json_schema_extra={"writes": True},
        ),
    ] = 2 * 10**9
    lora_rank: Annotated[
        int | None,
        Field(
            ge=1,
            le=2**20,
            description="also a rank-r LoRA of the merged update, lora/ (every model a LoRA "
            "adapter over base)",
            json_schema_extra={"label": "must be a whole number >= 1"},
        ),
    ] = None


class SharedOptions(_Section):
    """The options every merge shares: the keys of a configuration file besides
    ``method``, ``models``, ``base`` and the method's own."""

    exclude: Annotated[
        Patterns,
        Field(
            description="fnmatch patterns of modules not solved (averaged instead)",
            json_schema_extra={"label": "must be a list of name patterns"},
        ),
    ] = []
    heads: HeadOptions = HeadOptions()
    output: OutputOptions = OutputOptions()
    threads: Annotated[
        int | None,
        Field(
            ge=1,
            le=MAX_THREADS,
            description="threads of the native kernels (default: lmdx.default_threads())",
            json_schema_extra={
                "label": f"must be a whole number of threads in [1, {MAX_THREADS}]",
                "keyword": "n_threads",
            },
        ),
    ] = None
    solve_memory: Annotated[int, BeforeValidator(solve_memory_budget)] = Field(
        None,  # its default comes from the environment, read when the options are made
        validate_default=True,
        description="memory budget of one merge step, e.g. 8GB (default "
        f"{SOLVE_MEMORY_ENV} or 4GB): larger RegMean groups are solved, larger tensors "
        "averaged, in blocks of rows (the core keeps up to 1 GiB of matrices between "
        "layers on top)",
        json_schema_extra={"flag": True, "metavar": "SIZE"},
    )
    accept_flagged: Annotated[
        bool,
        Field(
            description="merge although the cost check flags a contributor's statistics "
            "(scaled or forged Grams?), as the record and card then say; else refused",
            json_schema_extra={"label": "must be true or false", "flag": True},
        ),
    ] = False

    @classmethod
    def fields(cls) -> dict[tuple[str, ...], FieldInfo]:
        """Every option's field by its path (``("heads", "policy")``), sections entered."""
        out: dict[tuple[str, ...], FieldInfo] = {}
        for name, f in cls.model_fields.items():
            section = f.annotation
            if isinstance(section, type) and issubclass(section, _Section):
                for sub, g in section.model_fields.items():
                    out[(name, sub)] = g
            else:
                out[(name,)] = f
        return out

    @classmethod
    def keyword_paths(cls) -> dict[str, tuple[str, ...]]:
        """Front-door keyword -> the path of the field it sets."""
        return {_extra(f).get("keyword", path[-1]): path for path, f in cls.fields().items()}

    @classmethod
    def labels(cls) -> dict[str, str]:
        """The words of each option's error, by its dotted path (for a file's messages)."""
        out = {}
        for path, f in cls.fields().items():
            label = _extra(f).get("label")
            if label:
                out[".".join(path)] = str(label)
        return out

    @classmethod
    def from_keywords(
        cls, given: Mapping[str, Any], fixed: Mapping[str, Any] | None = None, *, writes: bool
    ) -> Any:
        """The options from a front door's keyword arguments (each a keyword of
        :meth:`keyword_paths`; None: the default) and ``fixed`` fields; the options of
        writing a folder only where the door writes one (``writes``). Errors name the
        keyword: :class:`OptionError`."""
        paths = cls.keyword_paths()
        fields = cls.fields()
        tree: dict[str, Any] = dict(fixed or {})
        for key, value in given.items():
            if value is None:
                continue
            path = paths[key]
            if not writes and _extra(fields[path]).get("writes"):
                what = "for writing a folder (stream_merge, save_merged, lmdx merge)"
                raise OptionError(key, what, value, unused=True)
            section = tree
            for part in path[:-1]:
                section = section.setdefault(part, {})
            section[path[-1]] = plain(value)
        try:
            return cls.model_validate(tree)
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            loc = tuple(p for p in err["loc"] if isinstance(p, str))
            where = {path: key for key, path in paths.items()}
            key = where.get(loc, ".".join(loc) or "options")
            label = _extra(fields.get(loc)).get("label")
            msg = str(label) if label else str(err["msg"]).removeprefix("Value error, ")
            if err.get("input") is None:  # a default (from the environment) refused
                raise MergeError(f"{key}: {msg}") from None
            raise OptionError(key, msg, err.get("input")) from None

    @classmethod
    def flags(cls) -> list[tuple[str, str, FieldInfo]]:
        """The options ``lmdx merge`` has a flag for (``json_schema_extra={"flag": True}``):
        (the field's dotted path, its keyword, its field)."""
        return [
            (".".join(path), key, cls.fields()[path])
            for key, path in cls.keyword_paths().items()
            if _extra(cls.fields()[path]).get("flag")
        ]

    @classmethod
    def writing_keywords(cls) -> list[str]:
        """The keywords of the options of writing a folder (``head_policy``, ``dtype``,
        ``max_shard_size``, ``task_folders``: the fields marked ``writes``)."""
        fields, paths = cls.fields(), cls.keyword_paths()
        return sorted(k for k, p in paths.items() if _extra(fields[p]).get("writes"))

    @classmethod
    def for_writing(cls, given: Mapping[str, Any]) -> SharedOptions:
        """The options of writing a folder (:meth:`writing_keywords`) from keyword
        arguments, checked; any other keyword is refused."""
        allowed = cls.writing_keywords()
        for key in given:
            if key not in allowed:
                raise MergeError(
                    f"unknown option {key!r}; the options of writing a folder are {allowed}"
                )
        out: SharedOptions = cls.from_keywords(given, writes=True)
        return out

    def keywords(self) -> dict[str, Any]:
        """These options as the front doors' keyword arguments (:meth:`from_keywords`)."""
        out = {}
        for key, path in self.keyword_paths().items():
            value: Any = self
            for part in path:
                value = getattr(value, part)
            out[key] = value
        return out


class MergeOptions(SharedOptions):
    """What one merge is told: the method's name, the options every merge shares
    (:class:`SharedOptions`: ``exclude``, ``heads``, ``output``, ``threads``,
    ``solve_memory``), the per-model ``coefficients`` (None: all equal) and the method's
    own options (``method_options``: its pydantic model; typed by :meth:`own`)."""

    method: Annotated[str, Field(min_length=1, description="the merge method's name")]
    coefficients: Annotated[
        tuple[float, ...] | None,
        BeforeValidator(_coefficients),
        Field(
            description="per-model non-negative coefficients (default: all equal)",
            json_schema_extra={"label": "must be finite, >= 0 and not all 0"},
        ),
    ] = None
    method_options: SerializeAsAny[BaseModel] = Field(default_factory=BaseModel)

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
    def for_models(cls, k: int, checked: MergeOptions) -> MergeOptions:
        """``checked`` for a merge of ``k`` models: at least 2, one coefficient each."""
        if k < 2:
            raise MergeError(f"need at least 2 models to merge, got {k}")
        if checked.coefficients is not None and len(checked.coefficients) != k:
            raise MergeError(f"coefficients: {len(checked.coefficients)} values for {k} models")
        return checked

    def keywords(self) -> dict[str, Any]:
        """These options as the front doors' keyword arguments, the method's own included
        (the method itself is not one)."""
        return {**super().keywords(), **self.method_options.model_dump()}

    @classmethod
    def keyword_paths(cls) -> dict[str, tuple[str, ...]]:
        paths = super().keyword_paths()
        return {k: v for k, v in paths.items() if v not in (("method",), ("method_options",))}
