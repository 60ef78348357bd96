"""Language Model Decomposition (Zhang, EMNLP 2022): moments per split, closed-form fits,
results and tables, sentence encoders, plots."""

from __future__ import annotations

from .decompose import (
    COMPAT_ALPHA,
    DEFAULT_RHO_GRID,
    MIN_ROWS_PER_DIM,
    SPLITS,
    BlockLayout,
    Decomposition,
    DecompositionResult,
    LMDFit,
    SplitMoments,
)
from .encoders import CallableEncoder, HFEncoder
from .plots import plot_group_r2, plot_pairwise_heatmap
from .pypi_models import available_pypi_encoders, load_pypi_encoder

__all__ = [
    "COMPAT_ALPHA",
    "DEFAULT_RHO_GRID",
    "MIN_ROWS_PER_DIM",
    "SPLITS",
    "BlockLayout",
    "CallableEncoder",
    "Decomposition",
    "DecompositionResult",
    "HFEncoder",
    "LMDFit",
    "SplitMoments",
    "available_pypi_encoders",
    "load_pypi_encoder",
    "plot_group_r2",
    "plot_pairwise_heatmap",
]
