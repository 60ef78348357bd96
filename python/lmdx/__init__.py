"""lmdx: fast, exact linear merging (RegMean) and linear decomposition (LMD) of language
models on CPU, with a C++/Eigen core.

The names here are the public API; the subpackages hold the rest, one concept each:
:mod:`lmdx.stats` (statistics files and their collection), :mod:`lmdx.merge` (the merge
engine and its methods), :mod:`lmdx.lmd` (Language Model Decomposition), :mod:`lmdx.files`
(strict safetensors, checkpoints, atomic outputs), :mod:`lmdx.data` (texts and batches)
and :mod:`lmdx.cli` (the ``lmdx`` command).
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

from ._core import core as _native
from ._errors import (
    DataError,
    DiskFullError,
    LmdxError,
    MergeError,
    ModelMismatchError,
    NotPositiveDefiniteError,
    RayClusterError,
    RegularizationWarning,
    SampleSizeWarning,
    StatisticsFileError,
)
from .config import (  # before lmdx.config, the module
    config,
    default_threads,
    release_memory,
    show_config,
)

if TYPE_CHECKING:
    from . import data, files, lmd, merge, stats
    from .average import fisher_average, weighted_average
    from .data.batches import text_batches
    from .lmd import (
        Decomposition,
        DecompositionResult,
        HFEncoder,
        LMDFit,
        load_pypi_encoder,
        plot_group_r2,
        plot_pairwise_heatmap,
    )
    from .merge import (
        MergeResult,
        StreamMergeResult,
        load_merge_config,
        load_merged,
        merge_models,
        merge_state_dicts,
        plan_merge,
        run_merge,
        save_merged,
        stream_merge,
    )
    from .moments import Moments
    from .regmean import RegMeanResult, regmean_merge_layer
    from .spd import SolveResult, spd_solve
    from .stats import (
        Statistics,
        add_statistics,
        collect_fisher,
        collect_regmean_stats,
        collect_regmean_stats_ray,
        join_statistics,
    )

__version__: str = _native.__version__

#: Where each public name lives: it is imported on first use (``import lmdx`` stays fast,
#: so a command imports only what it runs; ``lmdx stats add`` never imports torch).
_HOMES = {
    **{name: f"lmdx.{name}" for name in ("data", "files", "lmd", "merge", "stats")},
    **dict.fromkeys(("fisher_average", "weighted_average"), "lmdx.average"),
    "text_batches": "lmdx.data.batches",
    **dict.fromkeys(
        (
            "Decomposition",
            "DecompositionResult",
            "HFEncoder",
            "LMDFit",
            "load_pypi_encoder",
            "plot_group_r2",
            "plot_pairwise_heatmap",
        ),
        "lmdx.lmd",
    ),
    **dict.fromkeys(
        (
            "MergeResult",
            "StreamMergeResult",
            "load_merge_config",
            "load_merged",
            "merge_models",
            "merge_state_dicts",
            "plan_merge",
            "run_merge",
            "save_merged",
            "stream_merge",
        ),
        "lmdx.merge",
    ),
    "Moments": "lmdx.moments",
    **dict.fromkeys(("RegMeanResult", "regmean_merge_layer"), "lmdx.regmean"),
    **dict.fromkeys(("SolveResult", "spd_solve"), "lmdx.spd"),
    **dict.fromkeys(
        (
            "Statistics",
            "add_statistics",
            "collect_fisher",
            "collect_regmean_stats",
            "collect_regmean_stats_ray",
            "join_statistics",
        ),
        "lmdx.stats",
    ),
}

__all__ = [
    "DataError",
    "Decomposition",
    "DecompositionResult",
    "DiskFullError",
    "HFEncoder",
    "LMDFit",
    "LmdxError",
    "MergeError",
    "MergeResult",
    "ModelMismatchError",
    "Moments",
    "NotPositiveDefiniteError",
    "RayClusterError",
    "RegMeanResult",
    "RegularizationWarning",
    "SampleSizeWarning",
    "SolveResult",
    "Statistics",
    "StatisticsFileError",
    "StreamMergeResult",
    "__version__",
    "add_statistics",
    "collect_fisher",
    "collect_regmean_stats",
    "collect_regmean_stats_ray",
    "config",
    "data",
    "default_threads",
    "files",
    "fisher_average",
    "join_statistics",
    "lmd",
    "load_merge_config",
    "load_merged",
    "load_pypi_encoder",
    "merge",
    "merge_models",
    "merge_state_dicts",
    "plan_merge",
    "plot_group_r2",
    "plot_pairwise_heatmap",
    "regmean_merge_layer",
    "release_memory",
    "run_merge",
    "save_merged",
    "show_config",
    "spd_solve",
    "stats",
    "stream_merge",
    "text_batches",
    "weighted_average",
]

#: Names that lived here before the subpackages: they still resolve, with a warning that
#: names where they are now (and their new name where they were renamed).
_MOVED = {
    "BlockLayout": "lmdx.lmd.BlockLayout",
    "COMPAT_ALPHA": "lmdx.lmd.COMPAT_RIDGE_ABSOLUTE",
    "Checkpoint": "lmdx.files.Checkpoint",
    "DEFAULT_CHUNK_ROWS": "lmdx.moments.DEFAULT_CHUNK_ROWS",
    "DEFAULT_RHO_GRID": "lmdx.lmd.DEFAULT_RIDGE_GRID",
    "MIN_ROWS_PER_DIM": "lmdx.lmd.MIN_ROWS_PER_DIM",
    "MergePlan": "lmdx.merge.MergePlan",
    "SPLITS": "lmdx.lmd.SPLITS",
    "SplitMoments": "lmdx.lmd.SplitMoments",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is not None:
        module = importlib.import_module(home)
        value = module if home == f"lmdx.{name}" else getattr(module, name)
        globals()[name] = value
        return value
    target = _MOVED.get(name)
    if target is None:
        raise AttributeError(f"module 'lmdx' has no attribute {name!r}")
    warnings.warn(f"lmdx.{name} is now {target}; use that", DeprecationWarning, stacklevel=2)
    home, _, new = target.rpartition(".")
    return getattr(importlib.import_module(home), new)


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
