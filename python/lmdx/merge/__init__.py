"""Merging K models fine-tuned from one checkpoint: RegMean, RegMean++, averaging, Fisher,
task arithmetic, TIES and DARE through one engine, from models in memory or checkpoints on
disk.

The pieces, floor by floor (each imports only the floors below it; the contract in
pyproject.toml): :mod:`~lmdx.merge.method` (what a method is and what it is handed),
:mod:`~lmdx.merge.options` (the options of a merge), :mod:`~lmdx.merge.source` (where
tensors come from), :mod:`~lmdx.merge.lora` (the LoRA of the merged update);
:mod:`~lmdx.merge.plan` (checks, steps, outputs, shards, memory) and
:mod:`~lmdx.merge.inputs` (the inputs opened and checked); the mechanisms RegMean++ runs
its blocks with (:mod:`~lmdx.merge.regmean_plusplus`, :mod:`~lmdx.merge.skeleton`,
:mod:`~lmdx.merge.block_call`, :mod:`~lmdx.merge.block_data`);
:mod:`~lmdx.merge.engine` (runs the steps), :mod:`~lmdx.merge.cost` (what each
task pays), :mod:`~lmdx.merge.ray` (steps on Ray workers), :mod:`~lmdx.merge.door`
(the setup both front doors share),
:mod:`~lmdx.merge.sink` (where tensors go), :mod:`~lmdx.merge.card` (the model card);
:mod:`~lmdx.merge.builtin` (the built-in methods, one file each);
:mod:`~lmdx.merge.registry` (the methods by name, installed ones included);
:mod:`~lmdx.merge.save` (a merged model written as a folder), :mod:`~lmdx.merge.result`
(what the doors return), :mod:`~lmdx.merge.api` (the front doors),
:mod:`~lmdx.merge.state_dicts` (mergekit's in-memory door, ``merge_state_dicts``),
:mod:`~lmdx.merge.load` (a merged folder loaded as one task's model) and
:mod:`~lmdx.merge.config` (merge configuration files).
"""

from __future__ import annotations

from .api import merge_cost, merge_models, stream_merge
from .config import MergeConfig, load_merge_config, plan_merge, run_merge
from .load import load_merged
from .method import MergeMethod, NoOptions
from .options import MergeOptions
from .plan import MergePlan
from .registry import method_names, register_method
from .result import MergeResult, StreamMergeResult
from .save import save_merged
from .state_dicts import merge_state_dicts


def __getattr__(name: str) -> tuple[str, ...]:
    """``METHODS`` (kept for older callers): the names of the registered methods, read
    when asked for (:func:`method_names`)."""
    if name == "METHODS":
        return method_names()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "MergeConfig",
    "MergeMethod",
    "MergeOptions",
    "MergePlan",
    "MergeResult",
    "NoOptions",
    "StreamMergeResult",
    "load_merge_config",
    "load_merged",
    "merge_cost",
    "merge_models",
    "merge_state_dicts",
    "method_names",
    "plan_merge",
    "register_method",
    "run_merge",
    "save_merged",
    "stream_merge",
]
