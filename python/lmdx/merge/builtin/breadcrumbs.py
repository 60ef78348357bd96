"""``breadcrumbs`` and ``breadcrumbs_ties`` (Model Breadcrumbs, Davari & Belilovsky,
ECCV 2024, arXiv 2312.06795): each task vector loses its largest and its smallest entries
before task arithmetic (or TIES's sign election).

Per tensor and model, with ``n`` entries: ``kept = int(density × n)`` entries stay, the
``top = int(gamma × n)`` of largest ``|τ_i|`` go (the outliers; the paper's β) and the
``n − kept − top`` of smallest (the paper's γ as a fraction); where ``top`` exceeds
``n − kept`` it is lowered to ``n − kept`` so that ``kept`` entries always stay (mergekit's
``magnitude_outliers``, whose ``density``/``gamma`` parameterisation lmdx takes). Equal
magnitudes are ordered lowest flat index first among the larger, as TIES's trim orders
them. Then ``breadcrumbs``: ``θ_0 + λ Σ c_i τ̂_i``; ``breadcrumbs_ties``: TIES's sign
election and mean of the agreeing entries, ``θ_0 + λ`` times that. Density 1 keeps
everything (task arithmetic, or TIES at density 1).

Defaults: density 0.9 and gamma 0.01 (mergekit's documented example: the top 1 % and
the bottom 9 % dropped; the paper tunes both per setting), λ 0.3 (lmdx's task
arithmetic) for ``breadcrumbs`` and 1 for ``breadcrumbs_ties`` (a mean, as TIES).
"""

from __future__ import annotations

from typing import Annotated, ClassVar

import numpy as np
from numpy.typing import NDArray
from pydantic import Field

from ..method import MergeInputs, NoOptions
from .task_vectors import SCALING, Sparsifier, TaskVectorMethod, largest

__all__ = [
    "Breadcrumbs",
    "BreadcrumbsOptions",
    "BreadcrumbsTies",
    "BreadcrumbsTiesOptions",
    "outlier_trim",
]

_DENSITY = Field(
    gt=0.0,
    le=1.0,
    description="the fraction of each task vector's entries kept (the largest gamma and the "
    "smallest dropped)",
    json_schema_extra={"label": "must be in (0, 1] (the fraction of each task vector kept)"},
)
_GAMMA = Field(
    ge=0.0,
    lt=1.0,
    description="the fraction of each task vector's entries of largest magnitude dropped "
    "(the outliers; the paper's β)",
    json_schema_extra={"label": "must be in [0, 1) (the fraction of largest entries dropped)"},
)


class BreadcrumbsOptions(NoOptions):
    """Breadcrumbs: 90 % kept, the top 1 % dropped, λ 0.3."""

    scaling: Annotated[float, SCALING] = 0.3
    density: Annotated[float, _DENSITY] = 0.9
    gamma: Annotated[float, _GAMMA] = 0.01


class BreadcrumbsTiesOptions(BreadcrumbsOptions):
    """Breadcrumbs with TIES's sign election: λ 1."""

    scaling: Annotated[float, SCALING] = 1.0


def outlier_trim(tau: NDArray[np.float64], density: float, gamma: float) -> NDArray[np.float64]:
    """``tau`` with its ``top`` largest and its smallest entries set to 0, ``int(density ×
    n)`` kept (see the module's description)."""
    n = tau.size
    kept = int(density * n)
    if kept >= n:
        return tau
    top = min(int(gamma * n), n - kept)
    flat = tau.reshape(-1)
    magnitude = np.abs(flat)
    keep = largest(magnitude, top + kept)
    keep &= ~largest(magnitude, top)
    return np.where(keep, flat, 0.0).reshape(tau.shape)


class Breadcrumbs(TaskVectorMethod):
    name: ClassVar[str] = "breadcrumbs"
    summary: ClassVar[str] = (
        "Model Breadcrumbs (Davari & Belilovsky, 2024): per tensor each task vector's "
        "largest (outlier) and smallest entries dropped, then task arithmetic"
    )
    options: ClassVar[type[NoOptions]] = BreadcrumbsOptions
    headline: ClassVar[tuple[str, ...]] = ("density", "gamma", "scaling")

    def sparsifier(self, name: str, inputs: MergeInputs) -> Sparsifier | None:
        own = inputs.options.own(BreadcrumbsOptions)
        return lambda i, tau: outlier_trim(tau, own.density, own.gamma)


class BreadcrumbsTies(Breadcrumbs):
    name: ClassVar[str] = "breadcrumbs_ties"
    summary: ClassVar[str] = (
        "Model Breadcrumbs' masks, then TIES's sign election and mean of the agreeing entries"
    )
    options: ClassVar[type[NoOptions]] = BreadcrumbsTiesOptions
    elects: ClassVar[bool] = True
