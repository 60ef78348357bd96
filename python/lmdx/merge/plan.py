"""A merge planned before any arithmetic: the inputs checked against each other and
against their statistics, the steps, the output tensors and shards, the memory needed.

One plan serves both front doors: :func:`lmdx.merge_models` (models in memory) and
:func:`lmdx.stream_merge` (checkpoints on disk) call :func:`make_plan` on their checked
inputs (:class:`lmdx.merge.method.MergeInputs`), and the engine runs its steps. The steps
are the method's (:class:`lmdx.merge.method.MergeMethod`): its group steps, then one step
per other tensor, each carrying the method that runs it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from .._errors import MergeError, ModelMismatchError
from .._tensors import FLOAT_DTYPES, itemsize
from .._util import current_rss_bytes, matches, split_in_order
from ..config import default_threads
from ..files.checkpoint import SINGLE_FILE
from ..files.digest import DIGEST, DIGESTS, identity_digest
from ..files.hf import base_model_info, model_files
from ..files.identity import describe_mismatch
from ..stats.file import Statistics
from .method import MergeInputs, Step, StepSizes, tensor_step
from .options import HeadsError
from .source import AdapterSource, TensorSource
from .surrogate import SurrogateStatistics

__all__ = [
    "MergePlan",
    "Output",
    "check_same_entries",
    "check_same_layout",
    "check_stats_model",
    "content_sha256",
    "make_plan",
    "plan_outputs",
    "tensor_hashes",
]


class Output(NamedTuple):
    """One tensor of the merged model: its name there, the input tensor it comes from,
    its dtype and shape."""

    name: str
    source: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * itemsize(self.dtype)


@dataclass
class MergePlan:
    """What a merge will do, and how much memory and disk it needs."""

    method: str  # its name
    labels: list[str]
    steps: list[Step]
    outputs: list[Output]
    shards: list[tuple[str, list[int]]]  # (file name, indices into outputs)
    heads: list[str]
    tied: dict[str, str]
    input_bytes: int
    output_bytes: int
    baseline_rss: int
    base_class: str | None = None  # head_policy "drop": the backbone's class ...
    base_prefix: str = ""  # ... and the prefix of its parameters
    notes: list[str] = field(default_factory=list)  # what the method says about the inputs

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
            *(f"note:     {note}" for note in self.notes),
            f"output:   {len(self.outputs)} tensors, {self.output_bytes / 1e9:.2f} GB in "
            f"{len(self.shards)} shard(s)",
            f"memory:   ~{self.peak_memory / 1e9:.2f} GB peak estimated "
            f"({self.baseline_rss / 1e9:.2f} GB process now + largest step); largest steps:",
        ]
        for s in biggest:
            lines.append(f"  {s.memory / 1e6:9.1f} MB  {s.kind} {s.method.step_label(s)}")
        return "\n".join(lines)


# --------------------------------------------------------------------------- checks


def check_same_layout(
    sources: Sequence[TensorSource],
    body: Sequence[str],
    heads: Sequence[str],
    *,
    extra_buffers: bool = False,
) -> None:
    """Every source holds ``body`` (the first source's non-head tensors) with the same
    shapes and dtypes and nothing else but heads; :class:`MergeError` names the tensor.
    With ``extra_buffers``, the other sources may also hold tensors that are not floating
    point (a base's ``position_ids`` buffer, which checkpoints saved by older transformers
    hold and task models saved by newer ones lack): no weight, nothing to merge."""
    ref = sources[0]
    known = set(body)
    for c in sources[1:]:
        for n in body:
            if n not in c:
                raise MergeError(
                    f"{c.label} has no tensor {n!r} that {ref.label} has{ref.where(n)}: the "
                    "models do not share one architecture"
                )
            if c.shape(n) != ref.shape(n):
                raise HeadsError(
                    n,
                    f"tensor {n!r}: shape {ref.shape(n)} in {ref.label}{ref.where(n)} but "
                    f"{c.shape(n)} in {c.label}{c.where(n)}",
                )
            if c.dtype(n) != ref.dtype(n):
                raise MergeError(
                    f"tensor {n!r}: dtype {ref.dtype(n)} in {ref.label}{ref.where(n)} but "
                    f"{c.dtype(n)} in {c.label}{c.where(n)}; convert the models to one dtype "
                    "first (the merged tensor would otherwise take the first model's)"
                )
        extra = [
            n
            for n in c.names()
            if n not in known
            and not matches(n, heads)
            and not (extra_buffers and not c.is_float(n))
        ]
        if extra:
            raise MergeError(
                f"{c.label} has tensors {ref.label} lacks (e.g. {extra[0]!r}): the models do "
                "not share one architecture"
            )


def check_stats_model(source: TensorSource, stats: Statistics) -> dict[str, str]:
    """Verify ``stats`` were computed on the weights of ``source`` (per-tensor content
    hashes of the stored bytes, of the kind the statistics' identity holds:
    :func:`lmdx.files.digest.identity_digest`; integer tensors the statistics' model does
    not have, such as a ``position_ids`` buffer older checkpoints store, are not
    checked); return the tied weights the statistics reveal: parameters of the
    statistics' model that the source does not store because they are stored under
    another name (alias -> stored name)."""
    ident = stats.model
    params: Mapping[str, Any] = ident["parameters"]
    where = f"statistics {stats.source}" if stats.source else "statistics"
    arch = source.architecture()

    def fail(msg: str) -> ModelMismatchError:
        return ModelMismatchError(
            f"{where} do not belong to {source.label}: {msg}. Collect statistics on the model "
            "being merged (lmdx stats MODEL DATA --out FILE)."
        )

    if arch and ident.get("architecture") not in (arch, "state_dict"):
        raise fail(f"architecture {ident.get('architecture')} (statistics) vs {arch} (model)")
    algorithm = identity_digest(ident) or DIGEST  # (an identity of no tensors: nothing to hash)
    if algorithm not in DIGESTS:
        raise fail("its model identity mixes content hashes of different kinds")
    adapter = source.adapter.identity(algorithm) if isinstance(source, AdapterSource) else None
    if (adapter or {}).get("sha256") != (ident.get("adapter") or {}).get("sha256"):
        with_adapter = {"architecture": arch, "adapter": adapter}
        raise fail(describe_mismatch({**ident, "architecture": arch}, with_adapter))
    # An integer tensor the statistics' model lacks is one the model no longer loads (e.g.
    # BERT's position_ids, which checkpoints saved by older transformers still hold): it
    # cannot have shaped the statistics and is copied from the first model like any
    # integer tensor. A floating-point one could be a weight the statistics never saw.
    names = sorted(n for n in source.names() if n in params or source.is_float(n))
    for name in names:
        if name not in params:
            raise fail(f"parameter {name!r} is in this model but not in the statistics' model")
        p = params[name]
        here = {"shape": list(source.shape(name)), "dtype": source.dtype(name)}
        if p["shape"] != here["shape"] or p["dtype"] != here["dtype"]:
            here[algorithm] = p[algorithm]
            raise fail(describe_mismatch({"parameters": {name: p}}, {"parameters": {name: here}}))
    hashes = tensor_hashes(source, names, algorithm)
    stored = {}
    for name, h in zip(names, hashes, strict=True):
        p = params[name]
        if h != p[algorithm]:
            here = {"shape": p["shape"], "dtype": p["dtype"], algorithm: h}
            raise fail(describe_mismatch({"parameters": {name: p}}, {"parameters": {name: here}}))
        stored[h] = name
    tied = {}
    for name, p in params.items():
        if name in source:
            continue
        if p[algorithm] in stored:
            tied[name] = stored[p[algorithm]]
        elif p["dtype"] in FLOAT_DTYPES:
            raise fail(f"parameter {name!r} is in the statistics' model but not in this model")
    return tied


def tensor_hashes(source: TensorSource, names: Sequence[str], algorithm: str = DIGEST) -> list[str]:
    """Content hashes (``algorithm``'s) of tensors ``names`` of ``source``, in that order,
    hashed on the CPUs available (both hashes release the GIL)."""
    with ThreadPoolExecutor(min(default_threads(), 8), "lmdx-hash") as pool:
        return list(pool.map(lambda name: source.digest(name, algorithm), names))


def content_sha256(source: TensorSource) -> str:
    """A model's content hash: SHA-256 over ``name:dtype:shape:hash;`` of every stored
    tensor in name order, ``hash`` its BLAKE3 (:mod:`lmdx.files.digest`; the
    ``weights_sha256`` :func:`lmdx.files.identity.state_identity` records of the same
    tensors), then, for a LoRA adapter over a base, the adapter's identity hash."""
    names = sorted(source.names())
    total = hashlib.sha256()
    for name, h in zip(names, tensor_hashes(source, names), strict=True):
        total.update(f"{name}:{source.dtype(name)}:{list(source.shape(name))}:{h};".encode())
    if isinstance(source, AdapterSource):
        total.update(f"adapter:{source.adapter.identity()['sha256']};".encode())
    return total.hexdigest()


def check_same_entries(stats: Sequence[Statistics], labels: Sequence[str]) -> None:
    """Every statistics covers the modules (Grams) or parameters (Fisher) of the first;
    :class:`MergeError` names both files and the first entry missing."""
    what = "module" if stats[0].kind == "regmean-gram" else "Fisher parameter"
    ref = stats[0].modules if stats[0].kind == "regmean-gram" else stats[0].parameters
    for i, s in enumerate(stats[1:], start=1):
        have = s.modules if s.kind == "regmean-gram" else s.parameters
        missing = [m for m in ref if m not in have]
        extra = [m for m in have if m not in ref]
        if missing or extra:
            a, b = (i, 0) if missing else (0, i)
            name = (missing or extra)[0]
            raise MergeError(
                f"statistics {stats[a].source or labels[a]} (of {labels[a]}) lack {what} "
                f"{name!r} that statistics {stats[b].source or labels[b]} (of {labels[b]}) "
                "have; collect every model's statistics over the same modules"
            )


# --------------------------------------------------------------------------- plan


def make_plan(inputs: MergeInputs, *, folder: bool) -> MergePlan:
    """Check the inputs against each other and plan their merge by ``inputs.method``.

    ``folder``: the merged model is written as a ``save_pretrained`` folder (outputs named
    and cast as ``options.heads.policy`` and ``options.output.dtype`` say, shards planned);
    otherwise it stays in memory (every non-head tensor in its input dtype). The method's
    group steps come first (RegMean groups, RegMean++'s blocks), every other tensor is
    one step (:func:`~lmdx.merge.method.tensor_step`: by the method's
    :meth:`~lmdx.merge.method.MergeMethod.tensor_method`, or a copy if not floating
    point).
    """
    sources, options, method = inputs.sources, inputs.options, inputs.method
    labels = inputs.labels
    ref = sources[0]
    names = ref.names()
    heads = options.heads.patterns
    head_names = [n for n in names if matches(n, heads)]
    body = [n for n in names if not matches(n, heads)]
    check_same_layout(sources, body, heads)
    tied = ref.aliases()
    if inputs.stats is not None:
        for source, s in zip(sources, inputs.stats, strict=True):
            if isinstance(s, SurrogateStatistics):  # made from the source's own weights
                continue
            tied = {**source.aliases(), **check_stats_model(source, s)}
        check_same_entries(inputs.stats, labels)
    if inputs.base is not None:  # the tensors the base lacks: the method's to say
        base = inputs.base
        check_same_layout([ref, base], [n for n in body if n in base], heads, extra_buffers=True)
    names = method.order(inputs, names)
    body = [n for n in names if not matches(n, heads)]

    steps = method.group_steps(inputs, body, set(tied) | set(tied.values()))
    covered = {t for s in steps for t in s.tensors}
    for n in body:
        if n not in covered:
            steps.append(tensor_step(inputs, n))
    output = options.output
    out_size = 0 if output.dtype == "auto" or not folder else itemsize(output.dtype)
    packed = inputs.stats is not None and all(s.files for s in inputs.stats)  # from files
    for step in steps:
        sizes = StepSizes.of_step(step, ref, len(sources), out_size, packed)
        step.memory = step.method.memory(step, sizes, inputs)
    if folder and ref.path is not None and ref.path.is_dir():
        model_files(ref.path)  # refuse what would be copied unsafely, before any work
    outputs, shards, prefix, base_class = plan_outputs(
        ref,
        names,
        head_names,
        folder=folder,
        head_policy=options.heads.policy,
        dtype=output.dtype,
        max_shard_size=output.max_shard_size,
    )
    output_bytes = sum(o.nbytes for o in outputs)
    if folder and options.heads.policy == "keep":
        output_bytes += sum(s.nbytes(h) for s in sources for h in head_names)
    return MergePlan(
        method=method.name,
        labels=labels,
        steps=steps,
        outputs=outputs,
        shards=shards,
        heads=head_names,
        tied=tied,
        input_bytes=sum(s.total_bytes() for s in sources),
        output_bytes=output_bytes,
        baseline_rss=current_rss_bytes(),
        base_class=base_class,
        base_prefix=prefix,
        notes=method.plan_notes(inputs, steps),
    )


def plan_outputs(
    ref: TensorSource,
    names: Sequence[str],
    head_names: Sequence[str],
    *,
    folder: bool,
    head_policy: str,
    dtype: str,
    max_shard_size: int,
) -> tuple[list[Output], list[tuple[str, list[int]]], str, str | None]:
    """The merged model's tensors (in the order of ``names``), shards, and, with heads
    dropped, the backbone's prefix and class. In memory: every non-head tensor as it is."""
    if not folder:
        heads = set(head_names)
        outputs = [Output(n, n, ref.dtype(n), ref.shape(n)) for n in names if n not in heads]
        return outputs, [], "", None
    prefix, base_class = "", None
    if head_policy == "drop":
        prefix, base_class = base_model_info(ref.config)
    outputs = []
    for n in names:
        if n in head_names and head_policy == "drop":
            continue
        out_name = n
        if head_policy == "drop" and prefix:
            if not n.startswith(prefix + "."):
                continue
            out_name = n.removeprefix(prefix + ".")
        src_dtype = ref.dtype(n)
        keep = dtype == "auto" or src_dtype not in FLOAT_DTYPES
        outputs.append(Output(out_name, n, src_dtype if keep else dtype, ref.shape(n)))
    return outputs, _shards(outputs, max_shard_size), prefix, base_class


def _shards(outputs: Sequence[Output], max_shard: int) -> list[tuple[str, list[int]]]:
    groups = split_in_order([o.nbytes for o in outputs], max_shard)
    if len(groups) == 1:
        return [(SINGLE_FILE, groups[0])]
    n = len(groups)
    return [(f"model-{j + 1:05d}-of-{n:05d}.safetensors", g) for j, g in enumerate(groups)]
