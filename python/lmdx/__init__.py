"""lmdx: fast, exact linear merging (RegMean) and linear decomposition (LMD) of language
models on CPU, with a C++/Eigen core."""

from __future__ import annotations

from ._core import core as _native
from ._errors import NotPositiveDefiniteError, RegularizationWarning
from .average import fisher_average, weighted_average
from .capture import collect_fisher, collect_regmean_stats, text_batches
from .config import config, default_threads, show_config
from .decompose import (
    COMPAT_ALPHA,
    DEFAULT_RHO_GRID,
    MIN_ROWS_PER_DIM,
    SPLITS,
    BlockLayout,
    Decomposition,
    DecompositionResult,
    LMDFit,
    SampleSizeWarning,
    SplitMoments,
)
from .distributed import collect_regmean_stats_ray  # imports Ray only when called
from .io import DiskFullError
from .merge import MergeError, MergeResult, merge_models, save_merged
from .merge_config import load_merge_config, plan_merge, run_merge
from .moments import DEFAULT_CHUNK_ROWS, Moments
from .plots import plot_group_r2, plot_pairwise_heatmap
from .regmean import RegMeanResult, regmean_merge_layer
from .spd import SolveResult, spd_solve
from .stats import ModelMismatchError, Statistics, StatisticsFileError, add_statistics
from .stream import Checkpoint, MergePlan, StreamMergeResult, stream_merge

__version__: str = _native.__version__

__all__ = [
    "COMPAT_ALPHA",
    "DEFAULT_CHUNK_ROWS",
    "DEFAULT_RHO_GRID",
    "MIN_ROWS_PER_DIM",
    "SPLITS",
    "BlockLayout",
    "Checkpoint",
    "Decomposition",
    "DecompositionResult",
    "DiskFullError",
    "LMDFit",
    "MergeError",
    "MergePlan",
    "MergeResult",
    "ModelMismatchError",
    "Moments",
    "NotPositiveDefiniteError",
    "RegMeanResult",
    "RegularizationWarning",
    "SampleSizeWarning",
    "SolveResult",
    "SplitMoments",
    "Statistics",
    "StatisticsFileError",
    "StreamMergeResult",
    "__version__",
    "add_statistics",
    "collect_fisher",
    "collect_regmean_stats",
    "collect_regmean_stats_ray",
    "config",
    "default_threads",
    "fisher_average",
    "load_merge_config",
    "merge_models",
    "plan_merge",
    "plot_group_r2",
    "plot_pairwise_heatmap",
    "regmean_merge_layer",
    "run_merge",
    "save_merged",
    "show_config",
    "spd_solve",
    "stream_merge",
    "text_batches",
    "weighted_average",
]
