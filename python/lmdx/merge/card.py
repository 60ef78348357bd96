"""The model card (``README.md``) of a merged folder, written from its record
(``lmdx_merge.json``): the method and its options, the inputs with their content hashes
and statistics, the command or configuration that produced it, and how to load it."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from .._errors import MergeError
from .registry import method_named
from .surrogate import surrogates_line

__all__ = ["MODEL_CARD", "model_card", "task_card"]

MODEL_CARD = "README.md"

#: Report entries every merge shows as its options, where set (then the method's own).
_SHARED = ("coefficients", "exclude", "heads", "head_policy", "dtype")


def _method(name: str) -> tuple[str, tuple[str, ...]]:
    """A method's line (its registered summary) and its options' names; a method not
    registered in this process is named as it is."""
    try:
        found = method_named(name)
    except MergeError:
        return name, ()
    return found.summary, tuple(found.options.model_fields)


def _cell(value: Any) -> str:
    text = "—" if value in (None, "") else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _short(sha: Any) -> str:
    return f"`{sha[:16]}…`" if isinstance(sha, str) and sha else "—"


def _class_name(config: Mapping[str, Any]) -> str:
    archs = config.get("architectures") or []
    return str(archs[0]) if archs else "AutoModel"


def model_card(record: Mapping[str, Any], config: Mapping[str, Any] | None = None) -> str:
    """The ``README.md`` of a merged folder, from its ``lmdx_merge.json`` record and the
    ``config.json`` written beside it."""
    report = record.get("report") or {}
    inputs: Mapping[str, Any] = record.get("inputs") or {}
    method = str(report.get("method"))
    summary, own = _method(method)
    options = {**report, "head_policy": record.get("head_policy"), "dtype": record.get("dtype")}
    merge_config = record.get("config") or {}
    lines = [
        "---",
        "library_name: transformers",
        "tags:",
        "- lmdx",
        "- merge",
        f"- {method}",
        "---",
        "",
        "# Merged model",
        "",
        f"Made by lmdx {record.get('lmdx_version')} on {record.get('created')}: **{method}** "
        f"of {len(inputs)} models — {summary}.",
        "",
        "## Method and options",
        "",
    ]
    for key in (*own, *_SHARED):
        value = options.get(key)
        if value not in (None, [], ()):
            lines.append(f"- `{key}`: {_cell(value)}")
    if report.get("surrogate_stats"):
        lines.append(f"- {_cell(surrogates_line(report['surrogate_stats']))}")
    if report.get("poorly_determined"):
        lines.append(
            f"- {len(report['poorly_determined'])} RegMean system(s) poorly determined "
            f"(listed in `lmdx_merge.json`)"
        )
    lines += [
        "",
        "## Inputs",
        "",
        "Content hashes are SHA-256 over every tensor's BLAKE3 (in name order); the "
        "statistics' over their metadata's and every tensor's, as their file or sharded "
        "folder holds them (`Statistics.content_sha256`).",
        "",
        "| # | model | path | architecture | weights SHA-256 | statistics | statistics SHA-256 |",
        "|---|---|---|---|---|---|---|",
    ]
    for i, (label, entry) in enumerate(inputs.items()):
        path = entry.get("path")
        if entry.get("base"):
            path = f"{path} (LoRA adapter over {entry['base']})"
        lines.append(
            f"| {i} | {_cell(label)} | {_cell(path)} | {_cell(entry.get('architecture'))} | "
            f"{_short(entry.get('weights_sha256'))} | {_cell(entry.get('stats'))} | "
            f"{_short(entry.get('stats_sha256'))} |"
        )
    lines += _cost_section(report.get("cost"))
    lines += ["", "## How it was made", ""]
    if record.get("command"):
        lines += ["```bash", str(record["command"]), "```", ""]
    if merge_config:
        lines += [
            "The merge configuration (paths resolved):",
            "",
            "```json",
            json.dumps(merge_config, indent=2, default=str),
            "```",
            "",
        ]
    if not record.get("command") and not merge_config:
        front = "lmdx.stream_merge" if report.get("streaming") else "lmdx.merge_models"
        lines += [f"From Python ({front} with the options above).", ""]
    lines += _usage(record, _class_name(config or {}), len(inputs))
    return "\n".join(lines) + "\n"


def _cost_section(cost: Mapping[str, Any] | None) -> list[str]:
    """What each task pays (:mod:`lmdx.merge.cost`): per task its mean and worst layers,
    median pull and share, and the flags."""
    if not cost:
        return []
    lines = [
        "",
        "## What each task pays",
        "",
        "Per layer, the relative change of each model's layer outputs on its own statistics, "
        "‖W − W_i‖_Ĝi / ‖W_i‖_Ĝi (per layer in `lmdx_merge.json`, `cost`); pull: how far the "
        "merge moved from the average toward the model; share: its share of the statistics' "
        "scale (medians over layers). "
        + (
            "Measured exactly."
            if cost.get("mode") == "exact"
            else "Estimated (randomized, unbiased): the mean ± its standard error."
        ),
        "",
        "| model | mean | worst layers | pull | share | flagged |",
        "|---|---|---|---|---|---|",
    ]
    for label, t in cost.get("tasks", {}).items():
        mean = "—" if t.get("mean") is None else f"{t['mean']:.4f}"
        if t.get("mean") is not None and t.get("mean_error"):
            mean += f" ± {t['mean_error']:.4f}"
        worst = ", ".join(f"{m} {c:.4f}" for m, c in t.get("worst_layers", []))
        lines.append(
            f"| {_cell(label)} | {mean} | {_cell(worst)} | {t['pull_median']:.2f} | "
            f"{t['share_median']:.2f} | {'**yes**' if t.get('flagged') else 'no'} |"
        )
    for f in cost.get("flagged", []):
        lines += ["", f"**Flagged:** the statistics of {_cell(f['model'])}: {_cell(f['why'])}."]
    if cost.get("accepted"):
        lines += ["", "**Merged although flagged** (`accept_flagged: true`)."]
    return lines


def _usage(record: Mapping[str, Any], cls: str, k: int) -> list[str]:
    report = record.get("report") or {}
    lines = ["## Using it", "", "```python"]
    if record.get("sentence_transformers"):
        lines += [
            "from sentence_transformers import SentenceTransformer",
            "",
            'model = SentenceTransformer("PATH")  # the merged encoder with its modules',
        ]
    else:
        lines += [
            f"from transformers import {cls}",
            "",
            f'model = {cls}.from_pretrained("PATH")  # model 0\'s head, if kept',
        ]
    if report.get("head_tensors") and record.get("head_policy") == "keep":
        lines += [
            "",
            "import lmdx",
            "",
            f"# i = 0..{k - 1}: the merged body with model i's own head and labels",
            'task = lmdx.load_merged("PATH", task=i)',
        ]
    if record.get("task_folders"):
        lines += [
            "",
            f'task = {cls}.from_pretrained("PATH/tasks/i")  # the same, from its own folder',
        ]
    if record.get("lora"):
        lora = record["lora"]
        lines += [
            "",
            "from peft import PeftModel",
            "",
            f'adapted = PeftModel.from_pretrained(base_model, "PATH/{lora["folder"]}")'
            f"  # rank {lora['rank']}",
        ]
    lines += ["```", ""]
    if record.get("lora"):
        lora = record["lora"]
        lines += [
            f"`{lora['folder']}/` is a rank-{lora['rank']} LoRA of the merged update over the "
            f"base model: relative Frobenius error {lora['relative_error']:.3g} over all "
            "adapted weights (per layer in `lmdx_merge.json`).",
            "",
        ]
    return lines


def task_card(task: int, label: str, config: Mapping[str, Any]) -> str:
    """The ``README.md`` of ``tasks/<task>/``: what the folder is and where it comes from
    (``config``: the folder's ``config.json``)."""
    cls = _class_name(config)
    return (
        "---\nlibrary_name: transformers\ntags:\n- lmdx\n- merge\n---\n\n"
        f"# Merged model, task {task}\n\n"
        f"The merged body of the model two folders up (`../../`, whose `README.md` and "
        f"`lmdx_merge.json` say how it was made) with the task head and labels of input "
        f"model {task} ({_cell(label)}):\n\n"
        f"```python\nfrom transformers import {cls}\n\n"
        f'model = {cls}.from_pretrained("PATH")\n```\n'
    )
