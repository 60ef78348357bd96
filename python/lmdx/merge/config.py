"""Merge configuration files (YAML or JSON) for ``lmdx merge CONFIG --out DIR``.

Example::

    method: regmean     # regmean | average | fisher | ties | tsv_m | wudi | ... (all: below)
    models:
      - path: finetuned/bbc    # a save_pretrained (or sentence-transformers) folder,
                               # relative to this file
        stats: stats/bbc.safetensors     # regmean: Gram statistics; fisher: Fisher
                               # (or a list: parts collected over disjoint modules)
        coefficient: 1.0       # optional per-model coefficient
      - path: finetuned/reuters
        stats: stats/reuters.safetensors
    alpha: 0.9                 # regmean: off-diagonal scaling
    exclude: []                # regmean: module patterns averaged instead of solved
    heads:
      patterns: ["classifier.*"]
      policy: keep             # keep each model's head (heads/<i>.safetensors) | drop
      per_task_folders: false  # also tasks/<i>/: a complete model folder per head
    output:
      dtype: auto              # auto | float32 | bfloat16 | float16
      max_shard_size: 2GB

The task-vector methods (``task_arithmetic``, ``ties``, ``dare``, ``dare_ties``) need
``base`` (the pre-trained model folder) and take no statistics::

    method: ties               # TIES-Merging: trim, elect sign, mean of the agreeing
    base: pretrained/bert      # task vectors are θ_i − θ_base
    models: [finetuned/bbc, finetuned/reuters]
    density: 0.2               # ties, dare, dare_ties: fraction of each task vector kept
    scaling: 1.0               # λ: θ_base + λ × (merged task vector)
    heads: {patterns: ["classifier.*"], policy: keep}

``density`` (default 0.2 for ``ties``, 0.5 for ``dare`` and ``dare_ties``) and ``seed``
(``dare``, ``dare_ties``: the seed of the random drops, default 0) go with the methods
that use them, ``scaling`` (default 0.3 for ``task_arithmetic`` and ``dare``, 1.0 for
``ties`` and ``dare_ties``) with the task-vector methods. ``fisher_eps`` is for
``fisher``; ``ridge``, ``allow_regularization``, ``precision`` (``auto`` | ``float32`` |
``float64``) and ``threads`` tune the RegMean solves; ``solve_memory`` (e.g. ``8GB``,
default ``LMDX_SOLVE_MEMORY`` or 4 GB) bounds one step's memory: a larger RegMean group is
solved, and a larger tensor averaged, in blocks of rows (the same numbers).

LoRA adapters: ``models: [{adapter: lora/bbc, stats: ...}, ...]`` (PEFT adapter folders)
with ``base:`` the model folder they adapt (statistics collected on base + adapter:
``lmdx stats ADAPTER DATA --base BASE``); ``output.lora_rank: r`` also writes a rank-r
LoRA of the merged update to ``lora/``.

``regmean_plusplus`` (RegMean++: the blocks merged in order, each on Grams taken
through the merged blocks before it) takes each model's data instead of statistics,
read as ``lmdx stats`` reads DATA::

    method: regmean_plusplus
    models:
      - {path: finetuned/bbc, data: bbc-train.jsonl}       # .txt, .jsonl, .csv, corpus:NAME
      - {path: finetuned/news, data: news.csv, text_field: headline, max_length: 128}
    alpha: 0.9
    max_texts: 1000            # per model (default: all); then as lmdx stats:
    max_length: 64             # tokens per text (default 128); a model's own beside its data
    batch_size: 16             # texts per forward pass (default 16)
    max_activation_memory: 8GB # beyond it, activations are recomputed (default: held)

The keys besides ``method``, ``models``, ``base`` and the method's own options are the
options every merge shares (``heads``, ``output``, ``exclude``, ``threads``,
``solve_memory``), the ones the Python front doors take as keywords; ``lmdx merge
--solve-memory`` and ``--per-task-folders`` replace the file's.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Annotated, Any, ParamSpec, TypeVar

from pydantic import BaseModel, BeforeValidator, Field, ValidationError, create_model

from .._errors import DataError, MergeError, MissingFileError
from .._util import did_you_mean
from ..data import corpora
from ..data.files import read_data
from ..files.parse import STRICT, parse_json, read_text, read_yaml, schema_message
from ..files.peft import is_adapter_folder
from .api import merge_cost, merge_in_memory, stream_merge
from .block_data import MODEL_DATA_OPTIONS
from .inputs import check_needs
from .options import (
    HeadOptions,
    HeadsError,
    MergeOptions,
    OptionError,
    OutputOptions,
    SharedOptions,
)
from .plan import MergePlan
from .registry import (
    all_options,
    method_named,
    method_names,
    method_options,
    methods,
    post_steps,
    unloaded_methods,
)

__all__ = [
    "MergeConfig",
    "ModelEntry",
    "cost_merge",
    "load_merge_config",
    "plan_merge",
    "run_merge",
]


@dataclass
class ModelEntry:
    path: str  # the model folder, or the adapter folder for an adapter
    stats: str | list[str] | None = None  # a file or folder, or parts to join
    coefficient: float | None = None
    name: str | None = None
    data: str | None = None  # regmean_plusplus: a text file or corpus:NAME
    text_field: str = "text"
    max_texts: int | None = None  # regmean_plusplus: this model's own (default: the config's)
    max_length: int | None = None  # regmean_plusplus: this model's own (default: the config's)
    adapter: bool = False  # path is a PEFT LoRA adapter folder over the config's base


@dataclass
class MergeConfig:
    """A validated merge configuration with paths resolved: the models, the base and the
    merge's options (:class:`lmdx.merge.options.MergeOptions`: the method, the options
    every merge shares, the models' coefficients and the method's own options)."""

    models: list[ModelEntry]
    options: MergeOptions
    base: str | None = None

    @property
    def method(self) -> str:
        """The method's name."""
        return self.options.method

    def to_dict(self) -> dict[str, Any]:
        """The configuration as recorded in ``lmdx_merge.json``: as in the file (paths
        resolved, defaults filled in), the method's options at the top level."""
        shared = self.options.model_dump(include=set(SharedOptions.model_fields))
        return {
            "method": self.method,
            "models": [asdict(m) for m in self.models],
            "base": self.base,
            **shared,
            **self.options.method_options.model_dump(),
        }

    def with_option(self, keyword: str, value: Any) -> MergeConfig:
        """This configuration with one shared option set as a front door's ``keyword``
        would (``lmdx merge``'s flags), checked; :class:`OptionError` names the keyword."""
        shared = {
            k: v for k, v in self.options.keywords().items() if k in SharedOptions.keyword_paths()
        }
        fixed = {
            "method": self.method,
            "coefficients": self.options.coefficients,
            "method_options": self.options.method_options,
        }
        options = MergeOptions.from_keywords({**shared, keyword: value}, fixed, writes=True)
        return replace(self, options=options)

    def arguments(self, *, data: bool) -> dict[str, Any]:
        """The front doors' arguments for this configuration (:func:`lmdx.stream_merge`,
        :func:`lmdx.merge.api.merge_in_memory`); with ``data``, each model's texts read
        (methods that take data)."""
        method = method_named(self.method)
        return {
            "models": [m.path for m in self.models],
            "method": self.method,
            "stats": (
                [m.stats for m in self.models]
                if any(m.stats is not None for m in self.models)
                else None
            ),
            "base": self.base,
            "labels": [m.name or m.path for m in self.models],
            "data": _texts(self) if data and method.takes_data else None,
            **self.options.keywords(),
        }


