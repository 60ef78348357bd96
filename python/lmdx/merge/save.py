"""Writing a merged model in memory (:func:`lmdx.merge_models`'s result) as a
``save_pretrained`` folder, exactly as :func:`lmdx.stream_merge` writes its output."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .._errors import MergeError
from .._util import current_rss_bytes
from ..files.hf import load_model
from ..files.st import model_folder
from .door import check_new_folder
from .engine import run
from .inputs import st_files
from .options import SharedOptions
from .plan import MergePlan, plan_outputs
from .result import MergeResult
from .sink import FolderSink, merge_record, output_config
from .source import StateDictSource

__all__ = ["check_task_folders", "save_merged", "saved_plan"]


def save_merged(
    result: MergeResult,
    out_dir: str | os.PathLike[str],
    template: Any,
    *,
    tokenizer_from: str | os.PathLike[str] | None = None,
    record: Mapping[str, Any] | None = None,
    progress: bool = True,
    **options: Any,
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
    tokenizer_from
        A model folder whose tokenizer and generation files (and, for a
        sentence-transformers folder, its other modules) are copied (default: the
        template's folder when it is one).
    record
        Extra entries for ``lmdx_merge.json`` (e.g. the resolved config, ``command``).
    progress
        Show progress bars (transformers' own included).
    options
        The options of writing a folder
        (:meth:`lmdx.merge.options.SharedOptions.for_writing`): ``head_policy``
        (``"keep"``: the model is saved with the first model's head and every model's
        head is written to ``heads/<i>.safetensors``;
        ``"drop"``: the backbone is saved without heads, its class in ``architectures``),
        ``dtype`` (``"auto"``: each tensor's dtype in the inputs; ``"float32"``,
        ``"bfloat16"`` or ``"float16"``), ``max_shard_size`` and ``task_folders`` (also
        write ``tasks/<i>/`` for every model's head: a complete ``save_pretrained`` folder,
        the merged body with model i's head and labels, that
        ``AutoModelForSequenceClassification.from_pretrained`` loads directly).

    Notes
    -----
    The folder also gets a model card (``README.md``: method, options, inputs with their
    content hashes, the command or configuration) and, for a result with a LoRA, the
    adapter folder ``lora/``.
    """
    out = check_new_folder(out_dir)
    writing = SharedOptions.for_writing(options)
    head_policy, task_folders = writing.heads.policy, writing.heads.per_task_folders
    dtype, shard = writing.output.dtype, writing.output.max_shard_size
    given = tokenizer_from
    if given is None and isinstance(template, (str, os.PathLike)):
        given = template
    st = {} if given is None else st_files([given], [str(given)])
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
    plan = saved_plan(merged, result, head_policy, dtype, shard)
    _check_template(plan, model, head_policy)
    heads = _head_sources(result)
    if task_folders:
        check_task_folders(plan, head_policy, [h.config for h in heads])
    extra = {**(record or {}), "sentence_transformers": bool(st)}
    with FolderSink(out, plan, task_folders=task_folders) as sink:
        run(plan, merged.read, sink, "save merged", progress)
        if result.lora is not None:
            extra["lora"] = result.lora.write(sink.tmp)
        sink.finish(
            heads if head_policy == "keep" and any(result.heads) else [],
            output_config(model.config, plan, dtype=dtype, head_policy=head_policy),
            folder,
            merge_record(result.report, result.inputs, extra, dtype=dtype, head_policy=head_policy),
            {**_generation_config(template), **st},
        )
    return out


def saved_plan(
    merged: StateDictSource, result: MergeResult, head_policy: str, dtype: str, shard: int
) -> MergePlan:
    """The plan of writing a merged state as it is: its own tensor names (the heads:
    those of ``result.heads``), no arithmetic."""
    names = merged.names()
    head_set = set(result.heads[0]) if result.heads else set()
    head_names = [n for n in names if n in head_set]
    outputs, shards, prefix, base_class = plan_outputs(
        merged,
        names,
        head_names,
        folder=True,
        head_policy=head_policy,
        dtype=dtype,
        max_shard_size=shard,
    )
    output_bytes = sum(o.nbytes for o in outputs)
    if head_policy == "keep":
        output_bytes += sum(merged.nbytes(h) for h in head_names)
    return MergePlan(
        method=str(result.report.get("method")),
        labels=[merged.label],
        steps=[],
        outputs=outputs,
        shards=shards,
        heads=head_names,
        tied=merged.aliases(),
        input_bytes=merged.total_bytes(),
        output_bytes=output_bytes,
        baseline_rss=current_rss_bytes(),
        base_class=base_class,
        base_prefix=prefix,
    )


def check_task_folders(
    plan: MergePlan, head_policy: str, configs: Sequence[Mapping[str, Any]]
) -> None:
    """Per-task folders need kept heads of models with a configuration (checked before
    any work)."""
    if head_policy != "keep" or not plan.heads:
        raise MergeError(
            "per-task folders: the merge kept no task heads (give heads patterns and the head "
            "policy keep)"
        )
    if not all(configs):
        raise MergeError(
            "per-task folders: a model without a configuration (a state dict) has no labels"
        )


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


def _check_template(plan: MergePlan, template: StateDictSource, head_policy: str) -> None:
    """Every output tensor fits a tensor of the template model, and every parameter of
    the template gets a merged value."""
    expected = {}
    for n in template.names():
        if head_policy == "drop" and plan.base_prefix:
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
