"""Out-of-core merging: sharded safetensors in, sharded safetensors out, one layer at a time.

:func:`stream_merge` never loads a whole model. It reads the K input checkpoints (Hugging
Face folders with ``model.safetensors`` or ``model.safetensors.index.json`` + shards)
tensor by tensor with plain reads, merges one *step* at a time — a RegMean input group
(e.g. q/k/v, which share one Gram: all K models' weights for it plus the K Grams read
from the statistics files) or one averaged tensor — and writes each result straight
into its output shard. Output shards are planned before any work from the known shapes
(names and an ``model.safetensors.index.json`` as ``save_pretrained`` writes them),
reserved on disk (a full disk fails before the merge starts), filled tensor by tensor
and renamed with the whole folder at the end. Peak memory is one step's inputs and
statistics plus the step's result, independent of depth and of K × model size.

The arithmetic is the in-memory :func:`lmdx.merge.merge_models`' (same kernels, same
float64 intermediates, same casts), so both give bit-identical tensors
(``tests/test_stream.py``).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .._errors import DiskFullError, MergeError, ModelMismatchError
from .._tensors import FLOAT_DTYPES as _FLOATS
from .._util import progress_bar as _progress
from ..average import weighted_average
from ..files.atomic import atomic_directory, existing_parent
from ..files.checkpoint import INDEX_FILE, SINGLE_FILE, Checkpoint
from ..files.hf import TOKENIZER_FILES
from ..files.hf import base_model_info as _base_model_info
from ..files.identity import describe_mismatch, file_sha256
from ..files.safetensors import SafetensorsWriter, TensorSpec
from ..stats.file import Statistics
from ..stats.format import INDEX_NAME
from .memory import (
    METHODS,
    RegMeanOptions,
    _coefficients,
    _finite,
    _matches,
    _named,
    _parse_size,
    fisher_tensor,
    open_stats,
    regmean_groups,
    solve_group,
    task_arithmetic_tensor,
)

__all__ = ["Checkpoint", "MergePlan", "StreamMergeResult", "peak_rss_bytes", "stream_merge"]

_OUT_DTYPES = ("auto", "float32", "bfloat16", "float16")


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def _current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


# --------------------------------------------------------------------------- inputs


def _check_stats_model(ckpt: Checkpoint, stats: Statistics) -> dict[str, str]:
    """Verify ``stats`` were computed on the weights stored in ``ckpt`` (per-tensor
    SHA-256 of the stored bytes); return the tied aliases: parameters of the statistics'
    model not stored in the checkpoint because they equal a stored one."""
    ident = stats.model
    params: Mapping[str, Any] = ident["parameters"]
    where = f"statistics {stats.source}" if stats.source else "statistics"
    arch = ckpt.architecture()

    def fail(msg: str) -> ModelMismatchError:
        return ModelMismatchError(
            f"{where} do not belong to {ckpt.label}: {msg}. Collect statistics on the model "
            "being merged (lmdx stats MODEL DATA --out FILE)."
        )

    if arch and ident.get("architecture") not in (arch, "state_dict"):
        raise fail(f"architecture {ident.get('architecture')} (statistics) vs {arch} (model)")
    stored = {}
    for name in ckpt.names():
        if name not in params:
            raise fail(f"parameter {name!r} is in this model but not in the statistics' model")
        p = params[name]
        here = {"shape": list(ckpt.shape(name)), "dtype": ckpt.dtype(name)}
        if p["shape"] != here["shape"] or p["dtype"] != here["dtype"]:
            here["sha256"] = p["sha256"]
            raise fail(describe_mismatch({"parameters": {name: p}}, {"parameters": {name: here}}))
        h = ckpt.sha256(name)
        if h != p["sha256"]:
            raise fail(
                f"parameter {name!r} has different values (sha256 {p['sha256'][:12]}… there, "
                f"{h[:12]}… here)"
            )
        stored[h] = name
    tied = {}
    for name, p in params.items():
        if name in ckpt:
            continue
        if p["sha256"] in stored:
            tied[name] = stored[p["sha256"]]
        elif p["dtype"] in _FLOATS:
            raise fail(f"parameter {name!r} is in the statistics' model but not in this model")
    return tied


# --------------------------------------------------------------------------- plan


@dataclass
class Step:
    """One unit of work: a RegMean input group or one tensor."""

    kind: str  # "regmean" | "average" | "fisher" | "task_arithmetic" | "copy"
    tensors: list[str]  # input tensor names (RegMean: the members' weights)
    modules: list[str] = field(default_factory=list)
    layout: str = "linear"
    dim: int = 0
    memory: int = 0  # estimated bytes while the step runs


@dataclass
class MergePlan:
    """What :func:`stream_merge` will do, and how much memory and disk it needs."""

    method: str
    labels: list[str]
    steps: list[Step]
    outputs: list[tuple[str, str, str, tuple[int, ...]]]  # (out name, source, dtype, shape)
    shards: list[tuple[str, list[int]]]  # (file name, indices into outputs)
    heads: list[str]
    input_bytes: int
    output_bytes: int
    baseline_rss: int

    @property
    def peak_memory(self) -> int:
        """Estimated peak resident memory: the process now plus the largest step."""
        return self.baseline_rss + max((s.memory for s in self.steps), default=0)

    def describe(self) -> str:
        """The plan in words (``lmdx merge --dry-run``)."""
        kinds: dict[str, int] = {}
        for s in self.steps:
            kinds[s.kind] = kinds.get(s.kind, 0) + 1
        biggest = sorted(self.steps, key=lambda s: s.memory, reverse=True)[:3]
        lines = [
            f"method:   {self.method} of {len(self.labels)} models",
            *(f"  model {i}: {lab}" for i, lab in enumerate(self.labels)),
            f"inputs:   {self.input_bytes / 1e9:.2f} GB in all (read tensor by tensor)",
            "steps:    "
            + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
            + f" ({len(self.heads)} head tensors kept per model)",
            f"output:   {len(self.outputs)} tensors, {self.output_bytes / 1e9:.2f} GB in "
            f"{len(self.shards)} shard(s)",
            f"memory:   ~{self.peak_memory / 1e9:.2f} GB peak estimated "
            f"({self.baseline_rss / 1e9:.2f} GB process now + largest step); largest steps:",
        ]
        for s in biggest:
            what = s.modules[0] if s.modules else s.tensors[0]
            more = f" (+{len(s.modules) - 1} sharing its input)" if len(s.modules) > 1 else ""
            lines.append(f"  {s.memory / 1e6:9.1f} MB  {s.kind} {what}{more}")
        return "\n".join(lines)


def _plan_regmean(
    stats: Sequence[Statistics],
    body: Sequence[str],
    tied: set[str],
    exclude: Sequence[str],
    heads: Sequence[str],
    labels: Sequence[str],
) -> list[Step]:
    steps = []
    for members in regmean_groups(stats, set(body), tied, exclude, heads, labels):
        info = stats[0].modules[members[0]]
        steps.append(
            Step(
                "regmean",
                [stats[0].modules[m]["weight"] for m in members],
                members,
                info["layout"],
                int(stats[0].groups[stats[0].group_of(members[0])]["dim"]),
            )
        )
    return steps


def _step_memory(step: Step, ckpt: Checkpoint, k: int, out_size: int) -> int:
    n = sum(int(np.prod(ckpt.shape(t))) for t in step.tensors)
    read = sum(ckpt.nbytes(t) for t in step.tensors)
    widened = 4 * n if any(ckpt.dtype(t) in ("bfloat16", "float16") for t in step.tensors) else 0
    out = n * out_size if out_size else read  # 0: the input's dtype
    if step.kind == "regmean":
        d = step.dim
        joined = 4 * n if len(step.tensors) > 1 else 0  # concatenated members
        # K reads (+ copies), K float64 Grams (+ one packed read), the summed system, the
        # float64 right-hand side/result and its copy out of the core, the cast result
        return k * (read + widened + joined) + (k + 1) * 8 * d * d + 4 * d * d + 16 * n + out
    # K reads (+ widened copies), float64 result (+ Fisher weights), the cast result
    extra = 2 * k * 8 * n if step.kind == "fisher" else 0
    return k * (read + widened) + 8 * n + extra + out


def _shards(
    outputs: Sequence[tuple[str, str, str, tuple[int, ...]]], max_shard: int
) -> list[tuple[str, list[int]]]:
    groups: list[list[int]] = []
    size = 0
    for i, (_, _, dtype, shape) in enumerate(outputs):
        nbytes = int(np.prod(shape, dtype=np.int64)) * _itemsize(dtype)
        if not groups or (size + nbytes > max_shard and groups[-1]):
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += nbytes
    if len(groups) == 1:
        return [(SINGLE_FILE, groups[0])]
    n = len(groups)
    return [(f"model-{j + 1:05d}-of-{n:05d}.safetensors", g) for j, g in enumerate(groups)]


def _itemsize(dtype: str) -> int:
    return 2 if dtype == "bfloat16" else np.dtype(dtype).itemsize


# --------------------------------------------------------------------------- merge


@dataclass
class StreamMergeResult:
    """Output folder (None for a dry run), the plan, the report written to
    ``lmdx_merge.json`` and the process's peak RSS."""

    out_dir: Path | None
    plan: MergePlan
    report: dict[str, Any]
    peak_rss: int


