"""Merge configuration files (YAML or JSON) for ``lmdx merge CONFIG --out DIR``.

Example::

    method: regmean            # regmean | average | fisher | task_arithmetic
    models:
      - path: finetuned/bbc    # a save_pretrained folder (relative to this file)
        stats: stats/bbc.safetensors     # regmean: Gram statistics; fisher: Fisher
        coefficient: 1.0       # optional per-model coefficient
      - path: finetuned/reuters
        stats: stats/reuters.safetensors
    alpha: 0.9                 # regmean: off-diagonal scaling
    exclude: []                # regmean: module patterns averaged instead of solved
    heads:
      patterns: ["classifier.*"]
      policy: keep             # keep each model's head (heads/<i>.safetensors) | drop
    output:
      dtype: auto              # auto | float32 | bfloat16 | float16
      max_shard_size: 2GB

``base`` (a model folder) and ``scaling`` (λ) are for ``task_arithmetic``;
``fisher_eps`` for ``fisher``; ``ridge``, ``allow_regularization`` and ``threads`` tune
the RegMean solves.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .._errors import MergeError
from .._tensors import OUTPUT_DTYPES
from ..files.hf import load_model
from .api import merge_models, save_merged, stream_merge
from .options import HEAD_POLICIES, METHODS
from .plan import MergePlan

__all__ = ["MergeConfig", "ModelEntry", "load_merge_config", "plan_merge", "run_merge"]

_TOP_KEYS = {
    "method",
    "models",
    "base",
    "alpha",
    "scaling",
    "fisher_eps",
    "ridge",
    "allow_regularization",
    "exclude",
    "heads",
    "output",
    "threads",
}
_MODEL_KEYS = {"path", "stats", "coefficient", "name"}
_HEAD_KEYS = {"patterns", "policy"}
_OUTPUT_KEYS = {"dtype", "max_shard_size"}


@dataclass
class ModelEntry:
    path: str
    stats: str | None = None
    coefficient: float | None = None
    name: str | None = None


@dataclass
class MergeConfig:
    """A validated merge configuration with paths resolved."""

    method: str
    models: list[ModelEntry]
    base: str | None = None
    alpha: float = 1.0
    scaling: float = 0.3
    fisher_eps: float = 1e-8
    ridge: float = 0.0
    allow_regularization: bool = True
    exclude: list[str] = field(default_factory=list)
    head_patterns: list[str] = field(default_factory=list)
    head_policy: str = "keep"
    dtype: str = "auto"
    max_shard_size: str = "2GB"
    threads: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _fail(where: str, msg: str) -> MergeError:
    return MergeError(f"{where}: {msg}")


def _number(value: Any, key: str, where: str, *, lo: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _fail(where, f"{key} must be a number, got {value!r}")
    if lo is not None and value < lo:
        raise _fail(where, f"{key} must be >= {lo}, got {value}")
    return float(value)


def _patterns(value: Any, key: str, where: str) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise _fail(where, f"{key} must be a list of name patterns, got {value!r}")
    return list(value)


def _unknown(keys: Any, allowed: set[str], where: str, section: str) -> None:
    extra = sorted(set(keys) - allowed)
    if extra:
        raise _fail(
            where, f"unknown key(s) {extra} in {section}; allowed: {', '.join(sorted(allowed))}"
        )


def load_merge_config(path: str | os.PathLike[str]) -> MergeConfig:
    """Read and validate a merge configuration (YAML or JSON); relative paths are taken
    relative to the file's folder. Errors name the key and say what is expected."""
    path = Path(path)
    where = f"config {path}"
    if not path.is_file():
        raise MergeError(f"{where}: no such file")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix == ".json":
            raw = json.loads(text)
        else:
            import yaml

            raw = yaml.safe_load(text)
    except Exception as exc:
        raise _fail(where, f"cannot parse ({exc})") from None
    if not isinstance(raw, dict):
        raise _fail(where, "expected a mapping of keys (method, models, ...)")
    _unknown(raw, _TOP_KEYS, where, "the config")
    method = raw.get("method")
    if method not in METHODS:
        raise _fail(where, f"method must be one of {', '.join(METHODS)}, got {method!r}")
    root = path.parent

    def resolve(p: Any, key: str) -> str:
        if not isinstance(p, str) or not p:
            raise _fail(where, f"{key} must be a path, got {p!r}")
        full = Path(p).expanduser()
        return str(full if full.is_absolute() else root / full)

    entries_raw = raw.get("models")
    if not isinstance(entries_raw, list) or len(entries_raw) < 2:
        raise _fail(where, "models must be a list of at least 2 entries ({path: ..., ...})")
    models = []
    for i, e in enumerate(entries_raw):
        key = f"models[{i}]"
        if isinstance(e, str):
            e = {"path": e}
        if not isinstance(e, dict):
            raise _fail(where, f"{key} must be a path or a mapping with 'path'")
        _unknown(e, _MODEL_KEYS, where, key)
        entry = ModelEntry(path=resolve(e.get("path"), f"{key}.path"))
        if not Path(entry.path).is_dir():
            raise _fail(where, f"{key}.path {entry.path}: no such model folder")
        if e.get("stats") is not None:
            entry.stats = resolve(e["stats"], f"{key}.stats")
            if not Path(entry.stats).is_file():
                raise _fail(where, f"{key}.stats {entry.stats}: no such file")
        if e.get("coefficient") is not None:
            entry.coefficient = _number(e["coefficient"], f"{key}.coefficient", where, lo=0.0)
        if e.get("name") is not None:
            entry.name = str(e["name"])
        models.append(entry)
    cfg = MergeConfig(method=method, models=models)
    needs_stats = method in ("regmean", "fisher")
    for i, entry in enumerate(models):
        if needs_stats and entry.stats is None:
            raise _fail(where, f"models[{i}].stats is required for method {method}")
        if not needs_stats and entry.stats is not None:
            raise _fail(where, f"models[{i}].stats given but method {method} uses no statistics")
    coefs = [m.coefficient for m in models]
    if any(c is not None for c in coefs) and any(c is None for c in coefs):
        raise _fail(where, "give a coefficient for every model or for none")
    if "alpha" in raw:
        cfg.alpha = _number(raw["alpha"], "alpha", where, lo=0.0)
        if cfg.alpha > 1.0:
            raise _fail(where, f"alpha must be in [0, 1], got {cfg.alpha}")
    if "scaling" in raw:
        cfg.scaling = _number(raw["scaling"], "scaling", where)
    if "fisher_eps" in raw:
        cfg.fisher_eps = _number(raw["fisher_eps"], "fisher_eps", where, lo=0.0)
    if "ridge" in raw:
        cfg.ridge = _number(raw["ridge"], "ridge", where, lo=0.0)
    if "allow_regularization" in raw:
        if not isinstance(raw["allow_regularization"], bool):
            raise _fail(where, "allow_regularization must be true or false")
        cfg.allow_regularization = raw["allow_regularization"]
    if raw.get("threads") is not None:
        cfg.threads = int(_number(raw["threads"], "threads", where, lo=1))
    if method == "task_arithmetic":
        if raw.get("base") is None:
            raise _fail(where, "task_arithmetic needs base: (the pre-trained model folder)")
        cfg.base = resolve(raw["base"], "base")
        if not Path(cfg.base).is_dir():
            raise _fail(where, f"base {cfg.base}: no such model folder")
    elif raw.get("base") is not None:
        raise _fail(where, f"base is only used by task_arithmetic, not {method}")
    cfg.exclude = _patterns(raw.get("exclude"), "exclude", where)
    heads = raw.get("heads")
    if heads is not None:
        if not isinstance(heads, dict):
            raise _fail(where, "heads must be a mapping {patterns: [...], policy: keep|drop}")
        _unknown(heads, _HEAD_KEYS, where, "heads")
        cfg.head_patterns = _patterns(heads.get("patterns"), "heads.patterns", where)
        cfg.head_policy = heads.get("policy", "keep")
        if cfg.head_policy not in HEAD_POLICIES:
            raise _fail(where, f"heads.policy must be keep or drop, got {cfg.head_policy!r}")
    output = raw.get("output")
    if output is not None:
        if not isinstance(output, dict):
            raise _fail(where, "output must be a mapping {dtype: ..., max_shard_size: ...}")
        _unknown(output, _OUTPUT_KEYS, where, "output")
        cfg.dtype = output.get("dtype", "auto")
        if cfg.dtype not in OUTPUT_DTYPES:
            raise _fail(
                where, f"output.dtype must be auto/float32/bfloat16/float16, got {cfg.dtype!r}"
            )
        cfg.max_shard_size = str(output.get("max_shard_size", "2GB"))
    return cfg