# --------------------------------------------------------------------------- schema


def _as_entry(value: Any) -> Any:
    return {"path": value} if isinstance(value, str) else value


class _Strict(BaseModel):
    model_config = STRICT


_Path = Annotated[str, Field(min_length=1)]


class _Model(_Strict):
    path: _Path | None = None
    adapter: _Path | None = None
    stats: _Path | Annotated[list[_Path], Field(min_length=1)] | None = None
    coefficient: Annotated[float, Field(ge=0.0)] | None = None
    name: str | None = None
    data: _Path | None = None
    text_field: Annotated[str, Field(min_length=1)] | None = None
    max_texts: Annotated[int, Field(ge=1)] | None = None
    max_length: Annotated[int, Field(ge=1)] | None = None


def _config_schema() -> type[SharedOptions]:
    """The file's schema: the options every merge shares (:class:`SharedOptions`, their
    sections and checks), ``method``, ``models``, ``base`` and, at the top level, every
    option of a registered method (checked by that method's model once the method is
    known)."""
    extra: Any = {key: (Any, None) for key in all_options()}
    models = list[Annotated[_Model, BeforeValidator(_as_entry)]]
    return create_model(
        "MergeConfigFile",
        __base__=SharedOptions,
        method=(str, ...),
        models=(Annotated[models, Field(min_length=2)], ...),
        base=(_Path | None, None),
        **extra,
    )


_SECTIONS: dict[str, type[BaseModel]] = {
    "models": _Model,
    "heads": HeadOptions,
    "output": OutputOptions,
}