def stream_merge(
    models: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    method: str = "regmean",
    *,
    stats: Sequence[Statistics | str | os.PathLike[str]] | None = None,
    alpha: float = 1.0,
    coefficients: Sequence[float] | None = None,
    exclude: Sequence[str] = (),
    heads: Sequence[str] = (),
    head_policy: str = "keep",
    base: str | os.PathLike[str] | None = None,
    scaling: float = 0.3,
    fisher_eps: float = 1e-8,
    ridge: float = 0.0,
    allow_regularization: bool = True,
    dtype: str = "auto",
    max_shard_size: int | str = "2GB",
    labels: Sequence[str] | None = None,
    record: Mapping[str, Any] | None = None,
    dry_run: bool = False,
    progress: bool = True,
    n_threads: int | None = None,
    ray_workers: int = 0,
    ray_address: str | None = None,
) -> StreamMergeResult:
    """Merge K checkpoints out of core into a ``save_pretrained`` folder.

    Parameters are those of :func:`lmdx.merge.merge_models` and
    :func:`lmdx.merge.save_merged` (``models`` and ``base`` are model folders). With
    ``dry_run=True`` nothing is read beyond headers (and, with statistics, the weights
    they are checked against) and nothing is written: the result's ``plan`` says what
    would be done and how much memory and disk it needs.

    The output folder holds ``config.json`` (the first model's, with ``architectures``
    and the dtype updated as needed), the weights as ``model.safetensors`` or shards of
    at most ``max_shard_size`` with ``model.safetensors.index.json``, the tokenizer
    files, ``heads/<i>.safetensors`` (``head_policy="keep"``) and ``lmdx_merge.json``
    (configuration, per-layer solver information, input hashes, peak RSS). It appears
    only when complete.

    ``ray_workers > 0`` solves the RegMean groups on that many Ray actors (``lmdx[ray]``;
    ``ray_address`` as in :func:`lmdx.collect_regmean_stats_ray`), a few groups ahead of
    the writer, each actor reading the inputs and statistics itself (on a cluster every
    node must see the same paths; statistics must be files or folders). Averages and the
    writing stay in this process. The output is bit-identical to a run without Ray.
    """
    t0 = time.perf_counter()
    if method not in METHODS:
        raise MergeError(f"method: expected one of {METHODS}, got {method!r}")
    if head_policy not in ("keep", "drop"):
        raise MergeError(f"head_policy: expected 'keep' or 'drop', got {head_policy!r}")
    if dtype not in _OUT_DTYPES:
        raise MergeError(f"dtype: expected one of {_OUT_DTYPES}, got {dtype!r}")
    if not 0.0 <= alpha <= 1.0:
        raise MergeError(f"alpha: must be in [0, 1], got {alpha}")
    models = list(models)
    k = len(models)
    if k < 2:
        raise MergeError(f"need at least 2 models to merge, got {k}")
    labels = list(labels) if labels is not None else [str(m) for m in models]
    if len(labels) != k:
        raise MergeError(f"labels: {len(labels)} names for {k} models")
    coef = _coefficients(coefficients, k)
    out_dir = Path(out_dir)
    if not dry_run and out_dir.exists():
        raise MergeError(f"output {out_dir}: already exists; choose a new directory")
    max_shard = _parse_size(max_shard_size)

    ckpts = [Checkpoint(m, lab) for m, lab in zip(models, labels, strict=True)]
    names = ckpts[0].names()
    head_names = [n for n in names if _matches(n, heads)]
    body = [n for n in names if not _matches(n, heads)]
    _check_same_layout(ckpts, body, heads)
    stat_objs = open_stats(stats, method, k, labels)
    tied: dict[str, str] = {}
    if stat_objs is not None:
        for c, s in zip(ckpts, stat_objs, strict=True):
            tied = _check_stats_model(c, s)
    base_ckpt = None
    if method == "task_arithmetic":
        if base is None:
            raise MergeError("task_arithmetic needs base= (the pre-trained model)")
        base_ckpt = Checkpoint(base, "base")
        _check_same_layout([ckpts[0], base_ckpt], body, heads)
    elif base is not None:
        raise MergeError(f"method {method!r} takes no base model")

    # ---- plan: steps, outputs, shards, estimates
    out_size = 0 if dtype == "auto" else _itemsize(dtype)  # 0: the input's
    steps: list[Step] = []
    covered: set[str] = set()
    if method == "regmean":
        assert stat_objs is not None
        tied_set = set(tied) | set(tied.values())
        steps = _plan_regmean(stat_objs, body, tied_set, exclude, heads, labels)
        for step in steps:
            covered.update(step.tensors)
    for n in body:
        if n in covered:
            continue
        if not ckpts[0].is_float(n):
            kind = "copy"
        elif method == "fisher" and n in stat_objs[0].parameters:  # type: ignore[index]
            kind = "fisher"
        elif method == "task_arithmetic":
            kind = "task_arithmetic"
        else:
            kind = "average"
        steps.append(Step(kind, [n]))
    for step in steps:
        step.memory = _step_memory(step, ckpts[0], k, out_size)

    prefix, base_class = ("", None)
    if head_policy == "drop":
        prefix, base_class = _base_model_info(ckpts[0].config)
    outputs = []
    for n in names:
        if n in head_names and head_policy == "drop":
            continue
        out_name = n
        if head_policy == "drop" and prefix:
            if not n.startswith(prefix + "."):
                continue
            out_name = n.removeprefix(prefix + ".")
        src_dtype = ckpts[0].dtype(n)
        out_dtype = dtype if dtype != "auto" and src_dtype in _FLOATS else src_dtype
        outputs.append((out_name, n, out_dtype, ckpts[0].shape(n)))
    shards = _shards(outputs, max_shard)
    weights_bytes = sum(int(np.prod(s, dtype=np.int64)) * _itemsize(d) for _, _, d, s in outputs)
    output_bytes = weights_bytes
    if head_policy == "keep":
        output_bytes += sum(c.nbytes(h) for c in ckpts for h in head_names)
    plan = MergePlan(
        method=method,
        labels=labels,
        steps=steps,
        outputs=outputs,
        shards=shards,
        heads=head_names,
        input_bytes=sum(c.total_bytes() for c in ckpts),
        output_bytes=output_bytes,
        baseline_rss=_current_rss_bytes(),
    )
    if dry_run:
        return StreamMergeResult(None, plan, {}, peak_rss_bytes())
    _check_disk(out_dir, output_bytes)

    # ---- run
    report: dict[str, Any] = {
        "method": method,
        "streaming": True,
        "models": labels,
        "alpha": alpha if method == "regmean" else None,
        "coefficients": coef,
        "exclude": list(exclude),
        "heads": list(heads),
        "head_tensors": head_names,
        "layers": {},
    }
    if tied:
        report["tied"] = tied
    if method == "task_arithmetic":
        report["scaling"] = float(scaling)
    options = RegMeanOptions(alpha, coef, ridge, allow_regularization, n_threads)
    worker = _Worker(
        ckpts, stat_objs, base_ckpt, steps, report, labels, options, scaling, fisher_eps
    )
    if ray_workers and method == "regmean":
        assert stat_objs is not None
        sources = [s.source for s in stat_objs]
        if any(src is None or not Path(src).exists() for src in sources):
            raise MergeError("ray_workers: the statistics must be files or folders (paths)")
        order = [src for _, src, _, _ in outputs]
        worker.remote = _RemoteGroups(
            [str(c.path.absolute()) for c in ckpts],
            [str(Path(str(src)).absolute()) for src in sources],
            labels,
            options,
            steps,
            order,
            ray_workers,
            ray_address,
        )
        report["ray_workers"] = ray_workers
    bar = _progress(len(outputs), f"merge ({method}, streaming)", progress)
    try:
        with atomic_directory(out_dir) as tmp:
            index: dict[str, str] = {}
            for fname, members in shards:
                specs = [
                    TensorSpec(outputs[i][0], _np_dtype(outputs[i][2]), outputs[i][3])
                    for i in members
                ]
                with SafetensorsWriter(tmp / fname, specs, {"format": "pt"}) as w:
                    for i in members:
                        out_name, src, out_dtype, _ = outputs[i]
                        w.write(out_name, _to_numpy(worker.result(src), out_dtype))
                        index[out_name] = fname
                        bar.update(1)
            if len(shards) > 1:
                meta = {"total_size": weights_bytes}
                (tmp / INDEX_FILE).write_text(
                    json.dumps({"metadata": meta, "weight_map": index}, indent=2)
                )
            if head_policy == "keep" and head_names:
                (tmp / "heads").mkdir()
                for i, c in enumerate(ckpts):
                    specs = [TensorSpec(h, _np_dtype(c.dtype(h)), c.shape(h)) for h in head_names]
                    with SafetensorsWriter(tmp / "heads" / f"{i}.safetensors", specs) as w:
                        for h in head_names:
                            w.write(h, _to_numpy(c.read(h), c.dtype(h)))
            _write_config(ckpts[0], tmp, dtype, base_class if head_policy == "drop" else None)
            report["seconds"] = time.perf_counter() - t0
            report["peak_rss_bytes"] = peak_rss_bytes()
            report["estimated_peak_bytes"] = plan.peak_memory
            from .. import __version__

            full = {
                "lmdx_version": __version__,
                "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "head_policy": head_policy,
                "dtype": dtype,
                "report": report,
                "inputs": {
                    lab: {
                        "path": str(c.path),
                        "architecture": c.architecture(),
                        "bytes": c.total_bytes(),
                        "stats": s.source if s else None,
                        "stats_sha256": _stats_sha256(s),
                    }
                    for lab, c, s in zip(
                        labels,
                        ckpts,
                        list(stat_objs) if stat_objs else [None] * len(ckpts),
                        strict=True,
                    )
                },
                **(dict(record) if record else {}),
            }
            (tmp / "lmdx_merge.json").write_text(json.dumps(full, indent=2, default=str))
    finally:
        bar.close()
        if worker.remote is not None:
            worker.remote.close()
    return StreamMergeResult(out_dir, plan, report, peak_rss_bytes())


