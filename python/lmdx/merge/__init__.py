"""Merging K models fine-tuned from one checkpoint: RegMean, RegMean++, averaging, Fisher,
task arithmetic, TIES and DARE through one engine, from models in memory or checkpoints on
disk.

The pieces, in the order a merge uses them: :mod:`~lmdx.merge.options` (what to do),
:mod:`~lmdx.merge.source` (where tensors come from), :mod:`~lmdx.merge.plan` (checks,
steps, outputs, shards, memory), :mod:`~lmdx.merge.methods` (the arithmetic of one
step), :mod:`~lmdx.merge.engine` (runs the steps), :mod:`~lmdx.merge.sink` (where
tensors go), :mod:`~lmdx.merge.ray` (steps on Ray actors),
:mod:`~lmdx.merge.regmean_plusplus` (RegMean++: the blocks merged in order on Grams taken
through the merged blocks before them), :mod:`~lmdx.merge.api` (the front doors),
:mod:`~lmdx.merge.load` (a merged folder loaded as one task's model) and
:mod:`~lmdx.merge.config` (merge configuration files).
"""

from __future__ import annotations

from .api import (
    MergeResult,
    StreamMergeResult,
    merge_models,
    save_merged,
    stream_merge,
)
from .config import MergeConfig, load_merge_config, plan_merge, run_merge
from .load import load_merged
from .options import METHODS, MergeOptions
from .plan import MergePlan

__all__ = [
    "METHODS",
    "MergeConfig",
    "MergeOptions",
    "MergePlan",
    "MergeResult",
    "StreamMergeResult",
    "load_merge_config",
    "load_merged",
    "merge_models",
    "plan_merge",
    "run_merge",
    "save_merged",
    "stream_merge",
]
