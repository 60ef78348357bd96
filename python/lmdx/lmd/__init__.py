"""Language Model Decomposition (LMD; Zhang, EMNLP 2022, arXiv 2210.10289) from moments.

A target model's sentence embeddings ``u(x)`` (``D_u`` numbers) are regressed on the
stacked embeddings of basis models ``z(x) = [v_1(x); …; v_k(x)]`` (``D_z`` numbers;
hidden sizes may differ)::

    W = Σ_uz (Σ_zz + λI)⁻¹,    b = E[u] − W E[z]
    R²(u | z) = 1 − SSR / SST      (pooled over the target's dimensions)

Nothing here keeps embeddings. Each split (``train``, ``validation``, ``test``) holds one
streaming :class:`lmdx.Moments` of the concatenated embeddings ``[f_1(x); …; f_m(x)]``
(:class:`SplitMoments`), and every quantity is a function of those moments:

* the fit uses the train split's mean and centered covariance Σ;
* a split with mean μ and centered covariance S (both over that split's own rows,
  ``ddof=0``) scores a fit ``(W, b)`` as::

      SSR/n = tr(S_uu) − 2 tr(W S_zu) + tr(W S_zz Wᵀ) + ‖μ_u − W μ_z − b‖²
      SST/n = tr(S_uu)

  so SST is centered on the scored split's own mean (the usual held-out R²; it can be
  negative). Besides the pooled, variance-weighted R² of the paper, the average of the
  per-dimension R² values ``1 − SSR_j/SST_j`` is reported (dimensions with zero variance
  on the scored split are left out of that average). A pooled R² with SST = 0 is NaN.

Conventions of the two modes
----------------------------
``"default"``
    Population moments (``ddof=0``). The ridge is relative to the basis scale,
    ``λ = ρ·tr(Σ_zz)/D_z`` (the mean eigenvalue of Σ_zz), so ρ means the same thing for
    any embedding scale or basis size, as the relative ``ridge`` of
    :func:`lmdx.spd_solve` does; ρ is fixed (``ridge=``) or chosen per fit on the
    validation split from a grid (``ridge_grid=``, default :data:`DEFAULT_RIDGE_GRID`).
``"compat"``
    The reference code's conventions (haozhg/lmd): sample covariances with N − 1, an
    absolute ridge (the reference's ``α``; ``ridge_absolute=``, default
    :data:`COMPAT_RIDGE_ABSOLUTE` = 1e-6) added to the diagonal of Σ_zz, the same W and
    b, pooled R². Differences from the default mode: the ridge does not follow the
    embedding scale (1e-6 is negligible for embeddings of unit scale but dominant for
    embeddings of scale 1e-3), it is never tuned, and with N − 1 the effective
    population-scale ridge is α·(N−1)/N. lmdx computes in float64 where the reference
    uses float32, so numbers agree to float32 accuracy. Orientation of the reference's
    pairwise CSV files is basis (row) × target (column); lmdx names both columns
    explicitly instead. (These are the conventions stated for the reference in the
    project's design notes. Early revisions of its ``lmd/cli.py`` differ: uncentered
    second moments divided by the stacked dimension rather than N, no intercept, and an
    uncentered SST.)

The relative ridge was called ``rho`` (grid ``rho_grid``, ``DEFAULT_RHO_GRID``) and
the absolute one ``alpha`` (``COMPAT_ALPHA``); those names still work and warn (see
:mod:`lmdx.lmd.names`). The files keep them: ``rho``, ``rho_scores``, ``lambda`` and
``regularization.rho_grid``/``alpha`` in result.json and results.csv, ``--rho`` and
``--rho-grid`` on the command line (also spelled ``--ridge`` and ``--ridge-grid``).

Modules, one concept each: :mod:`~lmdx.lmd.split_moments` (moments per split, and how float32
embeddings keep an accurate covariance), :mod:`~lmdx.lmd.fit` (the closed-form fits;
all group fits from one factorization), :mod:`~lmdx.lmd.results` (tables, JSON and
CSV), :mod:`~lmdx.lmd.decompose` (:class:`Decomposition`, the front door),
:mod:`~lmdx.lmd.encoders` and :mod:`~lmdx.lmd.pypi_models` (sentence encoders),
:mod:`~lmdx.lmd.plots`; the representation-similarity measures of the same pass:
:mod:`~lmdx.lmd.similarity` (CKA, debiased CKA, CCA, SVCCA, PWCCA, Procrustes),
:mod:`~lmdx.lmd.norm_moments` (the norm sums debiased CKA needs),
:mod:`~lmdx.lmd.cross_validation` (k-fold R²), :mod:`~lmdx.lmd.similarity_results`.
"""

from __future__ import annotations

from typing import Any

from .decompose import Decomposition
from .encoders import CallableEncoder, HFEncoder
from .fit import COMPAT_RIDGE_ABSOLUTE, DEFAULT_RIDGE_GRID, MIN_ROWS_PER_DIM
from .names import new_name
from .plots import plot_group_r2, plot_measure_heatmap, plot_pairwise_heatmap
from .pypi_models import available_pypi_encoders, load_pypi_encoder
from .results import DecompositionResult, LMDFit
from .similarity import CHEAP_MEASURES, MEASURES
from .similarity_results import SimilarityResult
from .split_moments import SPLITS, BlockLayout, SplitMoments

__all__ = [
    "CHEAP_MEASURES",
    "COMPAT_RIDGE_ABSOLUTE",
    "DEFAULT_RIDGE_GRID",
    "MEASURES",
    "MIN_ROWS_PER_DIM",
    "SPLITS",
    "BlockLayout",
    "CallableEncoder",
    "Decomposition",
    "DecompositionResult",
    "HFEncoder",
    "LMDFit",
    "SimilarityResult",
    "SplitMoments",
    "available_pypi_encoders",
    "load_pypi_encoder",
    "plot_group_r2",
    "plot_measure_heatmap",
    "plot_pairwise_heatmap",
]

#: Deprecated names of this package's constants (their new names: lmdx.lmd.names.RENAMED).
_RENAMED_HERE = ("COMPAT_ALPHA", "DEFAULT_RHO_GRID")


def __getattr__(name: str) -> Any:
    if name in _RENAMED_HERE:
        return globals()[new_name(name, __name__)]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
