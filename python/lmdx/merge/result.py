"""What the front doors return: a merged model in memory (:class:`MergeResult`) and a
streaming merge's folder, plan and report (:class:`StreamMergeResult`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .lora import LoraExport
from .plan import MergePlan

__all__ = ["MergeResult", "StreamMergeResult"]


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
