"""Merging K models fine-tuned from one checkpoint: RegMean, RegMean++, averaging, Fisher,
task arithmetic, TIES and DARE through one engine, from models in memory or checkpoints on
disk.

The pieces, in the order a merge uses them: :mod:`~lmdx.merge.registry` (the methods,
one registered object each; the built-in ones in :mod:`~lmdx.merge.builtin`),
:mod:`~lmdx.merge.options` (what to do), :mod:`~lmdx.merge.source` (where tensors come
from), :mod:`~lmdx.merge.inputs` (the inputs opened and checked),
:mod:`~lmdx.merge.plan` (checks, steps, outputs, shards, memory),
:mod:`~lmdx.merge.methods` (the arithmetic of one step), :mod:`~lmdx.merge.engine` (runs
the steps), :mod:`~lmdx.merge.sink` (where tensors go), :mod:`~lmdx.merge.ray` (steps on
Ray actors), :mod:`~lmdx.merge.regmean_plusplus` (RegMean++: the blocks merged in order
on Grams taken through the merged blocks before them), :mod:`~lmdx.merge.door` (the
setup both front doors share), :mod:`~lmdx.merge.api` (the front doors),
:mod:`~lmdx.merge.save` (a merged model written as a folder), :mod:`~lmdx.merge.result`
(what they return), :mod:`~lmdx.merge.load` (a merged folder loaded as one task's model)
and :mod:`~lmdx.merge.config` (merge configuration files).
"""

from __future__ import annotations

from .api import merge_models, stream_merge
from .config import MergeConfig, load_merge_config, plan_merge, run_merge
from .load import load_merged
from .options import MergeOptions
from .plan import MergePlan
from .registry import MergeMethod, NoOptions, method_names, register_method
from .result import MergeResult, StreamMergeResult
from .save import save_merged


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
    "merge_models",
    "method_names",
    "plan_merge",
    "register_method",
    "run_merge",
    "save_merged",
    "stream_merge",
]
