"""The input step both front doors share: the models opened as tensor sources, the
statistics, base and data a method needs checked against what the method says it takes,
before any work; and the record of the inputs written to ``lmdx_merge.json``."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .._errors import MergeError
from ..files.peft import LoraAdapter, is_adapter_folder
from ..files.st import check_same_modules, sentence_transformer
from ..stats.file import Statistics
from ..stats.join import join_statistics
from .lora import LoraExport, check_lora_export
from .method import MergeInputs, MergeMethod
from .options import MergeOptions
from .plan import content_sha256
from .source import AdapterSource, TensorSource, base_as_named
from .surrogate import SURROGATE_SOURCE, SurrogateStatistics, with_surrogates

__all__ = [
    "check_needs",
    "inputs_record",
    "model_labels",
    "open_inputs",
    "open_stats",
    "st_files",
]


def _door_key(what: str, i: int | None) -> str:
    """How a front door names its argument ``what`` (of model ``i``) in a message."""
    return f"models[{i}]" if what == "models" else what


def check_needs(
    method: MergeMethod,
    registered: Mapping[str, MergeMethod],
    *,
    k: int,
    stats: Sequence[bool] | None,
    base: bool,
    adapters: Sequence[int],
    data: Sequence[bool] | None,
    key: Callable[[str, int | None], str] = _door_key,
    running: bool = True,
    cost: bool = False,
    surrogate: bool = False,
    uses_base: bool = False,
) -> None:
    """That ``method`` gets the statistics, base and data it takes, and nothing else: the
    one check of what a method needs, for the front doors and the configuration files.
    ``stats`` and ``data``: per model, whether it was given (None: not at all); ``base``:
    whether it was given; ``adapters``: the models that are LoRA adapter folders (they need
    the base); ``key(what, i)`` names argument ``what`` (``"stats"``, ``"data"``,
    ``"base"``, ``"models"``) of model ``i`` in the messages (registered: every method, for
    naming the ones that take what was given). Data is needed only to run the merge, not
    to plan it (``running``). With ``cost``, a method that takes no statistics accepts
    them: they are used for what each task pays (:mod:`lmdx.merge.cost`), never by the
    method. With ``surrogate`` (the method's options ask for surrogate statistics,
    :meth:`~lmdx.merge.method.MergeMethod.surrogates`), models without statistics are
    accepted when the base is given and at least one model has them. ``uses_base``: the
    method's options read the base (:meth:`~lmdx.merge.method.MergeMethod.uses_base`), so
    it may be given."""
    name = method.name
    given = list(stats) if stats is not None else [False] * k
    missing = [i for i, has in enumerate(given) if not has]
    if surrogate and missing:
        if len(missing) == k:
            raise MergeError(
                f"{key('stats', 0)}: surrogate statistics need at least one model's own "
                f"{method.stats} statistics (lmdx stats): they set the surrogates' scale"
            )
        if not base:
            raise MergeError(
                f"{key('base', None)}: surrogate statistics of models without their own "
                "(surrogate: true) come from their task vectors: give the pre-trained model "
                "they were fine-tuned from (base)"
            )
    for i, has in enumerate(given):
        if method.stats is not None and not has and not surrogate:
            hint = (
                " (or set surrogate to true and give base: a surrogate Gram from its task vector)"
                if "surrogate" in method.options.model_fields
                else ""
            )
            raise MergeError(
                f"{key('stats', i)}: method {name} needs {method.stats} statistics, one per "
                f"model{hint}"
            )
        if method.stats is None and has and not cost:
            raise MergeError(
                f"{key('stats', i)}: method {name} takes no statistics (Gram statistics "
                "given with cost only report what each task pays)"
            )
    if adapters and not base:
        raise MergeError(
            f"{key('models', adapters[0])}: a LoRA adapter folder needs base (the model "
            "folder it adapts)"
        )
    if method.needs_base and not base:
        raise MergeError(
            f"{key('base', None)}: method {name} needs the pre-trained model the models were "
            "fine-tuned from (base)"
        )
    if base and not method.needs_base and not adapters and not surrogate and not uses_base:
        users = ", ".join(m.name for m in registered.values() if m.needs_base)
        raise MergeError(
            f"{key('base', None)}: used by LoRA adapters (models that are adapter folders) and "
            f"by {users}, not by {name} of full models"
        )
    for i, has in enumerate(list(data) if data is not None else [False] * k):
        if method.takes_data and not has and running:
            raise MergeError(
                f"{key('data', i)}: method {name} needs each model's data (its texts or "
                "batches, in the order of the models): their activations are needed at merge "
                "time"
            )
        if not method.takes_data and has:
            users = ", ".join(m.name for m in registered.values() if m.takes_data)
            raise MergeError(f"{key('data', i)}: only method {users} takes data, not {name}")


def model_labels(models: Sequence[Any], labels: Sequence[str] | None) -> list[str]:
    """The models' names for messages and the report: ``labels``, or their paths (or
    ``model0``...)."""
    if labels is None:
        return [
            str(m) if isinstance(m, (str, os.PathLike)) else f"model{i}"
            for i, m in enumerate(models)
        ]
    if len(labels) != len(models):
        raise MergeError(f"labels: {len(labels)} names for {len(models)} models")
    return list(labels)


def _open_models(
    models: Sequence[Any],
    labels: Sequence[str],
    base: TensorSource | None,
    open_model: Callable[[Any, str], TensorSource],
) -> list[TensorSource]:
    """Every model as a tensor source: a PEFT LoRA adapter folder over ``base``
    (:class:`AdapterSource`), anything else by ``open_model(model, label)``."""
    sources: list[TensorSource] = []
    for m, label in zip(models, labels, strict=True):
        if _is_adapter(m):
            assert base is not None  # checked: check_needs
            sources.append(AdapterSource(base, LoraAdapter.load(m, label), label))
        else:
            sources.append(open_model(m, label))
    return sources


def _is_adapter(model: Any) -> bool:
    return isinstance(model, (str, os.PathLike)) and is_adapter_folder(model)


def open_inputs(
    models: Sequence[Any],
    method: MergeMethod,
    options: MergeOptions,
    *,
    registered: Mapping[str, MergeMethod],
    labels: Sequence[str],
    stats: Sequence[Any] | None,
    base: Any,
    open_model: Callable[[Any, str], TensorSource],
    data: Sequence[Any] | None = None,
    tokenizer: Any = None,
    running: bool = True,
    cost: bool = False,
) -> MergeInputs:
    """The input step: check that ``method`` gets the statistics, base and data it takes,
    and nothing else (:func:`check_needs`; ``registered``: every registered method), then
    open ``models`` (and ``base``) with ``open_model`` and the statistics (``running``:
    the merge will run, not only be planned; ``cost``: statistics a method does not take
    are accepted for :mod:`lmdx.merge.cost`, which opens them)."""
    k = len(models)
    if stats is not None and len(stats) != k:
        raise MergeError(f"stats: {len(stats)} statistics for {k} models")
    if data is not None and len(data) != k:
        raise MergeError(f"data: {len(data)} entries for {k} models")
    surrogate = method.surrogates(options.method_options)
    uses_base = method.uses_base(options.method_options)
    check_needs(
        method,
        registered,
        k=k,
        stats=None if stats is None else [s is not None for s in stats],
        base=base is not None,
        adapters=[i for i, m in enumerate(models) if _is_adapter(m)],
        data=None if data is None else [d is not None for d in data],
        running=running,
        cost=cost,
        surrogate=surrogate,
        uses_base=uses_base,
    )
    base_source = None if base is None else open_model(base, "base")
    sources = _open_models(models, labels, base_source, open_model)
    rank = options.output.lora_rank
    lora = None if rank is None else LoraExport(check_lora_export(sources, rank), rank)
    if (surrogate or (uses_base and not method.needs_base)) and base_source is not None:
        # the base as the models name its tensors (methods that need it do so themselves)
        base_source, _ = base_as_named(base_source, sources[0])
    opened = open_stats(stats, method.stats, labels)
    stat_objs = None
    if opened is not None and any(s is None for s in opened):
        assert base_source is not None  # checked: check_needs (surrogate, base)
        stat_objs = with_surrogates(opened, sources, base_source)
    elif opened is not None:
        stat_objs = [s for s in opened if s is not None]
    inputs = MergeInputs(
        method,
        options,
        sources,
        list(labels),
        stat_objs,
        base_source if method.needs_base or surrogate or uses_base else None,
        data,
        tokenizer,
        lora,
        methods=dict(registered),
    )
    method.check(inputs)
    return inputs


def _opened(stats: Any) -> Statistics:
    """One model's statistics: a :class:`Statistics`, a file or folder, or a list of them
    (parts collected over disjoint modules, :func:`lmdx.stats.join_statistics`)."""
    if isinstance(stats, Statistics):
        return stats
    if isinstance(stats, (list, tuple)):
        return join_statistics([_opened(part) for part in stats])
    return Statistics.load(stats)


def open_stats(
    stats: Sequence[Any] | None, kind: str | None, labels: Sequence[str]
) -> list[Statistics | None] | None:
    """The statistics of ``kind`` a method needs, one per model (None for methods without;
    a None entry for a model given none: :func:`check_needs` has checked which were
    given), loaded and checked for kind and a common padding policy; not yet checked
    against the models."""
    if kind is None or stats is None:
        return None
    objs = [None if s is None else _opened(s) for s in stats]
    for i, (s, lab) in enumerate(zip(objs, labels, strict=True)):
        if s is not None and s.kind != kind:
            raise MergeError(f"stats[{i}] ({s.source or lab}): kind {s.kind!r}, expected {kind!r}")
    if kind == "regmean-gram" and len({s.padding for s in objs if s is not None}) > 1:
        raise MergeError(
            "statistics mix padding policies (excluded and included); collect them all the same way"
        )
    return objs


def st_files(folders: Sequence[Any], labels: Sequence[str]) -> dict[str, bytes]:
    """The sentence-transformers files a merged folder gets (none for other models); the
    models' modules must agree (:func:`lmdx.files.st.check_same_modules`)."""
    found = [
        sentence_transformer(f) if isinstance(f, (str, os.PathLike)) and Path(f).is_dir() else None
        for f in folders
    ]
    check_same_modules(found, labels)
    return {} if found[0] is None else found[0].output_files()


