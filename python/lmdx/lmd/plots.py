"""Plots of LMD results: the pairwise R² heatmap, the group R² bar chart, and one heatmap
per similarity measure.

matplotlib is optional (``pip install matplotlib``; lmdx's ``lmd`` extra has it). The
figures are built with :class:`matplotlib.figure.Figure` directly, without pyplot, so
they never open a window or change the global backend.
"""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from .results import DecompositionResult
from .similarity_results import ALL_ROWS, HEATMAPS, SimilarityResult

__all__ = ["plot_group_r2", "plot_measure_heatmap", "plot_pairwise_heatmap"]


def _figure(width: float, height: float) -> Any:
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError("lmdx plots need matplotlib: pip install matplotlib") from exc
    return Figure(figsize=(width, height), layout="constrained")


def plot_pairwise_heatmap(
    result: DecompositionResult,
    split: str = "test",
    *,
    path: str | os.PathLike[str] | None = None,
    per_dim: bool = False,
) -> Any:
    """Heatmap of the pairwise R²(target | basis) on ``split``, values annotated.

    Rows (y axis, "target") are the predicted models, columns (x axis, "basis") the
    predicting models, as in :meth:`DecompositionResult.r2_target_by_basis`.

    Returns
    -------
    matplotlib.figure.Figure
        Also saved to ``path`` (PNG at 150 dpi) when given.
    """
    m = result.r2_target_by_basis(split, per_dim=per_dim)
    names = list(result.names)
    k = len(names)
    fig = _figure(1.6 + 0.9 * k, 1.2 + 0.8 * k)
    ax = fig.add_subplot()
    finite = m[np.isfinite(m)]
    low = min(0.0, float(finite.min())) if finite.size else 0.0
    image = ax.imshow(np.ma.masked_invalid(m), cmap="viridis", vmin=low, vmax=1.0)
    ax.set_xticks(range(k), names, rotation=40, ha="right")
    ax.set_yticks(range(k), names)
    ax.set_xlabel("basis (predictor)")
    ax.set_ylabel("target (predicted)")
    kind = "per-dimension mean R²" if per_dim else "pooled R²"
    ax.set_title(f"LMD pairwise {kind}(target | basis)\n{split} split")
    for i in range(k):
        for j in range(k):
            value = m[i, j]
            label = "—" if i == j else ("nan" if not math.isfinite(value) else f"{value:.3f}")
            light = math.isfinite(value) and value < low + 0.6 * (1.0 - low)
            ax.text(j, i, label, ha="center", va="center", color="white" if light else "black")
    fig.colorbar(image, ax=ax, label="R²", shrink=0.8)
    if path is not None:
        fig.savefig(os.fspath(path), dpi=150)
    return fig


def plot_group_r2(
    result: DecompositionResult,
    split: str = "test",
    *,
    path: str | os.PathLike[str] | None = None,
) -> Any:
    """Bar chart of the group R²(model | all other models) on ``split``, with a line at
    their mean, the dependency of the set.

    Returns
    -------
    matplotlib.figure.Figure
        Also saved to ``path`` (PNG at 150 dpi) when given.
    """
    values = result.group_r2(split)
    if not values:
        raise ValueError("plot_group_r2: the result has no group fits (fit(group=True))")
    names = list(values)
    heights = [values[n] for n in names]
    fig = _figure(1.6 + 0.9 * len(names), 4.0)
    ax = fig.add_subplot()
    bars = ax.bar(range(len(names)), heights, color="tab:blue")
    ax.bar_label(bars, labels=[f"{h:.3f}" for h in heights], padding=2)
    dependency = result.dependency(split)
    ax.axhline(
        dependency,
        color="tab:red",
        linestyle="--",
        label=f"dependency of the set = {dependency:.3f}",
    )
    ax.set_xticks(range(len(names)), names, rotation=40, ha="right")
    ax.set_ylabel("R²(model | all other models)")
    ax.set_ylim(min(0.0, min(heights) - 0.1), 1.3)  # room above 1 for the legend
    ax.set_title(f"LMD group R², {split} split")
    ax.legend(loc="upper left")
    if path is not None:
        fig.savefig(os.fspath(path), dpi=150)
    return fig


def plot_measure_heatmap(
    result: SimilarityResult,
    measure: str,
    split: str = ALL_ROWS,
    *,
    path: str | os.PathLike[str] | None = None,
) -> Any:
    """Heatmap of one similarity measure for every pair of models, values annotated.

    ``measure`` is a measure name (``cka``, ``debiased_cka``, ``cca`` (its mean canonical
    correlation), ``svcca``, ``pwcca``, ``procrustes``, ``cv_r2``); ``split`` one of the
    result's splits (``"all"`` by default; ``cv_r2`` spans all rows). Rows are the first
    model of each pair (PWCCA's weights, cv_r2's target).

    Returns
    -------
    matplotlib.figure.Figure
        Also saved to ``path`` (PNG at 150 dpi) when given.
    """
    if measure not in HEATMAPS or measure not in result.measures:
        raise ValueError(
            f"plot_measure_heatmap: no measure {measure!r}; the result has "
            f"{', '.join(result.measures)}"
        )
    table, title, low, high = HEATMAPS[measure]
    m = result.table(table, split)
    names = list(result.names)
    k = len(names)
    fig = _figure(1.6 + 0.9 * k, 1.2 + 0.8 * k)
    ax = fig.add_subplot()
    finite = m[np.isfinite(m)]
    if low is None:
        low = min(0.0, float(finite.min())) if finite.size else 0.0
    image = ax.imshow(np.ma.masked_invalid(m), cmap="viridis", vmin=low, vmax=high)
    ax.set_xticks(range(k), names, rotation=40, ha="right")
    ax.set_yticks(range(k), names)
    where = "all rows (k-fold)" if measure == "cv_r2" else f"{split} rows"
    ax.set_title(f"{title}\n{where}")
    for i in range(k):
        for j in range(k):
            value = m[i, j]
            label = "nan" if not math.isfinite(value) else f"{value:.3f}"
            light = math.isfinite(value) and value < low + 0.6 * (high - low)
            ax.text(j, i, label, ha="center", va="center", color="white" if light else "black")
    fig.colorbar(image, ax=ax, shrink=0.8)
    if path is not None:
        fig.savefig(os.fspath(path), dpi=150)
    return fig