def _merge_kwargs(cfg: MergeConfig) -> dict[str, Any]:
    """The keyword arguments of both merge front doors for ``cfg``."""
    labels = [m.name or m.path for m in cfg.models]
    coefficients = (
        None if cfg.models[0].coefficient is None else [m.coefficient or 0.0 for m in cfg.models]
    )
    stats = [m.stats for m in cfg.models] if cfg.method in ("regmean", "fisher") else None
    return {
        "method": cfg.method,
        "stats": stats,
        "alpha": cfg.alpha,
        "coefficients": coefficients,
        "exclude": cfg.exclude,
        "heads": cfg.head_patterns,
        "base": cfg.base,
        "scaling": cfg.scaling,
        "fisher_eps": cfg.fisher_eps,
        "ridge": cfg.ridge,
        "allow_regularization": cfg.allow_regularization,
        "labels": labels,
        "n_threads": cfg.threads,
    }


def _output_kwargs(cfg: MergeConfig) -> dict[str, Any]:
    return {
        "head_policy": cfg.head_policy,
        "dtype": cfg.dtype,
        "max_shard_size": cfg.max_shard_size,
    }


def plan_merge(cfg: MergeConfig) -> MergePlan:
    """The streaming merge's plan for ``cfg``: steps, output shards, memory and disk
    estimates. Reads headers (and, with statistics, hashes the weights they are checked
    against); writes nothing."""
    result = stream_merge(
        [m.path for m in cfg.models],
        Path(os.devnull),
        dry_run=True,
        progress=False,
        **_output_kwargs(cfg),
        **_merge_kwargs(cfg),
    )
    return result.plan