def _check_same_layout(
    ckpts: Sequence[Checkpoint], body: Sequence[str], heads: Sequence[str]
) -> None:
    ref = ckpts[0]
    known = set(body)
    for c in ckpts[1:]:
        for n in body:
            if n not in c:
                raise MergeError(
                    f"{c.label} has no tensor {n!r} that {ref.label} has (in "
                    f"{ref.file_of(n).name}): the models do not share one architecture"
                )
            if c.shape(n) != ref.shape(n):
                raise MergeError(
                    f"tensor {n!r}: shape {ref.shape(n)} in {ref.label} ({ref.file_of(n).name}) "
                    f"but {c.shape(n)} in {c.label} ({c.file_of(n).name}); models must be "
                    "fine-tuned from one checkpoint (exclude differing task heads with heads)"
                )
        extra = [n for n in c.names() if n not in known and not _matches(n, heads)]
        if extra:
            raise MergeError(
                f"{c.label} has tensors {ref.label} lacks (e.g. {extra[0]!r}): the models do "
                "not share one architecture"
            )


def _stats_sha256(stats: Statistics | None) -> str | None:
    """SHA-256 of a statistics file, or of a sharded folder's index (which names every
    shard and the collection id each shard carries)."""
    if stats is None or not stats.source:
        return None
    path = Path(stats.source)
    if path.is_dir():
        path = path / INDEX_NAME
    return file_sha256(path) if path.is_file() else None


