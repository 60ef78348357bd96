"""Merging K models fine-tuned from one checkpoint: RegMean, averaging, Fisher and task
arithmetic through one engine, from models in memory or checkpoints on disk."""

from __future__ import annotations

from .config import MergeConfig, load_merge_config, plan_merge, run_merge
from .memory import METHODS, MergeResult, merge_models, save_merged
from .stream import MergePlan, StreamMergeResult, stream_merge

__all__ = [
    "METHODS",
    "MergeConfig",
    "MergePlan",
    "MergeResult",
    "StreamMergeResult",
    "load_merge_config",
    "merge_models",
    "plan_merge",
    "run_merge",
    "save_merged",
    "stream_merge",
]
