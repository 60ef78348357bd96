"""Merge configuration files (YAML or JSON) for ``lmdx merge CONFIG --out DIR``.

Example::

    method: regmean     # regmean | average | fisher | task_arithmetic | ties | dare | dare_ties
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
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, ParamSpec, TypeVar

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, create_model

from .._errors import DataError, MergeError, MissingFileError
from .._tensors import OUTPUT_DTYPES
from .._util import parse_size
from ..data import corpora
from ..data.files import read_data
from ..files.hf import load_model, model_files
from ..files.parse import parse_json, read_text, read_yaml, schema_message
from ..files.peft import is_adapter_folder
from ..files.st import check_same_modules, sentence_transformer
from .api import merge_models, stream_merge
from .block_data import MODEL_DATA_OPTIONS
from .door import check_new_folder
from .inputs import base_users
from .options import HEAD_POLICIES, HeadsError, OptionError, all_options, method_options
from .plan import MergePlan
from .registry import method_named, method_names
from .save import save_merged

__all__ = ["MergeConfig", "ModelEntry", "load_merge_config", "plan_merge", "run_merge"]

#: Most threads a configuration may ask for (far above any machine's cores).
MAX_THREADS = 4096


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
    """A validated merge configuration with paths resolved; ``options`` are the method's
    own (its registered pydantic model's fields, defaults filled in), also read as
    attributes (``cfg.alpha``)."""

    method: str
    models: list[ModelEntry]
    base: str | None = None
    exclude: list[str] = field(default_factory=list)
    head_patterns: list[str] = field(default_factory=list)
    head_policy: str = "keep"
    per_task_folders: bool = False
    dtype: str = "auto"
    max_shard_size: str = "2GB"
    lora_rank: int | None = None
    threads: int | None = None
    solve_memory: str | None = None
    options: dict[str, Any] = field(default_factory=dict)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "options":
            raise AttributeError(name)
        if name in self.options:
            return self.options[name]
        raise AttributeError(f"merge config: method {self.method} has no option {name!r}")

    def to_dict(self) -> dict[str, Any]:
        """The configuration as recorded in ``lmdx_merge.json``: the method's options at
        the top level, as in the file."""
        out = asdict(self)
        return {**out, **out.pop("options")}


# --------------------------------------------------------------------------- schema


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


def _as_entry(value: Any) -> Any:
    return {"path": value} if isinstance(value, str) else value


def _size(value: Any) -> Any:
    """A size (shards, memory) as the merge takes it (``"2GB"``; bytes as ``"1000B"``)."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = f"{value}B"
    if isinstance(value, str):
        try:
            parse_size(value)
        except ValueError:
            pass
        else:
            return value
    raise ValueError("must be a size such as '2GB' or a number of bytes")


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


_Patterns = Annotated[list[str], BeforeValidator(_as_list)]
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


class _Heads(_Strict):
    patterns: _Patterns | None = None
    policy: Literal[HEAD_POLICIES] = "keep"  # type: ignore[valid-type]
    per_task_folders: bool = False


class _Output(_Strict):
    dtype: Literal[OUTPUT_DTYPES] = "auto"  # type: ignore[valid-type]
    max_shard_size: Annotated[str, BeforeValidator(_size)] = "2GB"
    lora_rank: Annotated[int, Field(ge=1, le=2**20)] | None = None


class _ConfigBase(_Strict):
    method: str
    models: Annotated[list[Annotated[_Model, BeforeValidator(_as_entry)]], Field(min_length=2)]
    base: _Path | None = None
    exclude: _Patterns | None = None
    heads: _Heads | None = None
    output: _Output | None = None
    threads: Annotated[int, Field(ge=1, le=MAX_THREADS)] | None = None
    solve_memory: Annotated[str, BeforeValidator(_size)] | None = None


def _config_schema() -> type[_ConfigBase]:
    """The file's schema: the keys every merge has and, at the top level, every option of
    a registered method (checked by that method's model once the method is known)."""
    extra: Any = {key: (Any, None) for key in all_options()}
    return create_model("_ConfigFile", __base__=_ConfigBase, **extra)


_SECTIONS: dict[str, type[BaseModel]] = {
    "models": _Model,
    "heads": _Heads,
    "output": _Output,
}
_LABELS = {
    "models": "must be a list of at least 2 entries ({path: ..., ...})",
    "heads.policy": "must be keep or drop",
    "output.dtype": "must be auto/float32/bfloat16/float16",
    "exclude": "must be a list of name patterns",
    "heads.patterns": "must be a list of name patterns",
    "threads": f"must be a whole number of threads in [1, {MAX_THREADS}]",
    "solve_memory": "must be a size such as '8GB' or a number of bytes",
    "output.lora_rank": "must be a whole number >= 1",
    "heads.per_task_folders": "must be true or false",
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
        return MergeError(
            f"{where}: unknown key(s) {extra} in {section or 'the config'}; allowed: {allowed}"
        )
    return MergeError(f"{where}: {schema_message(exc, _LABELS)}")


def load_merge_config(path: str | os.PathLike[str]) -> MergeConfig:
    """Read and validate a merge configuration (YAML or JSON); relative paths are taken
    relative to the file's folder. Errors name the key and say what is expected.

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
    if "method" in raw and raw["method"] not in method_names():
        got = raw["method"]
        raise MergeError(f"{where}: method must be one of {', '.join(method_names())}, got {got!r}")
    try:
        checked = _config_schema().model_validate(raw)
    except ValidationError as exc:
        raise _schema_error(exc, where) from None
    return _resolved(checked, path.parent, where)


def _resolved(checked: _ConfigBase, root: Path, where: str) -> MergeConfig:
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
    spec = method_named(method)
    needs_stats = spec.stats is not None
    needs_data = spec.takes_data
    for i, (entry, e) in enumerate(zip(models, checked.models, strict=True)):
        if needs_stats and entry.stats is None:
            raise MergeError(f"{where}: models[{i}].stats is required for method {method}")
        if not needs_stats and entry.stats is not None:
            raise MergeError(
                f"{where}: models[{i}].stats given but method {method} uses no statistics"
            )
        if needs_data and entry.data is None:
            raise MergeError(
                f"{where}: models[{i}].data is required for method {method} (the "
                "model's texts: a .txt/.jsonl/.csv file or corpus:NAME)"
            )
        named = [k for k in ("data", "text_field", *MODEL_DATA_OPTIONS) if getattr(e, k)]
        if not needs_data and named:
            key = named[0]
            users = [m for m in method_names() if method_named(m).takes_data]
            raise MergeError(
                f"{where}: models[{i}].{key} given but method {method} uses no data (only "
                f"{', '.join(users)} does)"
            )
    values = {k: getattr(checked, k) for k in all_options()}
    try:
        own = method_options(method, values)
    except OptionError as exc:
        raise MergeError(f"{where}: {exc.in_file()}") from None
    coefs = [m.coefficient for m in models]
    if any(c is not None for c in coefs) and any(c is None for c in coefs):
        raise MergeError(f"{where}: give a coefficient for every model or for none")
    cfg = MergeConfig(
        method=method,
        models=models,
        threads=checked.threads,
        solve_memory=checked.solve_memory,
        exclude=list(checked.exclude or []),
        options=own.model_dump(),
    )
    adapters = [i for i, m in enumerate(models) if m.adapter]
    if spec.needs_base or adapters:
        if checked.base is None:
            if adapters:
                raise MergeError(
                    f"{where}: models[{adapters[0]}] is a LoRA adapter: base: is required (the "
                    "model folder the adapters adapt)"
                )
            raise MergeError(f"{where}: {method} needs base: (the pre-trained model folder)")
        cfg.base = resolve(checked.base)
        if not exists(cfg.base, "base", folder=True):
            raise MergeError(f"{where}: base {cfg.base}: no such model folder")
    elif checked.base is not None:
        raise MergeError(
            f"{where}: base is only used by LoRA adapters (models[].adapter) and by "
            f"{', '.join(base_users())}, not by {method} of full models"
        )
    if checked.heads is not None:
        cfg.head_patterns = list(checked.heads.patterns or [])
        cfg.head_policy = checked.heads.policy
        cfg.per_task_folders = checked.heads.per_task_folders
    if cfg.per_task_folders and (cfg.head_policy != "keep" or not cfg.head_patterns):
        raise MergeError(
            f"{where}: heads.per_task_folders needs heads kept (heads.patterns given, "
            "heads.policy keep)"
        )
    if checked.output is not None:
        cfg.dtype = checked.output.dtype
        cfg.max_shard_size = checked.output.max_shard_size
        cfg.lora_rank = checked.output.lora_rank
    if cfg.lora_rank is not None and len(adapters) != len(models):
        raise MergeError(
            f"{where}: output.lora_rank needs every model to be a LoRA adapter "
            "(models[].adapter) over base"
        )
    return cfg


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
            limit = cfg.options.get("max_texts") if m.max_texts is None else m.max_texts
            texts, _, _ = read_data(m.data, text_field=m.text_field, max_texts=limit)
        except DataError as exc:
            raise MergeError(f"models[{i}].data: {exc}") from None
        out.append(texts if m.max_length is None else {"texts": texts, "max_length": m.max_length})
    return out


def _data_kwargs(cfg: MergeConfig) -> dict[str, Any]:
    """The data argument of both front doors (methods that take data; none otherwise)."""
    if not method_named(cfg.method).takes_data:
        return {}
    return {"data": _texts(cfg)}


def _merge_kwargs(cfg: MergeConfig) -> dict[str, Any]:
    """The keyword arguments of both merge front doors for ``cfg``."""
    labels = [m.name or m.path for m in cfg.models]
    coefficients = (
        None if cfg.models[0].coefficient is None else [m.coefficient or 0.0 for m in cfg.models]
    )
    stats = [m.stats for m in cfg.models] if method_named(cfg.method).stats else None
    return {
        "method": cfg.method,
        "stats": stats,
        "coefficients": coefficients,
        "exclude": cfg.exclude,
        "heads": cfg.head_patterns,
        "base": cfg.base,
        "labels": labels,
        "n_threads": cfg.threads,
        "solve_memory": cfg.solve_memory,
        **cfg.options,
    }


def _output_kwargs(cfg: MergeConfig) -> dict[str, Any]:
    return {
        "head_policy": cfg.head_policy,
        "dtype": cfg.dtype,
        "max_shard_size": cfg.max_shard_size,
        "task_folders": cfg.per_task_folders,
    }


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
    result = stream_merge(
        [m.path for m in cfg.models],
        Path(os.devnull),
        dry_run=True,
        progress=False,
        lora_rank=cfg.lora_rank,
        **_output_kwargs(cfg),
        **_merge_kwargs(cfg),
    )
    return result.plan


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
) -> Path:
    """Merge as ``cfg`` says and write the result to ``out_dir`` (atomically).

    ``streaming=True`` (default): out of core with :func:`lmdx.stream_merge`
    (safetensors checkpoints; memory bounded by the largest layer); ``False``: load all
    models with transformers and merge in memory (:func:`lmdx.merge_models`; also reads
    pickle ``.bin`` checkpoints that transformers accepts). ``ray_workers > 0`` solves the
    RegMean groups on Ray actors (streaming only). Both write the same folder.
    ``command`` (the command line) is recorded in ``lmdx_merge.json`` and the model card.
    """
    out_dir = Path(out_dir)
    record: dict[str, Any] = {"config": cfg.to_dict()}
    if command is not None:
        record["command"] = command
    if streaming:
        result = stream_merge(
            [m.path for m in cfg.models],
            out_dir,
            record=record,
            progress=progress,
            ray_workers=ray_workers,
            ray_address=ray_address,
            lora_rank=cfg.lora_rank,
            **_output_kwargs(cfg),
            **_merge_kwargs(cfg),
            **_data_kwargs(cfg),
        )
        assert result.out_dir is not None
        return result.out_dir
    if ray_workers:
        raise MergeError("ray_workers: only for the streaming merge")
    check_new_folder(out_dir)  # before the models are loaded (stream_merge checks its own)
    kwargs = _merge_kwargs(cfg)
    if cfg.base is not None:
        kwargs["base"] = load_model(cfg.base, progress=progress)
    check_same_modules(
        [sentence_transformer(m.path) for m in cfg.models], [m.name or m.path for m in cfg.models]
    )
    models = [m.path if m.adapter else load_model(m.path, progress=progress) for m in cfg.models]
    merged = merge_models(
        models, progress=progress, lora_rank=cfg.lora_rank, **kwargs, **_data_kwargs(cfg)
    )
    first = cfg.models[0]
    template = kwargs["base"] if first.adapter else models[0]
    tokenizers = first.path if not first.adapter or model_files(Path(first.path)) else cfg.base
    return save_merged(
        merged,
        out_dir,
        template,
        tokenizer_from=tokenizers,
        record=record,
        progress=progress,
        **_output_kwargs(cfg),
    )