def _check_disk(out_dir: Path, nbytes: int) -> None:
    parent = existing_parent(out_dir)
    free = shutil.disk_usage(parent).free
    if free < nbytes * 1.01 + (1 << 20):
        raise DiskFullError(
            28,
            f"output {out_dir}: needs {nbytes / 1e9:.2f} GB but {parent} has "
            f"{free / 1e9:.2f} GB free; nothing was written: free some space or write elsewhere",
        )


def _np_dtype(dtype: str) -> Any:
    return "bfloat16" if dtype == "bfloat16" else np.dtype(dtype)


def _cast(name: str, arr: Any, dtype: str) -> Any:
    """A merged float64 array, checked finite, as a torch tensor of its input's ``dtype``
    (the cast :func:`lmdx.merge.merge_models` applies)."""
    import torch

    checked = np.ascontiguousarray(_finite(name, np.asarray(arr)))
    return torch.from_numpy(checked).to(getattr(torch, dtype))


def _to_numpy(t: Any, dtype: str) -> Any:
    """A torch tensor in ``dtype`` as the NumPy array to store (bfloat16 as raw uint16)."""
    import torch

    t = t.to(getattr(torch, dtype)).contiguous()
    if dtype == "bfloat16":
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.numpy()


def _write_config(ckpt: Checkpoint, tmp: Path, dtype: str, architecture: str | None) -> None:
    if ckpt.path.is_dir():
        cfg = dict(ckpt.config)
        if cfg:
            if dtype != "auto":
                key = "torch_dtype" if "torch_dtype" in cfg and "dtype" not in cfg else "dtype"
                cfg[key] = dtype
            if architecture:
                cfg["architectures"] = [architecture]
            (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        for fname in (*TOKENIZER_FILES, "generation_config.json"):
            src = ckpt.path / fname
            if src.is_file():
                shutil.copy2(src, tmp / fname)


class _Worker:
    """Computes merged tensors on demand, one step at a time; a RegMean group's other
    members wait (already cast to their dtype) until written."""

    def __init__(
        self,
        ckpts: Sequence[Checkpoint],
        stats: Sequence[Statistics] | None,
        base: Checkpoint | None,
        steps: Sequence[Step],
        report: dict[str, Any],
        labels: Sequence[str],
        options: RegMeanOptions,
        scaling: float,
        fisher_eps: float,
    ) -> None:
        self.ckpts, self.stats, self.base = ckpts, stats, base
        self.step_of = {t: s for s in steps for t in s.tensors}
        self.report, self.labels, self.options = report, labels, options
        self.coef, self.n_threads = options.coefficients, options.n_threads
        self.scaling, self.fisher_eps = scaling, fisher_eps
        self.ready: dict[str, Any] = {}
        self.remote: _RemoteGroups | None = None

    def result(self, name: str) -> Any:
        if name not in self.ready:
            self._run(name)
        return self.ready.pop(name)

    def _cast(self, name: str, arr: Any) -> Any:
        return _cast(name, arr, self.ckpts[0].dtype(name))

    def _run(self, name: str) -> None:
        step = self.step_of.get(name)
        if step is None:  # a head tensor (kept from the first model)
            self.ready[name] = self.ckpts[0].read(name)
            return
        if step.kind == "regmean":
            self._regmean(step)
            return
        reads = [c.read(name) for c in self.ckpts]
        if step.kind == "copy":
            self.ready[name] = reads[0]
            return
        if step.kind == "average":
            value = _named(name, weighted_average, reads, self.coef, n_threads=self.n_threads)
        elif step.kind == "fisher":
            assert self.stats is not None
            self.report.setdefault("fisher_weighted", []).append(name)
            value = fisher_tensor(
                name, reads, self.stats, self.coef, self.fisher_eps, self.n_threads
            )
        else:  # task arithmetic
            assert self.base is not None
            value = task_arithmetic_tensor(self.base.read(name), reads, self.coef, self.scaling)
        self.ready[name] = self._cast(name, value)

    def _regmean(self, step: Step) -> None:
        assert self.stats is not None
        if self.remote is not None:
            stored, layers = self.remote.result(step)
            self.report["layers"].update(layers)
            for w, (raw, dtype) in stored.items():
                self.ready[w] = _from_numpy(raw, dtype)
            return
        weights = [[c.read(w) for w in step.tensors] for c in self.ckpts]
        solved = solve_group(
            step.modules, weights, self.stats, self.labels, self.options, self.report
        )
        del weights
        for w, value in solved.items():
            self.ready[w] = self._cast(w, value)


def _from_numpy(raw: Any, dtype: str) -> Any:
    """Inverse of :func:`_to_numpy`: the stored array as a torch tensor of ``dtype``."""
    import torch

    arr = np.array(raw)  # a writable copy: Ray hands out read-only views of its store
    if dtype == "bfloat16":
        return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(arr)


class _GroupSolver:
    """A Ray actor's state: the inputs and statistics opened once; solves one RegMean
    group at a time exactly as the local merge does (same kernels, same cast)."""

    def __init__(
        self,
        models: list[str],
        stats: list[str],
        labels: list[str],
        options: RegMeanOptions,
    ) -> None:
        self.ckpts = [Checkpoint(m, lab) for m, lab in zip(models, labels, strict=True)]
        self.stats = [Statistics.load(p) for p in stats]
        self.labels, self.options = labels, options

    def solve(self, step: Step) -> tuple[dict[str, tuple[Any, str]], dict[str, Any]]:
        report: dict[str, Any] = {"layers": {}}
        weights = [[c.read(w) for w in step.tensors] for c in self.ckpts]
        solved = solve_group(step.modules, weights, self.stats, self.labels, self.options, report)
        del weights
        out = {}
        for w, value in solved.items():
            dtype = self.ckpts[0].dtype(w)
            out[w] = (_to_numpy(_cast(w, value, dtype), dtype), dtype)
        return out, report["layers"]


class _RemoteGroups:
    """RegMean groups solved on Ray actors, submitted in the order the writer needs them
    and at most ``2 × workers`` ahead (bounding the results held here)."""

    def __init__(
        self,
        models: list[str],
        stats: list[str],
        labels: list[str],
        options: RegMeanOptions,
        steps: Sequence[Step],
        order: Sequence[str],
        workers: int,
        address: str | None,
    ) -> None:
        from .._ray import import_ray, start_ray

        ray = self.ray = import_ray()
        self.started = start_ray(address, workers)
        cls = ray.remote(num_cpus=1, max_restarts=1, max_task_retries=1)(_GroupSolver)
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

    def result(self, step: Step) -> tuple[dict[str, tuple[Any, str]], dict[str, Any]]:
        i = self.position[id(step)]
        self._submit_until(i)
        ref = self.refs.pop(i)
        try:
            return self.ray.get(ref)  # type: ignore[no-any-return]
        except self.ray.exceptions.RayError as exc:
            from .._ray import failure as _ray_failure

            raise MergeError(
                f"RegMean of {step.modules[0]!r} failed on its Ray worker: "
                f"{_ray_failure(self.ray, exc)}"
            ) from exc

    def close(self) -> None:
        for actor in self.actors:
            try:
                self.ray.kill(actor, no_restart=True)
            except Exception:  # already dead or Ray going down
                pass
        if self.started:
            self.ray.shutdown()
