"""Reading a merged folder back: :func:`load_merged` loads it as task ``i``'s model (the
merged body, model ``i``'s own head from ``heads/<i>.safetensors`` and its labels from
``heads/<i>.json``), checking that the head files belong to this merge."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._errors import MergeError
from .._tensors import to_torch
from ..files.checkpoint import Checkpoint
from ..files.hf import hf_config, hf_progress, load_model, model_class, read_config
from ..files.parse import read_json
from .sink import HEADS_DIR, LABEL_KEYS, head_files, task_config

__all__ = ["load_merged"]


def load_merged(
    path: str | os.PathLike[str], task: int | None = None, *, progress: bool = True
) -> Any:
    """A merged folder as a Hugging Face model, ready to predict for task ``task``.

    Parameters
    ----------
    path
        A folder written by ``lmdx merge``, :func:`stream_merge` or :func:`save_merged`.
    task
        The index of an input model (its place in the merge's ``models``, from 0), when
        the merge kept every model's head: the model returned is the merged body with
        model ``task``'s own head (``heads/<task>.safetensors``) and the labels of its
        configuration (``id2label``, ``label2id``, ``problem_type``; from
        ``heads/<task>.json``). ``None``: the folder as written (model 0's head, when
        the heads were kept; none, when they were dropped).
    progress
        Show transformers' progress bar while loading.

    Returns
    -------
    transformers.PreTrainedModel
        The model, of the class ``config.json`` names (e.g.
        ``BertForSequenceClassification``), in evaluation mode as ``from_pretrained``
        leaves it. A task index the folder has no head for, a missing or altered head
        file, or a head that does not fit the model raises :class:`MergeError` naming the
        file.
    """
    folder = Path(path)
    config = read_config(folder)
    if task is None:
        return load_model(folder, progress=progress)
    if isinstance(task, bool) or not isinstance(task, int):
        raise MergeError(f"task: expected the index of an input model (0, 1, ...), got {task!r}")
    tasks = _kept_heads(folder)
    if task not in tasks:
        raise MergeError(
            f"merged model {folder}: no head for task {task}; it has heads for tasks "
            f"{_ranges(tasks)} (heads/<i>.safetensors, in the order of the merge's models)"
        )
    tensors_file, record_file = head_files(folder, task)
    record = _head_record(record_file)
    if not tensors_file.is_file():
        raise MergeError(f"merged model {folder}: {tensors_file} is missing; copy the whole folder")
    head = Checkpoint(tensors_file, str(tensors_file))
    if sorted(head.names()) != sorted(record["tensors"]):
        raise MergeError(
            f"head {tensors_file}: holds {sorted(head.names())} but {record_file.name} lists "
            f"{sorted(record['tensors'])}; the head files are from different merges"
        )
    body = Checkpoint(folder, str(folder))
    state = {n: to_torch(body.read(n)) for n in body.names()}
    absent = [n for n in record["tensors"] if n not in state]
    if absent:
        raise MergeError(
            f"head {tensors_file}: tensor {absent[0]!r} is not a tensor of the merged model "
            f"{folder}; the head is from another merge"
        )
    state.update({n: to_torch(head.read(n)) for n in head.names()})
    return _from_state(folder, task_config(config, record["config"]), state, progress)


def _kept_heads(folder: Path) -> list[int]:
    """The task indices ``heads/<i>.json`` exists for (:class:`MergeError` for none)."""
    heads = folder / HEADS_DIR
    found = sorted(
        int(p.stem) for p in heads.glob("*.json") if p.stem.isdigit() and p.stem == str(int(p.stem))
    )
    if not found:
        raise MergeError(
            f"merged model {folder}: no task heads kept (no {HEADS_DIR}/<i>.json: merged "
            "without heads patterns, with the head policy drop, or by an older lmdx); "
            "load it without task="
        )
    return found


def _ranges(tasks: Sequence[int]) -> str:
    if tasks == list(range(len(tasks))):
        return f"0..{len(tasks) - 1}"
    return ", ".join(str(t) for t in tasks)


def _head_record(path: Path) -> dict[str, Any]:
    """``heads/<i>.json``, checked: its tensors and label configuration."""
    record = read_json(path, "head record", MergeError)
    config = record.get("config") if isinstance(record, dict) else None
    tensors = record.get("tensors") if isinstance(record, dict) else None
    if not (
        isinstance(record, dict)
        and record.get("format") == "lmdx-head"
        and isinstance(tensors, list)
        and tensors
        and all(isinstance(t, str) for t in tensors)
    ):
        raise MergeError(
            f"head record {path}: not an lmdx head record (format lmdx-head with a list of "
            "tensors); re-run the merge"
        )
    if config is None:
        raise MergeError(
            f"head record {path}: the merge did not know this model's configuration (it was "
            "merged as a state dict), so its labels are unknown; load the merged folder "
            "without task= and put the head of heads/<i>.safetensors in it yourself"
        )
    if not isinstance(config, dict) or set(config) != set(LABEL_KEYS):
        raise MergeError(
            f"head record {path}: config must hold exactly {list(LABEL_KEYS)}; re-run the merge"
        )
    return record


def _from_state(folder: Path, config: dict[str, Any], state: dict[str, Any], progress: bool) -> Any:
    """The model ``config`` describes, with every parameter from ``state``; a parameter
    missing, left over or of another shape is a :class:`MergeError`."""
    cls = model_class(config)
    with hf_progress(progress):
        model, info = cls.from_pretrained(
            None,
            config=hf_config(config, str(folder / "config.json")),
            state_dict=state,
            output_loading_info=True,
        )
    problems = {k: v for k, v in info.items() if v and k != "error_msgs"} | (
        {"errors": info["error_msgs"]} if info.get("error_msgs") else {}
    )
    if problems:
        listing = "; ".join(f"{k} {sorted(map(str, v))[:3]}" for k, v in problems.items())
        raise MergeError(f"merged model {folder}: the weights do not fit its class: {listing}")
    return model
