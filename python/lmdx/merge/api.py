"""The merge's front doors: models in memory (:func:`merge_models`, then
:func:`save_merged`) and checkpoints on disk (:func:`stream_merge`). Both plan with
:func:`lmdx.merge.plan.make_plan` and run the same engine, so they give bit-identical
tensors; they differ only in where tensors come from and go to.

Task heads (``heads`` patterns, e.g. ``classifier.*``) are not merged: each model keeps
its own (:meth:`MergeResult.model_state`, ``heads/<i>.safetensors`` with its labels in
``heads/<i>.json``, and with ``task_folders`` a complete folder ``tasks/<i>/`` each) or
they are dropped. :func:`lmdx.merge.load.load_merged` loads a merged folder as task
``i``'s model: the merged body, model ``i``'s head and labels.

Models may be PEFT LoRA adapter folders over ``base`` (:class:`~lmdx.merge.source.
AdapterSource`; RegMean on their factors, :mod:`lmdx.merge.lora`) and
sentence-transformers folders (:mod:`lmdx.files.st`: the Transformer is merged, the
other modules written unchanged beside it).
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .._errors import MergeError
from .._util import matches
from ..files.checkpoint import Checkpoint
from ..files.hf import load_model, model_files
from ..files.identity import file_sha256
from ..files.peft import LoraAdapter, is_adapter_folder
from ..files.st import check_same_modules, model_folder, sentence_transformer
from ..stats.file import Statistics
from ..stats.format import INDEX_NAME
from .engine import Executor, run
from .lora import LoraExport, check_lora_export
from .options import RANDOM_METHODS, SPARSIFYING_METHODS, TASK_VECTOR_METHODS, MergeOptions
from .plan import Block, MergePlan, content_sha256, make_plan, open_stats, peak_rss_bytes
from .ray import RayGroupSolver
from .regmean_plusplus import BlockMerger, activation_budget, model_blocks, prepare_batches
from .sink import (
    FolderSink,
    MemorySink,
    merge_record,
    output_config,
)
from .source import AdapterSource, StateDictSource, TensorSource, model_source

__all__ = [
    "MergeResult",
    "StreamMergeResult",
    "merge_models",
    "save_merged",
    "stream_merge",
]

StatsArg = Sequence[Statistics | str | os.PathLike[str]] | None


@dataclass
class MergeResult:
    """A merged model in memory.

    Attributes
    ----------
    state_dict
        Merged parameters (torch tensors in each parameter's input dtype), without the
        task heads; tied weights are one tensor under each of their names. Names and
        shapes are those of the models' ``save_pretrained`` folders, which differ from
        ``model.state_dict()`` where transformers converts weights on saving (e.g. ViT,
        GPT-NeoX, MoE experts saved per expert): load it with :func:`save_merged` and
        ``from_pretrained``, or ``cls.from_pretrained(None, config=..., state_dict=...)``.
    heads
        Per input model, its own head tensors (empty dicts when there are no heads).
    report
        What was done: method, options, per-layer solver information, timings.
    inputs
        Per input model: path, architecture, size, statistics file and its hash (recorded
        in ``lmdx_merge.json`` by :func:`save_merged`).
    configs
        Per input model, its Hugging Face configuration (``{}`` for a state dict): where
        :func:`save_merged` finds each head's labels.
    lora
        With ``lora_rank``: the rank-r LoRA of the merged update, which
        :func:`save_merged` writes to ``lora/`` (a :class:`lmdx.merge.lora.LoraExport`).
    """

    state_dict: dict[str, Any]
    heads: list[dict[str, Any]]
    report: dict[str, Any] = field(default_factory=dict)
    inputs: dict[str, Any] = field(default_factory=dict)
    configs: list[dict[str, Any]] = field(default_factory=list)
    lora: LoraExport | None = None

    def model_state(self, i: int = 0) -> dict[str, Any]:
        """Full state dict for model ``i``: the merged body plus model ``i``'s own head."""
        return {**self.state_dict, **self.heads[i]}


@dataclass
class StreamMergeResult:
    """Output folder (None for a dry run), the plan, the report written to
    ``lmdx_merge.json`` and the process's peak RSS."""

    out_dir: Path | None
    plan: MergePlan
    report: dict[str, Any]
    peak_rss: int


def _labels(models: Sequence[Any], labels: Sequence[str] | None) -> list[str]:
    if labels is None:
        return [
            str(m) if isinstance(m, (str, os.PathLike)) else f"model{i}"
            for i, m in enumerate(models)
        ]
    if len(labels) != len(models):
        raise MergeError(f"labels: {len(labels)} names for {len(models)} models")
    return list(labels)


def _report(
    plan: MergePlan, options: MergeOptions, streaming: bool, stats: Sequence[Statistics] | None
) -> dict[str, Any]:
    solves = options.method in ("regmean", "regmean_plusplus")
    report: dict[str, Any] = {
        "method": options.method,
        "streaming": streaming,
        "models": plan.labels,
        "alpha": options.alpha if solves else None,
        "precision": options.precision if solves else None,
        "ridge": options.ridge if solves else None,
        "coefficients": None if options.coefficients is None else list(options.coefficients),
        "exclude": list(options.exclude),
        "heads": list(options.heads),
        "head_tensors": plan.heads,
        "layers": {},
    }
    if plan.tied:
        report["tied"] = plan.tied
    if options.method in TASK_VECTOR_METHODS:
        report["scaling"] = options.scaling
    if options.method in SPARSIFYING_METHODS:
        report["density"] = options.density
    if options.method in RANDOM_METHODS:
        report["seed"] = options.seed
    if options.method == "regmean" and stats:
        # linear weights the statistics could not cover: averaged, and said so
        missing = {n: why for s in stats for n, why in s.not_solved.items()}
        missing = {n: why for n, why in sorted(missing.items()) if not matches(n, options.heads)}
        if missing:
            report["not_solved"] = missing
    return report


def _inputs(sources: Sequence[TensorSource], stats: Sequence[Statistics] | None) -> dict[str, Any]:
    """Per input model: path (and, for an adapter, its base's), architecture, size,
    content hash (:func:`lmdx.merge.plan.content_sha256`), statistics file and its hash."""
    out = {}
    for src, s in zip(sources, list(stats) if stats else [None] * len(sources), strict=True):
        entry = {
            "path": None if src.path is None else os.path.abspath(src.path),
            "architecture": src.architecture(),
            "bytes": src.total_bytes(),
            "weights_sha256": content_sha256(src),
            "stats": None if s is None else s.source,
            "stats_sha256": _stats_sha256(s),
        }
        if isinstance(src, AdapterSource):
            base = src.base.path
            entry["base"] = None if base is None else os.path.abspath(base)
        out[src.label] = entry
    return out


def _open_models(
    models: Sequence[Any],
    labels: Sequence[str],
    base: TensorSource | None,
    open_model: Any,
) -> list[TensorSource]:
    """Every model as a tensor source: a PEFT LoRA adapter folder over ``base``
    (:class:`AdapterSource`), anything else by ``open_model(model, label)``."""
    sources: list[TensorSource] = []
    for i, (m, label) in enumerate(zip(models, labels, strict=True)):
        if isinstance(m, (str, os.PathLike)) and is_adapter_folder(m):
            if base is None:
                raise MergeError(
                    f"models[{i}] {m}: a LoRA adapter folder; give base= (the model folder it "
                    "adapts; in a merge config: base:)"
                )
            sources.append(AdapterSource(base, LoraAdapter.load(m, label), label))
        else:
            sources.append(open_model(m, label))
    return sources


def _check_base(sources: Sequence[TensorSource], base: Any, method: str) -> None:
    if base is not None and method not in TASK_VECTOR_METHODS:
        if not any(isinstance(s, AdapterSource) for s in sources):
            raise MergeError(
                f"base: used by LoRA adapters (models that are adapter folders) and by "
                f"{', '.join(TASK_VECTOR_METHODS)}, not by {method} of full models"
            )


def _check_task_folders(
    plan: MergePlan, options: MergeOptions, configs: Sequence[Mapping[str, Any]]
) -> None:
    """Per-task folders need kept heads of models with a configuration (checked before
    any work)."""
    if options.head_policy != "keep" or not plan.heads:
        raise MergeError(
            "per-task folders: the merge kept no task heads (give heads patterns and the head "
            "policy keep)"
        )
    if not all(configs):
        raise MergeError(
            "per-task folders: a model without a configuration (a state dict) has no labels"
        )


def _tokenizer_folder(source: TensorSource) -> Path | None:
    """Where the output's tokenizer files come from: the model's folder (an adapter's,
    if it has them; else its base's)."""
    folder = source.path
    if isinstance(source, AdapterSource) and (folder is None or not model_files(folder)):
        folder = source.base.path
    if folder is None or not folder.is_dir():
        return None
    return model_folder(folder)


def _st_files(folders: Sequence[Any], labels: Sequence[str]) -> dict[str, bytes]:
    """The sentence-transformers files a merged folder gets (none for other models); the
    models' modules must agree (:func:`lmdx.files.st.check_same_modules`)."""
    found = [
        sentence_transformer(f) if isinstance(f, (str, os.PathLike)) and Path(f).is_dir() else None
        for f in folders
    ]
    check_same_modules(found, labels)
    return {} if found[0] is None else found[0].output_files()


def _stats_sha256(stats: Statistics | None) -> str | None:
    """SHA-256 of a statistics file, or of a sharded folder's index (which names every
    shard and the collection id each shard carries)."""
    if stats is None or not stats.source:
        return None
    path = Path(stats.source)
    if path.is_dir():
        path = path / INDEX_NAME
    return file_sha256(path) if path.is_file() else None


@dataclass
class _PlusPlusData:
    """What ``regmean_plusplus`` runs the models on (see :func:`merge_models`)."""

    data: Sequence[Any] | None = None
    tokenizer: Any = None
    max_texts: int | None = None
    max_length: int = 128
    batch_size: int = 16
    max_activation_memory: int | str | None = None


def _blocks(sources: Sequence[TensorSource], method: str, data: Any) -> list[Block] | None:
    """The blocks RegMean++ merges in order (None for the other methods, which take no
    data)."""
    if method != "regmean_plusplus":
        if data is not None:
            raise MergeError(f"data: only method regmean_plusplus takes data, not {method!r}")
        return None
    return model_blocks(sources[0])


def _block_merger(
    sources: Sequence[TensorSource],
    plan: MergePlan,
    options: MergeOptions,
    blocks: list[Block] | None,
    inputs: _PlusPlusData,
    progress: bool,
) -> BlockMerger | None:
    """RegMean++'s block merger for the engine, its data tokenized into batches."""
    if blocks is None:
        return None
    batches = prepare_batches(
        sources,
        inputs.data,
        inputs.tokenizer,
        max_texts=inputs.max_texts,
        max_length=inputs.max_length,
        batch_size=inputs.batch_size,
    )
    return BlockMerger(
        sources,
        blocks,
        batches,
        options,
        plan.labels,
        tied=set(plan.tied) | set(plan.tied.values()),
        max_activation_memory=activation_budget(inputs.max_activation_memory),
        progress=progress,
    )


def merge_models(
    models: Sequence[Any],
    method: str = "regmean",
    *,
    stats: StatsArg = None,
    alpha: float = 1.0,
    coefficients: Sequence[float] | None = None,
    exclude: Sequence[str] = (),
    heads: Sequence[str] = (),
    base: Any = None,
    scaling: float | None = None,
    density: float | None = None,
    seed: int | None = None,
    fisher_eps: float = 1e-8,
    ridge: float = 0.0,
    allow_regularization: bool = True,
    precision: str = "auto",
    labels: Sequence[str] | None = None,
    lora_rank: int | None = None,
    progress: bool = True,
    n_threads: int | None = None,
    data: Sequence[Any] | None = None,
    tokenizer: Any = None,
    max_texts: int | None = None,
    max_length: int = 128,
    batch_size: int = 16,
    max_activation_memory: int | str | None = None,
) -> MergeResult:
    """Merge K models fine-tuned from one checkpoint, in memory.

    Parameters
    ----------
    models
        K torch modules, state dicts, Hugging Face model folders (sentence-transformers
        folders: their Transformer) or PEFT LoRA adapter folders over ``base``.
    method
        ``"regmean"``, ``"average"``, ``"fisher"``, a task-vector method:
        ``"task_arithmetic"``, ``"ties"``, ``"dare"`` or ``"dare_ties"`` (see
        :mod:`lmdx.merge.methods` for the formulas), or ``"regmean_plusplus"``
        (RegMean++, :mod:`lmdx.merge.regmean_plusplus`: the blocks merged in order, each
        on Grams taken through the merged blocks before it; needs ``data``, not
        ``stats``).
    stats
        ``regmean``: K Gram statistics (objects, files or sharded folders), one per model,
        in order; ``fisher``: K Fisher statistics. Each is verified to belong to its model
        (per-tensor SHA-256 of its weights).
    alpha
        RegMean's off-diagonal scaling in [0, 1] (the paper uses 0.9 for transformers).
    coefficients
        Optional K non-negative per-model coefficients (RegMean: multiply the Grams;
        averages: weights; task-vector methods: per task-vector factors, which TIES and
        DARE-TIES also use to elect signs and weight the mean of the agreeing entries).
    exclude
        ``fnmatch`` patterns of module names RegMean must not solve (they are averaged).
    heads
        ``fnmatch`` patterns of parameter names that are task heads: not merged; each
        model's own head is kept in :attr:`MergeResult.heads`.
    base
        The pre-trained model (a module or folder): the model LoRA adapters in ``models``
        adapt (their statistics must be collected on base + adapter), and the θ_base the
        task-vector methods take their task vectors ``θ_i − θ_base`` against (needed by
        them; refused by the other methods of full models).
    scaling
        λ of the task-vector methods: ``θ_base + λ × (merged task vector)``. Default
        (None): 0.3 for ``task_arithmetic`` and ``dare``, 1.0 for ``ties`` and
        ``dare_ties`` (the TIES paper's recommendation).
    density
        In (0, 1]: ``ties`` keeps the ``int(density × numel)`` entries of largest
        magnitude of each task vector, per tensor; ``dare`` and ``dare_ties`` keep each
        entry with probability ``density`` and divide the kept ones by ``density``.
        Default (None): 0.2 for ``ties`` (the TIES paper's top 20 %), 0.5 for ``dare``
        and ``dare_ties``.
    seed
        ``dare``/``dare_ties``: seed of the random drops, a whole number >= 0 (default
        0). Model ``i``'s drops in tensor ``name`` depend only on (seed, i, name): the
        same seed gives the same bits, in memory or streaming, on any thread count.
    fisher_eps
        ε added to every Fisher value.
    ridge, allow_regularization, precision
        Passed to the RegMean solves (see :func:`lmdx.regmean_merge_layer`):
        ``precision="float64"`` solves every layer in float64; ``"auto"`` solves a layer
        in float32 where a certificate bounds its relative output error by 1e-6
        (``"float32"``: always). ``report["layers"]`` says per module what was used and
        the certified ``output_error_estimate``, and
        ``report["poorly_determined"]`` lists the systems with too few statistics rows
        per input or a large condition estimate, with what to do;
        ``report["not_solved"]`` the linear weights the statistics could not cover (e.g.
        mixture-of-experts tensors of an interface lmdx does not know), which were
        averaged, with why. LoRA adapters over one base are solved on their factors, in
        float64 (``low_rank`` in the layer's report: the merged update's rank).
    labels
        Names of the models for messages and the report (default: their paths or
        ``model0``...).
    data
        ``regmean_plusplus``: per model, in order, its texts or its batches (dicts of
        tensors for ``model(**batch)``). Each model's own data is needed at merge time:
        RegMean++'s Grams depend on the merged blocks, so they cannot be collected and
        shared in advance. The models must be transformers models or model folders
        (their blocks are run).
    tokenizer
        For texts: one tokenizer for every model or a list with one per model (default:
        each model folder's own).
    max_texts, max_length, batch_size
        For texts: the first ``max_texts`` of each model's texts (default: all), cut at
        ``max_length`` tokens, ``batch_size`` per forward pass.
    max_activation_memory
        ``regmean_plusplus``: the most bytes of activations held between blocks (``"4GB"``
        or bytes; default: all of them); the batches beyond it are recomputed from the
        merged prefix for every block (slower: see :mod:`lmdx.merge.regmean_plusplus`).
    lora_rank
        Also build a rank-r LoRA of the merged update (every model a LoRA adapter over
        ``base``): :attr:`MergeResult.lora`, written by :func:`save_merged`.
    """
    t0 = time.perf_counter()
    models = list(models)
    options = MergeOptions.checked(
        len(models),
        method=method,
        alpha=alpha,
        coefficients=coefficients,
        exclude=exclude,
        heads=heads,
        scaling=scaling,
        density=density,
        seed=seed,
        fisher_eps=fisher_eps,
        ridge=ridge,
        allow_regularization=allow_regularization,
        precision=precision,
        n_threads=n_threads,
    )
    names = _labels(models, labels)
    base_source = None if base is None else model_source(base, "base", progress=progress)
    sources = _open_models(
        models, names, base_source, lambda m, lab: model_source(m, lab, progress=progress)
    )
    _check_base(sources, base, method)
    lora = (
        None if lora_rank is None else LoraExport(check_lora_export(sources, lora_rank), lora_rank)
    )
    stat_objs = open_stats(stats, method, len(models), names)
    arithmetic_base = base_source if method in TASK_VECTOR_METHODS else None
    blocks = _blocks(sources, method, data)
    plan = make_plan(sources, options, stat_objs, arithmetic_base, folder=False, blocks=blocks)
    report = _report(plan, options, streaming=False, stats=stat_objs)
    sink = MemorySink(plan)
    pp_data = _PlusPlusData(
        data, tokenizer, max_texts, max_length, batch_size, max_activation_memory
    )
    merger = _block_merger(sources, plan, options, blocks, pp_data, progress)
    executor = Executor(
        sources, stat_objs, arithmetic_base, plan, options, report, blocks=merger, lora=lora
    )
    run(plan, executor.result, sink, f"merge ({method})", progress and merger is None)
    if merger is not None:
        report["regmean_plusplus"] = merger.summary()
    ref = sources[0]
    in_memory = ref.base if isinstance(ref, AdapterSource) else ref
    assert isinstance(in_memory, StateDictSource)
    state = {}
    for name in in_memory.state:  # every name, tied aliases as the very tensor they alias
        if name in plan.heads:
            continue
        state[name] = sink.tensors[plan.tied.get(name, name)]
    report["seconds"] = time.perf_counter() - t0
    head_states = [{h: src.read(h) for h in plan.heads} for src in sources]
    if lora is not None:  # the folder loads as model 0: its head
        for h, value in head_states[0].items():
            lora.observe(h, value)
    configs = [dict(src.config) for src in sources]
    inputs = _inputs(sources, stat_objs)
    return MergeResult(state, head_states, report, inputs, configs, lora)


def save_merged(
    result: MergeResult,
    out_dir: str | os.PathLike[str],
    template: Any,
    *,
    head_policy: str = "keep",
    dtype: str = "auto",
    max_shard_size: int | str = "2GB",
    tokenizer_from: str | os.PathLike[str] | None = None,
    record: Mapping[str, Any] | None = None,
    task_folders: bool = False,
    progress: bool = True,
) -> Path:
    """Write a merged model as a Hugging Face ``save_pretrained`` folder, atomically,
    exactly as :func:`stream_merge` writes its output.

    Parameters
    ----------
    result
        From :func:`merge_models`.
    out_dir
        Output folder; must not exist. Written to a temporary folder beside it and
        renamed when complete; on any error nothing is left behind.
    template
        A model (or model folder) of the merged architecture, e.g. the first input model:
        its configuration is written and every merged tensor must fit one of its tensors
        (it is not modified). A sentence-transformers folder's modules are written
        beside the merged encoder.
    head_policy
        ``"keep"``: the model is saved with the first model's head and every model's head
        is written to ``heads/<i>.safetensors``; ``"drop"``: the backbone is saved
        without heads (its class in ``architectures``).
    dtype
        ``"auto"`` (each tensor's dtype in the inputs), ``"float32"``, ``"bfloat16"`` or
        ``"float16"``.
    tokenizer_from
        A model folder whose tokenizer and generation files (and, for a
        sentence-transformers folder, its other modules) are copied (default: the
        template's folder when it is one).
    record
        Extra entries for ``lmdx_merge.json`` (e.g. the resolved config, ``command``).
    task_folders
        Also write ``tasks/<i>/`` for every model's head: a complete ``save_pretrained``
        folder (the merged body, model i's head and labels) that
        ``AutoModelForSequenceClassification.from_pretrained`` loads directly.
    progress
        Show progress bars (transformers' own included).

    Notes
    -----
    The folder also gets a model card (``README.md``: method, options, inputs with their
    content hashes, the command or configuration) and, for a result with a LoRA, the
    adapter folder ``lora/``.
    """
    head_names = list(result.heads[0]) if result.heads else []
    options = MergeOptions.checked(
        2,
        method="average",
        heads=[glob.escape(h) for h in head_names],
        head_policy=head_policy,
        dtype=dtype,
        max_shard_size=max_shard_size,
    )
    out = Path(out_dir)
    if out.exists():
        raise MergeError(f"output {out}: already exists; choose a new directory")
    given = tokenizer_from
    if given is None and isinstance(template, (str, os.PathLike)):
        given = template
    st_files = {} if given is None else _st_files([given], [str(given)])
    folder = None if given is None else model_folder(given)
    if isinstance(template, (str, os.PathLike)):
        template = load_model(template, progress=progress)
    model = StateDictSource.of_model(template, "template")
    merged = StateDictSource(
        result.model_state(0),
        "merged model",
        architecture=model.architecture(),
        config=model.config,
    )
    plan = make_plan([merged], options, None, None, folder=True)
    _check_template(plan, model, options)
    heads = _head_sources(result)
    if task_folders:
        _check_task_folders(plan, options, [h.config for h in heads])
    extra = {**(record or {}), "sentence_transformers": bool(st_files)}
    with FolderSink(out, plan, task_folders=task_folders) as sink:
        run(plan, merged.read, sink, "save merged", progress)
        if result.lora is not None:
            extra["lora"] = result.lora.write(sink.tmp)
        sink.finish(
            heads if options.head_policy == "keep" and any(result.heads) else [],
            output_config(model.config, plan, options),
            folder,
            merge_record(result.report, options, result.inputs, extra),
            {**_generation_config(template), **st_files},
        )
    return out


def _head_sources(result: MergeResult) -> list[StateDictSource]:
    """Every model's head as a source carrying the model's label, path and configuration
    (for ``heads/<i>.json``)."""
    labels = list(result.report.get("models") or [f"model{i}" for i in range(len(result.heads))])
    configs = result.configs or [{} for _ in result.heads]
    if len(labels) != len(result.heads) or len(configs) != len(result.heads):
        raise MergeError(
            f"merge result: {len(result.heads)} heads but {len(labels)} model names and "
            f"{len(configs)} configurations; pass the result of merge_models unchanged"
        )
    out = []
    for label, head, config in zip(labels, result.heads, configs, strict=True):
        path = (result.inputs.get(label) or {}).get("path")
        out.append(
            StateDictSource(
                head,
                label,
                architecture=(config.get("architectures") or [None])[0],
                config=config,
                path=None if path is None else Path(path),
            )
        )
    return out


def _generation_config(model: Any) -> dict[str, str]:
    """``generation_config.json`` of a generative Hugging Face model, as ``save_pretrained``
    writes it (nothing for other models)."""
    config = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", None)
    if config is None or can_generate is None or not can_generate():
        return {}
    return {"generation_config.json": config.to_json_string()}


def _check_template(plan: MergePlan, template: StateDictSource, options: MergeOptions) -> None:
    """Every output tensor fits a tensor of the template model, and every parameter of
    the template gets a merged value."""
    expected = {}
    for n in template.names():
        if options.head_policy == "drop" and plan.base_prefix:
            if not n.startswith(plan.base_prefix + "."):
                continue
            n_out = n.removeprefix(plan.base_prefix + ".")
        else:
            n_out = n
        expected[n_out] = template.shape(n)
    given = {o.name: o.shape for o in plan.outputs}
    unexpected = [n for n in given if n not in expected]
    if unexpected:
        raise MergeError(f"merged tensors do not fit the template model: {unexpected[:3]}")
    for n, shape in given.items():
        if shape != expected[n]:
            raise MergeError(
                f"merged tensors do not fit the template model: {n!r} has shape {shape}, the "
                f"template's {expected[n]}"
            )
    missing = [n for n in expected if n not in given]
    if missing:
        raise MergeError(f"template parameters have no merged value: {missing[:3]}")


def stream_merge(
    models: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    method: str = "regmean",
    *,
    stats: StatsArg = None,
    alpha: float = 1.0,
    coefficients: Sequence[float] | None = None,
    exclude: Sequence[str] = (),
    heads: Sequence[str] = (),
    head_policy: str = "keep",
    base: str | os.PathLike[str] | None = None,
    scaling: float | None = None,
    density: float | None = None,
    seed: int | None = None,
    fisher_eps: float = 1e-8,
    ridge: float = 0.0,
    allow_regularization: bool = True,
    precision: str = "auto",
    dtype: str = "auto",
    max_shard_size: int | str = "2GB",
    labels: Sequence[str] | None = None,
    record: Mapping[str, Any] | None = None,
    lora_rank: int | None = None,
    task_folders: bool = False,
    dry_run: bool = False,
    progress: bool = True,
    n_threads: int | None = None,
    ray_workers: int = 0,
    ray_address: str | None = None,
    data: Sequence[Any] | None = None,
    tokenizer: Any = None,
    max_texts: int | None = None,
    max_length: int = 128,
    batch_size: int = 16,
    max_activation_memory: int | str | None = None,
) -> StreamMergeResult:
    """Merge K checkpoints out of core into a ``save_pretrained`` folder.

    It never loads a whole model: the K checkpoints (folders with ``model.safetensors``
    or ``model.safetensors.index.json`` + shards) are read tensor by tensor, one step at a
    time — a RegMean input group (e.g. q/k/v, which share one Gram: all K models' weights
    for it plus the K Grams) or one averaged tensor — and each result goes straight into
    its output shard. Peak memory is one step's inputs and statistics plus its result,
    independent of depth and of K × model size.

    Parameters are those of :func:`merge_models` and :func:`save_merged` (``models`` and
    ``base`` are model folders: Hugging Face, sentence-transformers or, over ``base``,
    PEFT LoRA adapters; ``lora_rank`` writes the LoRA of the merged update to ``lora/``,
    with its errors in ``lmdx_merge.json``). With ``dry_run=True`` nothing is read beyond headers
    (and, with statistics, the weights they are checked against) and nothing is written:
    the result's ``plan`` says what would be done and how much memory and disk it needs.

    The output folder holds ``config.json`` (the first model's, with ``architectures``
    and the dtype updated as needed), the weights as ``model.safetensors`` or shards of
    at most ``max_shard_size`` with ``model.safetensors.index.json``, the tokenizer
    files, ``heads/<i>.safetensors`` (``head_policy="keep"``), ``tasks/<i>/``
    (``task_folders``), a sentence-transformers model's other modules, ``README.md`` (the
    model card) and ``lmdx_merge.json`` (configuration, per-layer solver information,
    input hashes, peak RSS). It appears only when complete; a full disk is reported
    before any work.

    ``ray_workers > 0`` solves the RegMean groups on that many Ray workers (``lmdx[ray]``;
    ``ray_address`` as in :func:`lmdx.collect_regmean_stats_ray`), a few groups ahead of
    the writer, each worker reading the inputs and statistics itself (on a cluster every
    node must see the same paths; statistics must be files or folders). Averages and the
    writing stay in this process. The output is bit-identical to a run without Ray.

    ``regmean_plusplus`` builds the model's skeleton without weights and loads one block
    of one model at a time from the checkpoints; the merged blocks are written as they
    are finished (the output tensors are ordered block by block). ``data`` and the
    arguments after it are those of :func:`merge_models`, and the output is
    bit-identical to :func:`merge_models` followed by :func:`save_merged`.
    """
    t0 = time.perf_counter()
    models = list(models)
    if ray_workers and method == "regmean_plusplus":
        raise MergeError(
            "ray_workers: regmean_plusplus merges its blocks in order in this process; drop "
            "ray_workers"
        )
    options = MergeOptions.checked(
        len(models),
        method=method,
        alpha=alpha,
        coefficients=coefficients,
        exclude=exclude,
        heads=heads,
        head_policy=head_policy,
        scaling=scaling,
        density=density,
        seed=seed,
        fisher_eps=fisher_eps,
        ridge=ridge,
        allow_regularization=allow_regularization,
        precision=precision,
        dtype=dtype,
        max_shard_size=max_shard_size,
        n_threads=n_threads,
    )
    names = _labels(models, labels)
    out = Path(out_dir)
    if not dry_run and out.exists():
        raise MergeError(f"output {out}: already exists; choose a new directory")
    base_source = None if base is None else Checkpoint(model_folder(base), "base")
    sources = _open_models(
        models, names, base_source, lambda m, lab: Checkpoint(model_folder(m), lab)
    )
    _check_base(sources, base, method)
    st_files = _st_files(models, names)
    adapters = any(isinstance(s, AdapterSource) for s in sources)
    if ray_workers and adapters:
        raise MergeError("ray_workers: not for LoRA adapter inputs; merge them without Ray")
    if ray_workers and not dry_run:
        RayGroupSolver.check_address(ray_address)  # within seconds, before any output
    lora = (
        None if lora_rank is None else LoraExport(check_lora_export(sources, lora_rank), lora_rank)
    )
    stat_objs = open_stats(stats, method, len(models), names)
    arithmetic_base = base_source if method in TASK_VECTOR_METHODS else None
    blocks = _blocks(sources, method, data)
    plan = make_plan(sources, options, stat_objs, arithmetic_base, folder=True, blocks=blocks)
    if task_folders:
        _check_task_folders(plan, options, [src.config for src in sources])
    if dry_run:
        return StreamMergeResult(None, plan, {}, peak_rss_bytes())
    report = _report(plan, options, streaming=True, stats=stat_objs)
    pp_data = _PlusPlusData(
        data, tokenizer, max_texts, max_length, batch_size, max_activation_memory
    )
    merger = _block_merger(sources, plan, options, blocks, pp_data, progress)
    extra = {**(record or {}), "sentence_transformers": bool(st_files)}
    with FolderSink(out, plan, task_folders=task_folders) as sink:
        remote = None
        if ray_workers and method == "regmean":
            remote = _ray_solver(sources, stat_objs, plan, options, ray_workers, ray_address)
            report["ray_workers"] = ray_workers
        try:
            executor = Executor(
                sources,
                stat_objs,
                arithmetic_base,
                plan,
                options,
                report,
                remote,
                blocks=merger,
                lora=lora,
            )
            bar = progress and merger is None  # RegMean++ shows its blocks instead
            run(plan, executor.result, sink, f"merge ({method}, streaming)", bar)
            if merger is not None:
                report["regmean_plusplus"] = merger.summary()
            if lora is not None:
                extra["lora"] = lora.write(sink.tmp)
            report["seconds"] = time.perf_counter() - t0
            report["peak_rss_bytes"] = peak_rss_bytes()
            report["estimated_peak_bytes"] = plan.peak_memory
            sink.finish(
                sources if options.head_policy == "keep" else [],
                output_config(sources[0].config, plan, options),
                _tokenizer_folder(sources[0]),
                merge_record(report, options, _inputs(sources, stat_objs), extra),
                st_files,
            )
        finally:
            if remote is not None:
                remote.close()
    return StreamMergeResult(out, plan, report, peak_rss_bytes())


def _ray_solver(
    sources: Sequence[TensorSource],
    stats: Sequence[Statistics] | None,
    plan: MergePlan,
    options: MergeOptions,
    workers: int,
    address: str | None,
) -> RayGroupSolver:
    assert stats is not None
    paths = [s.source for s in stats]
    if any(p is None or not Path(p).exists() for p in paths):
        raise MergeError("ray_workers: the statistics must be files or folders (paths)")
    return RayGroupSolver(
        [str(Path(str(c.path)).absolute()) for c in sources],
        [str(Path(str(p)).absolute()) for p in paths],
        plan.labels,
        options,
        plan.steps,
        [o.source for o in plan.outputs],
        workers,
        address,
    )
