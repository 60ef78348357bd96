"""Where a merge's tensors go: a dict in memory, or a ``save_pretrained`` folder written
shard by shard that appears only when complete.

:class:`FolderSink` writes the weights as ``model.safetensors`` or shards with
``model.safetensors.index.json`` (names as ``save_pretrained`` writes them), each shard
reserved on disk before it is filled; then every model's head (``heads/<i>.safetensors``,
and its task's labels in ``heads/<i>.json``: :func:`head_record`), ``config.json``
(dtype and, for a dropped head, the backbone's class updated), the tokenizer and
generation files of the first model's folder, ``lmdx_merge.json`` and the model card
``README.md`` (:func:`lmdx.merge.card.model_card`). With task folders, also one complete
``save_pretrained`` folder per kept head, ``tasks/<i>/``: the merged body with model i's
head and labels (:func:`task_config`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

from .._core import core
from .._errors import MergeError
from .._tensors import as_numpy, dtype_name, to_torch
from ..files.atomic import atomic_directory, check_free_space
from ..files.checkpoint import INDEX_FILE
from ..files.hf import copy_model_files
from ..files.safetensors import SafetensorsWriter, TensorSpec, read_safetensors_header
from .card import MODEL_CARD, model_card, task_card
from .method import cast_merged
from .plan import MergePlan
from .source import TensorSource

__all__ = [
    "HEADS_DIR",
    "LABEL_KEYS",
    "MERGE_RECORD",
    "TASKS_DIR",
    "FolderSink",
    "MemorySink",
    "NullSink",
    "head_files",
    "head_record",
    "merge_record",
    "output_config",
    "task_config",
]

#: The folder of a merged model that holds every input model's own task head.
HEADS_DIR = "heads"
MERGE_RECORD = "lmdx_merge.json"  # the merge's record in its output folder
#: The entries of a model's configuration that describe its task head's labels.
LABEL_KEYS = ("id2label", "label2id", "num_labels", "problem_type")
#: ``format`` of ``heads/<i>.json``.
HEAD_FORMAT = "lmdx-head"
#: The folder of a merged model that holds one complete model folder per kept head.
TASKS_DIR = "tasks"


def head_files(folder: Path, task: int) -> tuple[Path, Path]:
    """Model ``task``'s head in merged folder ``folder``: its tensors
    (``heads/<task>.safetensors``) and its record (``heads/<task>.json``)."""
    return folder / HEADS_DIR / f"{task}.safetensors", folder / HEADS_DIR / f"{task}.json"


def head_record(task: int, source: TensorSource, tensors: Sequence[str]) -> dict[str, Any]:
    """The contents of ``heads/<task>.json``: which model the head is from, its tensors,
    and the label entries (:data:`LABEL_KEYS`) of that model's configuration, each
    ``null`` where the configuration does not set it (its class's default applies, as
    when the model's own folder is loaded), or ``config`` ``null`` for a model without a
    configuration (a state dict); ``num_labels`` as well at the top level, where the
    labels say it."""
    config = {k: source.config.get(k) for k in LABEL_KEYS} if source.config else None
    num_labels = None
    if config is not None:
        num_labels = config["num_labels"]
        if num_labels is None and isinstance(config["id2label"], Mapping):
            num_labels = len(config["id2label"])
    return {
        "format": HEAD_FORMAT,
        "format_version": 1,
        "task": task,
        "model": source.label,
        "path": None if source.path is None else os.path.abspath(source.path),
        "architecture": source.architecture(),
        "tensors": list(tensors),
        "num_labels": num_labels,
        "config": config,
    }


def task_config(config: Mapping[str, Any], labels: Mapping[str, Any]) -> dict[str, Any]:
    """The merged model's configuration for one task: ``labels`` (the ``config`` of its
    ``heads/<i>.json``) set, an entry ``None`` there removed (its class's default
    applies, as when that model's own folder is loaded)."""
    out = dict(config)
    for key, value in labels.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


class NullSink:
    """Drops every merged tensor (a merge run for its report alone: ``lmdx merge
    --cost``)."""

    def write(self, index: int, tensor: Any) -> None:
        del index, tensor


class MemorySink:
    """Merged tensors by output name, as torch tensors (the models' own type)."""

    def __init__(self, plan: MergePlan) -> None:
        self.plan = plan
        self.tensors: dict[str, Any] = {}

    def write(self, index: int, tensor: Any) -> None:
        self.tensors[self.plan.outputs[index].name] = to_torch(tensor)


class FolderSink:
    """A ``save_pretrained`` folder at ``out_dir``, written through a temporary folder
    beside it (renamed when :meth:`finish` succeeds; removed on any error, Ctrl-C
    included). Use as a context manager.

    ``task_folders``: also write ``tasks/<i>/`` for every kept head (:meth:`finish`).
    """

    def __init__(self, out_dir: Path, plan: MergePlan, *, task_folders: bool = False) -> None:
        self.out_dir = out_dir
        self.plan = plan
        self.task_folders = task_folders
        copies = 1 + (len(plan.labels) if task_folders else 0)
        check_free_space(out_dir, plan.output_bytes * copies)  # before any work
        self._shard_of = {i: j for j, (_, members) in enumerate(plan.shards) for i in members}
        self._writer: SafetensorsWriter | None = None
        self._left = 0
        self._atomic = atomic_directory(out_dir)
        self.tmp = Path()

    def __enter__(self) -> FolderSink:
        self.tmp = self._atomic.__enter__()
        return self

    def __exit__(
        self,
        typ: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is not None and self._writer is not None:
            self._writer.abort(exc)
        self._atomic.__exit__(typ, exc, tb)

    def write(self, index: int, tensor: Any) -> None:
        """Output ``index`` of the plan (outputs arrive in plan order)."""
        if self._writer is None:
            fname, members = self.plan.shards[self._shard_of[index]]
            specs = [self._spec(i) for i in members]
            self._writer = SafetensorsWriter(self.tmp / fname, specs, {"format": "pt"})
            self._left = len(members)
        out = self.plan.outputs[index]
        if out.dtype != dtype_name(tensor):  # output.dtype: the final cast, checked finite
            tensor = cast_merged(out.name, tensor, out.dtype)
        self._writer.write(out.name, as_numpy(tensor))
        self._left -= 1
        if self._left == 0:
            self._writer.close()
            self._writer = None

    def _spec(self, index: int) -> TensorSpec:
        out = self.plan.outputs[index]
        return TensorSpec(out.name, out.dtype, out.shape)

    def finish(
        self,
        heads: Sequence[TensorSource],
        config: Mapping[str, Any],
        model_folder: Path | None,
        record: Mapping[str, Any],
        files: Mapping[str, str | bytes] | None = None,
    ) -> None:
        """The index, heads, configuration, the tokenizer and generation files of
        ``model_folder``, ``files`` (relative path -> text or bytes) that the folder does
        not provide, the task folders, the record and the model card (made from the
        record)."""
        if len(self.plan.shards) > 1:
            index = {
                out.name: fname
                for fname, members in self.plan.shards
                for out in (self.plan.outputs[i] for i in members)
            }
            meta = {"total_size": sum(o.nbytes for o in self.plan.outputs)}
            (self.tmp / INDEX_FILE).write_text(
                json.dumps({"metadata": meta, "weight_map": index}, indent=2)
            )
        names = self.plan.heads
        if names and heads:
            (self.tmp / HEADS_DIR).mkdir()
            for i, src in enumerate(heads):
                tensors, record_file = head_files(self.tmp, i)
                specs = [TensorSpec(h, src.dtype(h), src.shape(h)) for h in names]
                with SafetensorsWriter(tensors, specs) as w:
                    for h in names:
                        w.write(h, as_numpy(src.read(h)))
                record_file.write_text(
                    json.dumps(head_record(i, src, names), indent=2, sort_keys=True) + "\n"
                )
        if config:
            (self.tmp / "config.json").write_text(
                json.dumps(dict(config), indent=2, sort_keys=True) + "\n"
            )
        if model_folder is not None and model_folder.is_dir():
            copy_model_files(model_folder, self.tmp)
        for fname, data in (files or {}).items():  # what the model folder does not provide
            path = self.tmp / fname
            if path.exists():
                continue
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(data, bytes):
                path.write_bytes(data)
            else:
                path.write_text(data)
        if self.task_folders:
            record = {**record, "task_folders": self._write_tasks(heads, config)}
        (self.tmp / MERGE_RECORD).write_text(json.dumps(dict(record), indent=2, default=str))
        (self.tmp / MODEL_CARD).write_text(model_card(record, config), encoding="utf-8")

    def _write_tasks(self, heads: Sequence[TensorSource], config: Mapping[str, Any]) -> list[str]:
        """``tasks/<i>/`` for every head: the written weights with model i's head instead
        of model 0's (read back shard by shard), config with its labels, the tokenizer
        and generation files, a model card. Returns the folders (relative)."""
        names = set(self.plan.heads)  # kept heads, of models with a configuration: the
        assert names and heads and all(h.config for h in heads)  # front doors check first
        written = {
            fname: read_safetensors_header(self.tmp / fname, "shard", MergeError)
            for fname, _ in self.plan.shards
        }
        folders = []
        for i, src in enumerate(heads):
            folder = self.tmp / TASKS_DIR / str(i)
            folder.mkdir(parents=True)
            total = 0
            for fname, members in self.plan.shards:
                outputs = [self.plan.outputs[j] for j in members]
                specs = [  # a head has model i's shape (its own number of labels)
                    TensorSpec(o.name, o.dtype, src.shape(o.source) if o.name in names else o.shape)
                    for o in outputs
                ]
                total += sum(spec.nbytes for spec in specs)
                with SafetensorsWriter(folder / fname, specs, {"format": "pt"}) as w:
                    for o in outputs:
                        if o.name in names:
                            value = cast_merged(o.name, src.read(o.source), o.dtype)
                            w.write(o.name, value)
                        else:
                            w.write(o.name, written[fname].get_raw(o.name))
            if (self.tmp / INDEX_FILE).is_file():
                index = json.loads((self.tmp / INDEX_FILE).read_text())
                index["metadata"] = {**index.get("metadata", {}), "total_size": total}
                (folder / INDEX_FILE).write_text(json.dumps(index, indent=2))
            labels = head_record(i, src, self.plan.heads)["config"]
            (folder / "config.json").write_text(
                json.dumps(task_config(config, labels), indent=2, sort_keys=True) + "\n"
            )
            copy_model_files(self.tmp, folder)
            card = task_card(i, src.label, task_config(config, labels))
            (folder / MODEL_CARD).write_text(card, encoding="utf-8")
            folders.append(f"{TASKS_DIR}/{i}")
        return folders


def output_config(
    config: Mapping[str, Any], plan: MergePlan, *, dtype: str, head_policy: str
) -> dict[str, Any]:
    """The first model's configuration for the merged folder: the output dtype, and the
    backbone's class when the heads are dropped."""
    cfg = dict(config)
    if not cfg:
        return cfg
    if dtype != "auto":
        key = "torch_dtype" if "torch_dtype" in cfg and "dtype" not in cfg else "dtype"
        cfg[key] = dtype
    if head_policy == "drop" and plan.base_class:
        cfg["architectures"] = [plan.base_class]
    return cfg


def merge_record(
    report: Mapping[str, Any],
    inputs: Mapping[str, Any],
    extra: Mapping[str, Any] | None,
    *,
    dtype: str,
    head_policy: str,
) -> dict[str, Any]:
    """The contents of ``lmdx_merge.json``: version, time, output options, the merge's
    report, the inputs (paths, sizes, statistics hashes) and the caller's ``extra``."""
    return {
        "lmdx_version": core.__version__,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "head_policy": head_policy,
        "dtype": dtype,
        "report": dict(report),
        "inputs": dict(inputs),
        **(dict(extra) if extra else {}),
    }