def _stats_sha256(stats: Statistics | None) -> str | None:
    """The loaded statistics' identity (:attr:`lmdx.Statistics.content_sha256`: over the
    content hashes a file or sharded folder holds, each tensor checked whenever read)."""
    return None if stats is None else stats.content_sha256


def _stats_record(stats: Statistics | None) -> str | list[str] | None:
    """Where a model's statistics came from: a file or folder, the parts joined, or its
    task vector (:data:`~lmdx.merge.surrogate.SURROGATE_SOURCE`)."""
    if stats is None:
        return None
    if isinstance(stats, SurrogateStatistics):
        return SURROGATE_SOURCE
    files = stats.files
    return list(files) if files is not None and len(files) > 1 else stats.source


def inputs_record(inputs: MergeInputs) -> dict[str, Any]:
    """Per input model: path (and, for an adapter, its base's), architecture, size,
    content hash (:func:`lmdx.merge.plan.content_sha256`), statistics file and its hash."""
    out = {}
    stats = list(inputs.stats) if inputs.stats else [None] * len(inputs.sources)
    for src, s in zip(inputs.sources, stats, strict=True):
        entry = {
            "path": None if src.path is None else os.path.abspath(src.path),
            "architecture": src.architecture(),
            "bytes": src.total_bytes(),
            "weights_sha256": content_sha256(src),
            "stats": _stats_record(s),
            "stats_sha256": _stats_sha256(s),
        }
        if isinstance(src, AdapterSource):
            base = src.base.path
            entry["base"] = None if base is None else os.path.abspath(base)
        out[src.label] = entry
    return out
