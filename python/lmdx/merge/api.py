"""The merge's front doors: models in memory (:func:`merge_models`, then
:func:`lmdx.merge.save.save_merged`) and checkpoints on disk (:func:`stream_merge`). Both
run the same setup (:mod:`lmdx.merge.door`: options, inputs, plan) and the same engine, so
they give bit-identical tensors; they differ only in where tensors come from and go to.

Task heads (``heads`` patterns, e.g. ``classifier.*``) are not merged: each model keeps
its own (:meth:`MergeResult.model_state`, ``heads/<i>.safetensors`` with its labels in
``heads/<i>.json``, and with ``task_folders`` a complete folder ``tasks/<i>/`` each) or
they are dropped. :func:`lmdx.merge.load.load_merged` loads a merged folder as task
``i``'s model: the merged body, model ``i``'s head and labels.

Models may be PEFT LoRA adapter folders over ``base``
(:class:`~lmdx.merge.source.AdapterSource`; RegMean on their factors, :mod:`lmdx.merge.lora`) and
sentence-transformers folders (:mod:`lmdx.files.st`: the Transformer is merged, the
other modules written unchanged beside it).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .._errors import MergeError
from .._util import peak_rss_bytes
from ..files.checkpoint import Checkpoint
from ..files.hf import load_model, model_files
from ..files.peft import is_adapter_folder
from ..files.st import check_same_modules, model_folder, sentence_transformer
from ..stats.file import Statistics
from .builtin import DEFAULT_METHOD
from .cost import cost_mode
from .door import check_new_folder, prepare_merge
from .inputs import inputs_record, model_labels, open_inputs, st_files
from .method import MergeInputs
from .options import MergeOptions, SharedOptions
from .ray import RayGroupSolver
from .registry import merge_options, method_named, methods
from .result import MergeResult, StreamMergeResult
from .save import check_task_folders, save_merged
from .sink import FolderSink, MemorySink, NullSink, merge_record, output_config
from .source import AdapterSource, StateDictSource, TensorSource, model_source

__all__ = [
    "MergeResult",
    "StreamMergeResult",
    "merge_cost",
    "merge_in_memory",
    "merge_models",
    "save_merged",
    "stream_merge",
]

StatsArg = Sequence[Statistics | str | os.PathLike[str] | None] | None


def _door_inputs(
    models: list[Any],
    method: str,
    checked: MergeOptions,
    names: list[str],
    open_model: Callable[[Any, str], TensorSource],
    **given: Any,
) -> MergeInputs:
    """The input step of a front door (:func:`~lmdx.merge.inputs.open_inputs`) for the
    registered ``method``: ``given`` are its ``stats``, ``base``, ``data``, ``tokenizer``,
    ``running`` and ``cost``."""
    return open_inputs(
        models,
        method_named(method),
        checked,
        registered=methods(),
        labels=names,
        open_model=open_model,
        **given,
    )


def merge_models(
    models: Sequence[Any],
    method: str = DEFAULT_METHOD,
    *,
    stats: StatsArg = None,
    base: Any = None,
    labels: Sequence[str] | None = None,
    progress: bool = True,
    data: Sequence[Any] | None = None,
    tokenizer: Any = None,
    cost: bool | str | None = None,
    **options: Any,
) -> MergeResult:
    """Merge K models fine-tuned from one checkpoint, in memory.

    Parameters
    ----------
    models
        K torch modules, state dicts, Hugging Face model folders (sentence-transformers
        folders: their Transformer) or PEFT LoRA adapter folders over ``base``.
    method
        A registered method's name (``lmdx methods`` lists them): ``"regmean"``,
        ``"average"``, ``"fisher"``, a task-vector method: ``"task_arithmetic"``,
        ``"ties"``, ``"dare"`` or ``"dare_ties"`` (see
        :mod:`lmdx.merge.builtin.task_vectors` for the formulas), ``"regmean_plusplus"``
        (RegMean++, :mod:`lmdx.merge.regmean_plusplus`: the blocks merged in order, each
        on Grams taken through the merged blocks before it; needs ``data``, not
        ``stats``), or one installed or registered (:mod:`lmdx.merge.registry`).
    stats
        ``regmean``: K Gram statistics (objects, files or sharded folders), one per model,
        in order; ``fisher``: K Fisher statistics. Each is verified to belong to its model
        (per-tensor content hashes of its weights). ``regmean`` with ``surrogate=True`` and
        ``base``: a None entry gives that model a surrogate Gram from its task vector
        (:mod:`lmdx.merge.surrogate`; at least one model needs its statistics).
    base
        The pre-trained model (a module or folder): the model LoRA adapters in ``models``
        adapt (their statistics must be collected on base + adapter), and the θ_base the
        task-vector methods take their task vectors ``θ_i − θ_base`` against (needed by
        them; refused by the other methods of full models).
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
    cost
        What each task pays (:mod:`lmdx.merge.cost`, ``report["cost"]``): None (default)
        when the method's statistics are Grams, True (Gram ``stats`` needed; a method
        that takes no statistics accepts them for this report alone), False: not. Measured,
        it is an estimate with its standard error (Hutch++, a few percent of the merge's
        time); ``"exact"`` measures it exactly (about as long as a float64 RegMean solve),
        ``"estimate"`` is True.
    options
        The merge's options, each checked by the one model that defines it:

        * the options every merge shares (:class:`lmdx.merge.options.SharedOptions`,
          also the keys of a configuration file): ``coefficients`` (K non-negative
          per-model coefficients; RegMean: multiply the Grams; averages: weights;
          task-vector methods: per task-vector factors, which TIES and DARE-TIES also use
          to elect signs and weight the mean of the agreeing entries), ``exclude``
          (``fnmatch`` patterns of modules RegMean must not solve: averaged), ``heads``
          (``fnmatch`` patterns of task-head parameters: not merged; each model's own is
          kept in :attr:`MergeResult.heads`), ``n_threads``, ``solve_memory`` (memory
          budget of one merge step, ``"8GB"`` or bytes; default ``LMDX_SOLVE_MEMORY`` or
          4 GB: a RegMean group over it is solved in blocks of output rows and a larger
          tensor averaged in blocks of rows, with the same numbers; a group's system,
          about ``(4K + 20)·d²`` bytes for ``d`` inputs, is the least it needs) and
          ``lora_rank`` (also build a rank-r LoRA of the merged update, every model a
          LoRA adapter over ``base``: :attr:`MergeResult.lora`, written by
          :func:`save_merged`); the options of writing a folder are
          :func:`save_merged`'s;
        * the method's own (its pydantic model,
          :attr:`lmdx.merge.method.MergeMethod.options`; ``lmdx methods`` lists them
          for every registered method; those of other methods are refused). Built in,
          e.g.: ``alpha``, ``ridge``, ``allow_regularization`` and ``precision`` for ``regmean`` and
          ``regmean_plusplus`` (``precision="auto"`` solves a layer in float32 where a
          certificate bounds its relative output error by 1e-6, see
          :func:`lmdx.regmean_merge_layer`); ``fisher_eps``; ``scaling``, ``density`` and
          ``seed`` for the task-vector methods; ``max_texts``, ``max_length``,
          ``batch_size`` and ``max_activation_memory`` for ``regmean_plusplus``.

    Returns
    -------
    MergeResult
        ``report["layers"]`` says per RegMean module what was used and the certified
        ``output_error_estimate``, ``report["poorly_determined"]`` lists the systems with
        too few statistics rows per input or a large condition estimate, with what to do;
        ``report["not_solved"]`` the linear weights the statistics could not cover (e.g.
        mixture-of-experts tensors of an interface lmdx does not know), which were
        averaged, with why. LoRA adapters over one base are solved on their factors, in
        float64 (``low_rank`` in the layer's report: the merged update's rank).
    """
    t0 = time.perf_counter()
    models = list(models)
    checked = merge_options(len(models), method, options, writes=False)
    names = model_labels(models, labels)
    opened = _door_inputs(
        models,
        method,
        checked,
        names,
        lambda m, lab: model_source(m, lab, progress=progress),
        stats=stats,
        base=base,
        data=data,
        tokenizer=tokenizer,
        cost=cost_mode(cost)[0] is True,
    )
    prepared = prepare_merge(opened, folder=False, stats=stats, cost=cost)
    inputs, plan = prepared.inputs, prepared.plan
    report = prepared.report(streaming=False)
    sink = MemorySink(plan)
    prepared.run(report, sink, progress)
    sources = inputs.sources
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
    if inputs.lora is not None:  # the folder loads as model 0: its head
        for h, value in head_states[0].items():
            inputs.lora.observe(h, value)
    configs = [dict(src.config) for src in sources]
    return MergeResult(state, head_states, report, inputs_record(inputs), configs, inputs.lora)


def _tokenizer_folder(source: TensorSource) -> Path | None:
    """Where the output's tokenizer files come from: the model's folder (an adapter's,
    if it has them; else its base's)."""
    folder = source.path
    if isinstance(source, AdapterSource) and (folder is None or not model_files(folder)):
        folder = source.base.path
    if folder is None or not folder.is_dir():
        return None
    return model_folder(folder)


def stream_merge(
    models: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    method: str = DEFAULT_METHOD,
    *,
    stats: StatsArg = None,
    base: str | os.PathLike[str] | None = None,
    labels: Sequence[str] | None = None,
    record: Mapping[str, Any] | None = None,
    dry_run: bool = False,
    progress: bool = True,
    ray_workers: int = 0,
    ray_address: str | None = None,
    data: Sequence[Any] | None = None,
    tokenizer: Any = None,
    cost: bool | str | None = None,
    **options: Any,
) -> StreamMergeResult:
    """Merge K checkpoints out of core into a ``save_pretrained`` folder.

    It never loads a whole model: the K checkpoints (folders with ``model.safetensors``
    or ``model.safetensors.index.json`` + shards) are read tensor by tensor, one step at a
    time — a RegMean input group (e.g. q/k/v, which share one Gram: all K models' weights
    for it plus the K Grams) or one averaged tensor — and each result goes straight into
    its output shard. Peak memory is one step's inputs and statistics plus its result,
    independent of depth and of K × model size.

    Parameters are those of :func:`merge_models`, and ``options`` also those of writing a
    folder (:func:`save_merged`'s: ``head_policy``, ``dtype``, ``max_shard_size``,
    ``task_folders``). ``models`` and ``base`` are model folders: Hugging Face,
    sentence-transformers or, over ``base``, PEFT LoRA adapters; ``lora_rank`` writes the
    LoRA of the merged update to ``lora/``, with its errors in ``lmdx_merge.json``. With
    ``dry_run=True`` nothing is read beyond headers (and, with statistics, the weights
    they are checked against) and nothing is written: the result's ``plan`` says what
    would be done and how much memory and disk it needs.

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
    ``cost`` is :func:`merge_models`'s (what each task pays, in ``lmdx_merge.json``).
    """
    t0 = time.perf_counter()
    models = list(models)
    checked = merge_options(len(models), method, options, writes=True)
    head_policy, dtype = checked.heads.policy, checked.output.dtype
    task_folders = checked.heads.per_task_folders
    names = model_labels(models, labels)
    out = Path(out_dir) if dry_run else check_new_folder(out_dir)
    files: dict[str, bytes] = {}

    def door_checks(inputs: MergeInputs) -> None:
        if ray_workers and inputs.method.ray == "refused":
            raise MergeError(
                f"ray_workers: {inputs.method.name} merges in this process; drop ray_workers"
            )
        files.update(st_files(models, names))
        if ray_workers and any(isinstance(s, AdapterSource) for s in inputs.sources):
            raise MergeError("ray_workers: not for LoRA adapter inputs; merge them without Ray")
        if ray_workers and not dry_run:
            RayGroupSolver.check_address(ray_address)  # within seconds, before any output

    opened = _door_inputs(
        models,
        method,
        checked,
        names,
        lambda m, lab: Checkpoint(model_folder(m), lab),
        stats=stats,
        base=base,
        data=data,
        tokenizer=tokenizer,
        running=not dry_run,
        cost=cost_mode(cost)[0] is True,
    )
    prepared = prepare_merge(opened, folder=True, before_plan=door_checks, stats=stats, cost=cost)
    inputs, plan = prepared.inputs, prepared.plan
    if task_folders:
        check_task_folders(plan, head_policy, [src.config for src in inputs.sources])
    if dry_run:
        return StreamMergeResult(None, plan, {}, peak_rss_bytes())
    report = prepared.report(streaming=True)
    extra = {**(record or {}), "sentence_transformers": bool(files)}
    sources = inputs.sources
    with FolderSink(out, plan, task_folders=task_folders) as sink:
        remote = None
        if ray_workers and inputs.method.ray == "groups":
            remote = RayGroupSolver.for_merge(inputs, plan, ray_workers, ray_address)
            report["ray_workers"] = ray_workers
        try:
            prepared.run(report, sink, progress, remote, streaming=True)
            if inputs.lora is not None:
                extra["lora"] = inputs.lora.write(sink.tmp)
            report["seconds"] = time.perf_counter() - t0
            report["peak_rss_bytes"] = peak_rss_bytes()
            report["estimated_peak_bytes"] = plan.peak_memory
            sink.finish(
                sources if head_policy == "keep" else [],
                output_config(sources[0].config, plan, dtype=dtype, head_policy=head_policy),
                _tokenizer_folder(sources[0]),
                merge_record(
                    report, inputs_record(inputs), extra, dtype=dtype, head_policy=head_policy
                ),
                files,
            )
        finally:
            if remote is not None:
                remote.close()
    return StreamMergeResult(out, plan, report, peak_rss_bytes())


def merge_in_memory(
    models: Sequence[str | os.PathLike[str]],
    out_dir: str | os.PathLike[str],
    method: str = DEFAULT_METHOD,
    *,
    stats: StatsArg = None,
    base: str | os.PathLike[str] | None = None,
    labels: Sequence[str] | None = None,
    record: Mapping[str, Any] | None = None,
    progress: bool = True,
    data: Sequence[Any] | None = None,
    tokenizer: Any = None,
    cost: bool | str | None = None,
    **options: Any,
) -> Path:
    """Merge K model folders in memory and write the result as :func:`stream_merge` does
    (``lmdx merge --in-memory``): each model (and ``base``) loaded whole with transformers,
    so that pickle ``.bin`` checkpoints transformers accepts are read too; LoRA adapter
    folders stay folders over the loaded base. Parameters are :func:`stream_merge`'s;
    :func:`merge_models` merges, :func:`save_merged` writes (the options of writing a
    folder go to it). Returns the output folder."""
    out = check_new_folder(out_dir)  # before the models are loaded
    writes = SharedOptions.writing_keywords()
    writing = {k: v for k, v in options.items() if k in writes}
    SharedOptions.for_writing(writing)  # checked before the models are loaded
    merging = {k: v for k, v in options.items() if k not in writes}
    models = list(models)
    names = model_labels(models, labels)
    loaded_base = None if base is None else load_model(base, progress=progress)
    check_same_modules([sentence_transformer(m) for m in models], names)
    loaded = [m if is_adapter_folder(m) else load_model(m, progress=progress) for m in models]
    merged = merge_models(
        loaded,
        method,
        stats=stats,
        base=loaded_base,
        labels=names,
        progress=progress,
        data=data,
        tokenizer=tokenizer,
        cost=cost,
        **merging,
    )
    first = models[0]
    adapter = is_adapter_folder(first)
    template = loaded_base if adapter else loaded[0]
    tokenizers = base if adapter and not model_files(Path(first)) else first
    return save_merged(
        merged,
        out,
        template,
        tokenizer_from=tokenizers,
        record=record,
        progress=progress,
        **writing,
    )


def merge_cost(
    models: Sequence[Any],
    method: str = DEFAULT_METHOD,
    *,
    stats: StatsArg = None,
    base: Any = None,
    labels: Sequence[str] | None = None,
    progress: bool = True,
    data: Sequence[Any] | None = None,
    tokenizer: Any = None,
    cost: str = "estimate",
    **options: Any,
) -> dict[str, Any]:
    """What each task would pay for a candidate merge (``lmdx merge --cost``): the merge
    run as :func:`stream_merge` runs it (model folders read tensor by tensor; models in
    memory as :func:`merge_models` takes them), every merged tensor measured and dropped,
    nothing written. Returns the merge's report, with ``cost``
    (:mod:`lmdx.merge.cost`); ``stats`` are Gram statistics, one per model (a method that
    takes none uses them for this report alone); ``cost`` is ``"estimate"`` or ``"exact"``.
    Parameters are :func:`merge_models`'s; the options of writing a folder are accepted
    and have no effect (the merged tensors are measured in the models' dtype)."""
    t0 = time.perf_counter()
    models = list(models)
    checked = merge_options(len(models), method, options, writes=True)
    names = model_labels(models, labels)

    def open_model(m: Any, label: str) -> TensorSource:
        if isinstance(m, (str, os.PathLike)) and not is_adapter_folder(m):
            return Checkpoint(model_folder(m), label)
        return model_source(m, label, progress=progress)

    opened = _door_inputs(
        models,
        method,
        checked,
        names,
        open_model,
        stats=stats,
        base=base,
        data=data,
        tokenizer=tokenizer,
        cost=True,
    )
    prepared = prepare_merge(opened, folder=False, stats=stats, cost=cost_mode(cost)[1])
    report = prepared.report(streaming=True)
    prepared.run(report, NullSink(), progress, streaming=True, measure_only=True)
    report["seconds"] = time.perf_counter() - t0
    return report