def run_merge(
    cfg: MergeConfig,
    out_dir: str | os.PathLike[str],
    *,
    progress: bool = True,
    streaming: bool = True,
    ray_workers: int = 0,
    ray_address: str | None = None,
) -> Path:
    """Merge as ``cfg`` says and write the result to ``out_dir`` (atomically).

    ``streaming=True`` (default): out of core with :func:`lmdx.stream_merge`
    (safetensors checkpoints; memory bounded by the largest layer); ``False``: load all
    models with transformers and merge in memory (:func:`lmdx.merge_models`; also reads
    pickle ``.bin`` checkpoints that transformers accepts). ``ray_workers > 0`` solves the
    RegMean groups on Ray actors (streaming only). Both write the same folder.
    """
    out_dir = Path(out_dir)
    if out_dir.exists():
        raise MergeError(f"output {out_dir}: already exists; choose a new directory")
    record = {"config": cfg.to_dict()}
    if streaming:
        result = stream_merge(
            [m.path for m in cfg.models],
            out_dir,
            record=record,
            progress=progress,
            ray_workers=ray_workers,
            ray_address=ray_address,
            **_output_kwargs(cfg),
            **_merge_kwargs(cfg),
        )
        assert result.out_dir is not None
        return result.out_dir
    if ray_workers:
        raise MergeError("ray_workers: only for the streaming merge")
    models = [load_model(m.path, progress=progress) for m in cfg.models]
    merged = merge_models(models, progress=progress, **_merge_kwargs(cfg))
    return save_merged(
        merged,
        out_dir,
        models[0],
        tokenizer_from=cfg.models[0].path,
        record=record,
        progress=progress,
        **_output_kwargs(cfg),
    )