def _labels() -> dict[str, str]:
    return {
        "models": "must be a list of at least 2 entries ({path: ..., ...})",
        **SharedOptions.labels(),
    }


def _schema_error(exc: ValidationError, where: str) -> MergeError:
    """One line for the first problem the schema found; unknown keys are listed together
    with the keys allowed there."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "extra_forbidden":
        parent = first["loc"][:-1]
        extra = sorted(str(e["loc"][-1]) for e in errors if e["loc"][:-1] == parent)
        section = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in parent)
        section = section.lstrip(".")
        key = str(next((p for p in parent if isinstance(p, str)), ""))
        cls = _SECTIONS.get(key) or _config_schema()
        allowed = ", ".join(sorted(cls.model_fields))
        hint = did_you_mean(extra[0], list(cls.model_fields)) if len(extra) == 1 else ""
        return MergeError(
            f"{where}: unknown key(s) {extra} in {section or 'the config'}{hint}; allowed: "
            f"{allowed}"
        )
    if first.get("input") is None:  # a default (from the environment) refused
        key = ".".join(str(p) for p in first["loc"])
        return MergeError(f"{where}: {key}: {str(first['msg']).removeprefix('Value error, ')}")
    return MergeError(f"{where}: {schema_message(exc, _labels())}")


def load_merge_config(path: str | os.PathLike[str], *, cost: bool = False) -> MergeConfig:
    """Read and validate a merge configuration (YAML or JSON); relative paths are taken
    relative to the file's folder. Errors name the key and say what is expected. With
    ``cost`` (for :func:`merge_cost`), ``models[].stats`` are accepted whatever the method.

    The file is checked by a typed schema: numbers must be numbers of the right kind and
    range (no ``true`` for 1, no ``1.5`` threads, nothing infinite), keys must be known;
    YAML is read with PyYAML's safe loader and aliases are refused.
    """
    path = Path(path)
    where = f"config {path}"
    if not path.is_file():
        raise MissingFileError(f"{where}: no such file")
    if path.suffix == ".json":
        raw = parse_json(read_text(path, "config", MergeError), where, MergeError)
    else:
        raw = read_yaml(path, "config", MergeError)
    if not isinstance(raw, dict):
        raise MergeError(f"{where}: expected a mapping of keys (method, models, ...)")
    if "method" in raw and not _known(raw["method"]):
        got = raw["method"]
        why = unloaded_methods().get(got) if isinstance(got, str) else None
        if why is not None:
            raise MergeError(f"{where}: {why}")
        posts = ", ".join(f"+{p}" for p in post_steps())
        raise MergeError(
            f"{where}: method must be one of {', '.join(method_names())} (each may be followed "
            f"by {posts}), got {got!r}"
            f"{did_you_mean(got, method_names()) if isinstance(got, str) else ''}"
        )
    try:
        checked = _config_schema().model_validate(raw)
    except ValidationError as exc:
        raise _schema_error(exc, where) from None
    return _resolved(checked, path.parent, where, cost)


def _known(method: Any) -> bool:
    """Whether ``method`` names a registered method, or one followed by a post-step."""
    if not isinstance(method, str):
        return False
    try:
        method_named(method)
    except MergeError:
        return False
    return True


def _resolved(checked: Any, root: Path, where: str, cost: bool) -> MergeConfig:
    """The configuration with paths resolved and checked, and the rules across keys."""

    def resolve(p: str) -> str:
        """``p`` relative to the config's folder, ``..`` folded away (``merge/../ft/x`` is
        ``ft/x``) unless a symbolic link makes the two differ (then its real path)."""
        full = Path(p).expanduser()
        path = str(full if full.is_absolute() else root / full)
        short = os.path.normpath(path)
        if short == path or not os.path.exists(path):  # missing: reported as given, below
            return path
        try:
            return short if os.path.samefile(short, path) else os.path.realpath(path)
        except (OSError, ValueError):  # short is no path at all: path is the real one
            return os.path.realpath(path)

    def exists(p: str, key: str, *, folder: bool) -> bool:
        try:
            return Path(p).is_dir() if folder else Path(p).exists()
        except (OSError, ValueError) as exc:
            detail = exc.strerror if isinstance(exc, OSError) else exc
            raise MergeError(f"{where}: {key} {p[:200]!r}: not a usable path ({detail})") from None

    method = checked.method
    models = []
    for i, e in enumerate(checked.models):
        if (e.path is None) == (e.adapter is None):
            raise MergeError(
                f"{where}: models[{i}]: give path (a model folder) or adapter (a LoRA adapter "
                "folder over base), one of the two"
            )
        key = "path" if e.adapter is None else "adapter"
        given = e.path if e.adapter is None else e.adapter
        assert given is not None
        entry = ModelEntry(
            path=resolve(given), coefficient=e.coefficient, name=e.name, adapter=key == "adapter"
        )
        if not exists(entry.path, f"models[{i}].{key}", folder=True):
            what = "model" if key == "path" else "adapter"
            raise MergeError(f"{where}: models[{i}].{key} {entry.path}: no such {what} folder")
        if is_adapter_folder(entry.path) != entry.adapter:
            raise MergeError(
                f"{where}: models[{i}].path {entry.path} is a LoRA adapter folder: write "
                f"adapter: instead of path:"
                if not entry.adapter
                else f"{where}: models[{i}].adapter {entry.path}: no adapter_config.json; "
                "not a PEFT adapter folder"
            )
        if e.stats is not None:
            parts = [resolve(p) for p in ([e.stats] if isinstance(e.stats, str) else e.stats)]
            for part in parts:
                if not exists(part, f"models[{i}].stats", folder=False):
                    raise MergeError(
                        f"{where}: models[{i}].stats {part}: no such file or statistics folder"
                    )
            entry.stats = parts[0] if isinstance(e.stats, str) else parts
        if e.data is not None:
            entry.data = _data_spec(e.data, resolve, exists, f"{where}: models[{i}].data")
        if e.text_field is not None:
            entry.text_field = e.text_field
        entry.max_texts, entry.max_length = e.max_texts, e.max_length
        models.append(entry)
    values = {k: getattr(checked, k) for k in all_options()}
    try:
        own, refused = method_options(method, values), None
    except OptionError as exc:
        own, refused = None, exc
    # a refused option still tells whether surrogates were asked for (its own error follows)
    surrogate = (
        values.get("surrogate") is True if own is None else method_named(method).surrogates(own)
    )
    uses_base = (
        values.get("prior") is not None if own is None else method_named(method).uses_base(own)
    )
    _check_needs(method, models, checked, where, cost, surrogate, uses_base)  # what is missing
    if own is None:
        assert refused is not None
        raise MergeError(f"{where}: {refused.in_file()}") from None
    coefs = [m.coefficient for m in models]
    if any(c is not None for c in coefs) and any(c is None for c in coefs):
        raise MergeError(f"{where}: give a coefficient for every model or for none")
    shared = {name: getattr(checked, name) for name in SharedOptions.model_fields}
    fixed = {"method": method, "coefficients": None if coefs[0] is None else coefs}
    try:
        options = MergeOptions.model_validate({**fixed, "method_options": own, **shared})
    except ValidationError as exc:  # the coefficients, all 0
        raise MergeError(f"{where}: models[].coefficient {schema_message(exc)}") from None
    base = None
    if checked.base is not None:
        base = resolve(checked.base)
        if not exists(base, "base", folder=True):
            raise MergeError(f"{where}: base {base}: no such model folder")
    return MergeConfig(models=models, options=options, base=base)


def _check_needs(
    method: str,
    models: list[ModelEntry],
    checked: Any,
    where: str,
    cost: bool,
    surrogate: bool,
    uses_base: bool,
) -> None:
    """What the method needs, checked as the front doors check it
    (:func:`lmdx.merge.inputs.check_needs`) with the keys named as in the file; a model's
    own data options (``text_field``, ``max_texts``, ``max_length``) count as data given."""
    spec = method_named(method)
    data_keys = [
        [k for k in ("data", "text_field", *MODEL_DATA_OPTIONS) if getattr(e, k) is not None]
        for e in checked.models
    ]

    def key(what: str, i: int | None) -> str:
        if i is None:
            return what
        if what == "data":
            return f"models[{i}].{(data_keys[i] or ['data'])[0]}"
        return f"models[{i}].{'adapter' if what == 'models' else what}"

    try:
        check_needs(
            spec,
            methods(),
            k=len(models),
            stats=[m.stats is not None for m in models],
            base=checked.base is not None,
            adapters=[i for i, m in enumerate(models) if m.adapter],
            data=[
                m.data is not None or (not spec.takes_data and bool(data_keys[i]))
                for i, m in enumerate(models)
            ],
            key=key,
            cost=cost,
            surrogate=surrogate,
            uses_base=uses_base,
        )
    except MergeError as exc:
        raise MergeError(f"{where}: {exc}") from None


def _data_spec(
    spec: str, resolve: Callable[[str], str], exists: Callable[..., bool], key: str
) -> str:
    """``models[i].data``: ``corpus:NAME`` of a known corpus, or a file (resolved)."""
    if spec.startswith("corpus:"):
        name = spec.removeprefix("corpus:")
        if name not in corpora.CORPORA:
            raise MergeError(
                f"{key}: unknown corpus {name!r}; known: {', '.join(sorted(corpora.CORPORA))}"
            )
        return spec
    path = resolve(spec)
    if not exists(path, key, folder=False) or Path(path).is_dir():
        raise MergeError(f"{key} {path}: no such file (a .txt/.jsonl/.csv file or corpus:NAME)")
    return str(path)


def _texts(cfg: MergeConfig) -> list[Any]:
    """Every model's texts (``regmean_plusplus``), read as ``lmdx stats`` reads DATA (with
    its own ``max_length``: ``{"texts": [...], "max_length": n}``)."""
    out = []
    for i, m in enumerate(cfg.models):
        assert m.data is not None
        try:
            own = cfg.options.method_options.model_dump()
            limit = own.get("max_texts") if m.max_texts is None else m.max_texts
            texts, _, _ = read_data(m.data, text_field=m.text_field, max_texts=limit)
        except DataError as exc:
            raise MergeError(f"models[{i}].data: {exc}") from None
        out.append(texts if m.max_length is None else {"texts": texts, "max_length": m.max_length})
    return out


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _file_door(door: Callable[_P, _R]) -> Callable[_P, _R]:
    """A merge from a configuration file: the advice an error gives in the keyword
    arguments' spelling (:class:`~lmdx.merge.options.HeadsError`) given in the file's."""

    @functools.wraps(door)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return door(*args, **kwargs)
        except HeadsError as exc:
            raise MergeError(exc.in_file()) from None

    return run


@_file_door
def plan_merge(cfg: MergeConfig) -> MergePlan:
    """The streaming merge's plan for ``cfg``: steps, output shards, memory and disk
    estimates. Reads headers (and, with statistics, hashes the weights they are checked
    against); writes nothing."""
    args = cfg.arguments(data=False)
    return stream_merge(
        args.pop("models"), Path(os.devnull), dry_run=True, progress=False, **args
    ).plan


@_file_door
def run_merge(
    cfg: MergeConfig,
    out_dir: str | os.PathLike[str],
    *,
    progress: bool = True,
    streaming: bool = True,
    ray_workers: int = 0,
    ray_address: str | None = None,
    command: str | None = None,
    cost: bool | str | None = None,
) -> Path:
    """Merge as ``cfg`` says and write the result to ``out_dir`` (atomically).

    ``streaming=True`` (default): out of core with :func:`lmdx.stream_merge`
    (safetensors checkpoints; memory bounded by the largest layer); ``False``: load all
    models with transformers and merge in memory (:func:`lmdx.merge.api.merge_in_memory`;
    also reads pickle ``.bin`` checkpoints that transformers accepts). ``ray_workers > 0``
    solves the RegMean groups on Ray workers (streaming only). Both write the same
    folder. ``command`` (the command line) is recorded in ``lmdx_merge.json`` and the
    model card. ``cost`` is :func:`lmdx.merge_models`'s (None: what each task pays is
    estimated when the method's statistics are Grams; False: not measured; ``"exact"``:
    measured exactly).
    """
    record: dict[str, Any] = {"config": cfg.to_dict()}
    if command is not None:
        record["command"] = command
    if not streaming:
        if ray_workers:
            raise MergeError("ray_workers: only for the streaming merge")
        args = cfg.arguments(data=True)
        return merge_in_memory(
            args.pop("models"), out_dir, record=record, progress=progress, cost=cost, **args
        )
    args = cfg.arguments(data=True)
    result = stream_merge(
        args.pop("models"),
        out_dir,
        record=record,
        progress=progress,
        ray_workers=ray_workers,
        ray_address=ray_address,
        cost=cost,
        **args,
    )
    assert result.out_dir is not None
    return result.out_dir


@_file_door
def cost_merge(
    cfg: MergeConfig, *, progress: bool = True, mode: str = "estimate"
) -> dict[str, Any]:
    """What each task would pay for the merge ``cfg`` describes (``lmdx merge --cost``,
    :func:`lmdx.merge.api.merge_cost`): the merge's report with ``cost``, measured as
    ``mode`` says (``"estimate"`` or ``"exact"``); nothing written. Load ``cfg`` with
    ``cost=True`` to give statistics to a method that takes none."""
    args = cfg.arguments(data=True)
    return merge_cost(args.pop("models"), progress=progress, cost=mode, **args)
