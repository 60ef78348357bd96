"""Representation-similarity measures of every pair of models, exact, from the streamed
moments of one split (no embedding matrix is kept).

Everything here is a function of the split's count n, its centered population covariance
``C`` (ddof = 0) of the concatenated embeddings (blocks ``C_xx``, ``C_xy``, ``C_yy`` for two
models x and y of widths p and q), and, for debiased CKA, the sums of products of
squared norms of the centered rows (:class:`~lmdx.lmd.norm_moments.NormMoments`).

Measures
--------
``cka``
    Linear CKA in its feature-space form on centered embeddings (Kornblith et al. 2019)::

        CKA = ‖C_xy‖²_F / (‖C_xx‖_F ‖C_yy‖_F)

``debiased_cka``
    The same ratio with each HSIC replaced by the unbiased estimator of Song et al.
    (2012) on linear kernels ``K = X Xᵀ``, ``L = Y Yᵀ`` (rows x_t, y_t)::

        HSIC_u = [tr(K̃L̃) + (1ᵀK̃1)(1ᵀL̃1)/((n−1)(n−2)) − 2·1ᵀK̃L̃1/(n−2)] / (n(n−3))

    with K̃, L̃ the kernels with zeroed diagonals. Derivation from moments: with
    ``a_t = ‖x_t‖²``, ``b_t = ‖y_t‖²``, ``s_x = Σ x_t``, ``s_y = Σ y_t``,

    * ``tr(K̃L̃) = Σ_{t≠u} (x_tᵀx_u)(y_tᵀy_u) = ‖XᵀY‖²_F − Σ a_t b_t``,
    * ``1ᵀK̃1 = ‖s_x‖² − Σ a_t``,
    * ``1ᵀK̃L̃1 = Σ_t (x_tᵀs_x − a_t)(y_tᵀs_y − b_t)
      = s_xᵀ XᵀY s_y − s_xᵀ Σ b_t x_t − s_yᵀ Σ a_t y_t + Σ a_t b_t``.

    The estimator does not change when the rows are translated (a linear kernel then
    gains ``f(t) + f(u) + c``, which the U-centering behind it removes), so it is evaluated
    on rows centered on the split mean, where ``s_x = s_y = 0``, ``XᵀY = n C_xy`` and
    ``Σ a_t = n tr C_xx``. Dividing by n² (a common factor of all three HSICs)::

        h_xy = ‖C_xy‖²_F + tr C_xx · tr C_yy / ((n−1)(n−2)) − q_xy / (n−2)

    with ``q_xy = Σ_t ‖x_t − x̄‖² ‖y_t − ȳ‖² / n``; debiased CKA = ``h_xy / √(h_xx h_yy)``.
    ``q`` comes exactly from the streamed, shifted sums Σ‖x‖², Σ‖x‖⁴, Σ‖x‖²x, Σ‖x‖²‖y‖²
    and Σ‖x‖²y (:meth:`NormMoments.shifted`). Needs n ≥ 4; it can be negative.
``cca``
    All canonical correlations ρ_1 ≥ … ≥ ρ_r (r = min of the two ranks): the singular
    values of ``W_xᵀ C_xy W_y`` with ``W = V Λ^{-1/2}`` over the eigenpairs of ``C_xx``
    (``C_yy``) above the rank tolerance. Summaries: ``cca_mean`` (mean ρ), ``cca_r2``
    (R²_CCA, mean ρ²) and ``pillai`` (Pillai's trace, Σ ρ²).
``svcca``
    Mean canonical correlation after keeping, for each model, the leading principal
    directions of C_xx that explain the fraction ``svcca_variance`` (default 0.99) of
    its variance (Raghu et al. 2017): the smallest k with ``Σ_{i≤k} λ_i ≥ f·Σ λ_i``.
``pwcca``
    Projection-weighted mean canonical correlation (Morcos et al. 2018), ordered: the
    weights come from the row model x. With ``h_i = X̄ w_i`` the i-th canonical variate
    of x (unit variance) and ``x̄_j`` x's centered neurons,
    ``α_i = Σ_j |⟨h_i, x̄_j⟩| = n Σ_j |(C_xx w_i)_j| = n Σ_j |(V Λ^{1/2} u_i)_j|``;
    PWCCA(x → y) = ``Σ α_i ρ_i / Σ α_i``.
``procrustes``
    Squared orthogonal Procrustes distance between the centered embeddings, each
    divided by its Frobenius norm (Ding et al. 2021); the narrower one is padded with
    zero columns, so::

        d² = min_Q ‖X̂ − ŶQ‖²_F = 2 − 2 ‖C_xy‖_* / √(tr C_xx · tr C_yy)

    in [0, 2]; 0 when y is an orthogonal transform of a multiple of x.

Conventions
-----------
Centering: every measure is computed about the split's own mean. Normalisation: CKA,
debiased CKA and Procrustes are invariant to isotropic scaling; CCA, SVCCA and PWCCA to
any invertible linear map of full-rank embeddings. Regularisation: none is needed for
CKA, debiased CKA and Procrustes; the CCA family truncates the rank — eigenvalues of
C_xx at or below ``rank_tol`` (default :data:`RANK_TOL` = 1e-10) times the largest are
treated as absent directions (no ridge, so the correlations stay exact for exactly
rank-deficient embeddings).

Edge cases are named in the notes, not raised: a constant embedding (every measure
NaN for its pairs), n < 4 (debiased CKA NaN), and n − 1 < rank_x + rank_y, where the CCA
family is degenerate (at least rank_x + rank_y − (n − 1) canonical correlations are 1
whatever the models, e.g. when n is smaller than the width). The diagonal of every table
(a model with itself) is set to its exact value — CKA, debiased CKA, mean ρ, SVCCA and
PWCCA 1, Procrustes 0, every canonical correlation 1 — rather than computed; two copies of
one model under different names are computed like any pair. PWCCA's weights are not unique
where canonical correlations repeat (several zeros, say); its value then depends on the
basis the SVD returns.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
from numpy.typing import NDArray

from .norm_moments import NormMoments
from .split_moments import BlockLayout, SplitMoments

__all__ = [
    "CHEAP_MEASURES",
    "MEASURES",
    "RANK_TOL",
    "SVCCA_VARIANCE",
    "TABLES",
    "SplitSimilarity",
    "moments_similarity",
    "parse_measures",
    "split_similarity",
]

#: Every measure name, with what it is (see the module notes).
MEASURES: dict[str, str] = {
    "cka": "linear CKA, centered, feature-space form",
    "debiased_cka": "linear CKA with the unbiased HSIC estimator (Song et al. 2012)",
    "cca": "all canonical correlations; mean, R²_CCA (mean ρ²) and Pillai's trace (Σ ρ²)",
    "svcca": "mean canonical correlation after PCA of each model to a variance fraction",
    "pwcca": "projection-weighted mean canonical correlation, weights from the row model",
    "procrustes": "squared orthogonal Procrustes distance of centered, Frobenius-normalised "
    "embeddings",
    "cv_r2": "k-fold cross-validated LMD R² (pairwise and group), mean and spread over folds",
}

#: The measures computed by default: all but ``cv_r2``, which keeps one D × D Gram per fold.
CHEAP_MEASURES: tuple[str, ...] = ("cka", "debiased_cka", "cca", "svcca", "pwcca", "procrustes")

#: The (m, m) tables each measure of one split fills (``cv_r2`` has its own result).
TABLES: dict[str, tuple[str, ...]] = {
    "cka": ("cka",),
    "debiased_cka": ("debiased_cka",),
    "cca": ("cca_mean", "cca_r2", "pillai"),
    "svcca": ("svcca",),
    "pwcca": ("pwcca",),
    "procrustes": ("procrustes",),
}

#: Eigenvalues of a model's covariance at or below RANK_TOL × the largest are dropped by
#: the CCA family.
RANK_TOL: float = 1e-10

#: Variance fraction SVCCA keeps of each model.
SVCCA_VARIANCE: float = 0.99

Array = NDArray[np.float64]


def parse_measures(spec: str | Sequence[str] | None) -> tuple[str, ...]:
    """Measure names from ``"all"``, a comma/space separated string or a list (None: the
    cheap ones, :data:`CHEAP_MEASURES`), in :data:`MEASURES` order; ValueError naming an
    unknown one."""
    if spec is None:
        return CHEAP_MEASURES
    items = spec.replace(",", " ").split() if isinstance(spec, str) else [str(s) for s in spec]
    chosen: set[str] = set()
    for item in items:
        name = item.strip().lower()
        if name == "all":
            chosen.update(MEASURES)
        elif name in MEASURES:
            chosen.add(name)
        elif name:
            raise ValueError(
                f"measures: unknown measure {item!r}; use 'all' or any of {', '.join(MEASURES)}"
            )
    return tuple(m for m in MEASURES if m in chosen)


@dataclass(frozen=True)
class _Spectrum:
    """Eigenpairs of one model's covariance, largest first, above the rank tolerance."""

    values: Array
    vectors: Array
    trace: float
    frob: float

    @property
    def rank(self) -> int:
        return len(self.values)

    def leading(self, fraction: float) -> _Spectrum:
        """The leading eigenpairs explaining ``fraction`` of the variance."""
        if self.rank == 0:
            return self
        cum = np.cumsum(self.values)
        k = int(np.searchsorted(cum, fraction * cum[-1], side="left")) + 1
        k = min(k, self.rank)
        return _Spectrum(self.values[:k], self.vectors[:, :k], self.trace, self.frob)


def _spectrum(cov: Array, rank_tol: float) -> _Spectrum:
    values, vectors = np.linalg.eigh(cov)
    values, vectors = values[::-1], vectors[:, ::-1]
    top = float(values[0]) if values.size else 0.0
    keep = values > rank_tol * top if top > 0 else np.zeros(values.shape, dtype=bool)
    return _Spectrum(
        np.ascontiguousarray(values[keep]),
        np.ascontiguousarray(vectors[:, keep]),
        float(np.trace(cov)),
        float(np.linalg.norm(cov)),
    )


@dataclass(frozen=True)
class _Canonical:
    """Canonical correlations of x and y and the PWCCA weights of each side."""

    rho: Array
    weights_x: Array
    weights_y: Array


def _canonical(cxy: Array, sx: _Spectrum, sy: _Spectrum, *, weights: bool) -> _Canonical:
    """Canonical correlations, and (``weights``) the PWCCA weights of each side."""
    wx = sx.vectors / np.sqrt(sx.values)
    wy = sy.vectors / np.sqrt(sy.values)
    whitened = wx.T @ cxy @ wy
    if not weights:
        rho = np.minimum(np.linalg.svd(whitened, compute_uv=False), 1.0)
        return _Canonical(rho, np.empty(0), np.empty(0))
    u, rho, vt = np.linalg.svd(whitened, full_matrices=False)
    r = len(rho)
    # C_xx w_i = V Λ^{1/2} u_i: the canonical variate's inner products with x's neurons.
    load_x = (sx.vectors * np.sqrt(sx.values)) @ u[:, :r]
    load_y = (sy.vectors * np.sqrt(sy.values)) @ vt[:r].T
    return _Canonical(np.minimum(rho, 1.0), np.abs(load_x).sum(axis=0), np.abs(load_y).sum(axis=0))


def _weighted(weights: Array, rho: Array) -> float:
    total = float(weights.sum())
    return float(weights @ rho) / total if total > 0 else math.nan


@dataclass(frozen=True)
class SplitSimilarity:
    """The similarity tables of one split (or of all rows together).

    Attributes
    ----------
    n
        Rows.
    tables
        Table name (see :data:`TABLES`) → (m, m) matrix; entry [i, j] compares model i
        (row) with model j (column). All are symmetric except ``pwcca`` (weights from the
        row model). The diagonal compares each model with itself.
    correlations
        ``"cca"`` and ``"svcca"`` → {(model i, model j): canonical correlations,
        descending} for i ≤ j in model order.
    ranks, svcca_dims
        Per model: the rank the CCA family used and the principal directions SVCCA kept.
    notes
        Edge cases met on this split, one sentence each.
    """

    n: int
    tables: dict[str, Array]
    correlations: dict[str, dict[tuple[str, str], Array]] = field(default_factory=dict)
    ranks: dict[str, int] = field(default_factory=dict)
    svcca_dims: dict[str, int] = field(default_factory=dict)
    notes: tuple[str, ...] = ()


def split_similarity(
    layout: BlockLayout,
    n: float,
    cov: Array,
    norms: NormMoments | None,
    measures: Sequence[str],
    *,
    where: str = "",
    rank_tol: float = RANK_TOL,
    svcca_variance: float = SVCCA_VARIANCE,
) -> SplitSimilarity:
    """Every requested measure for every pair of models of one split.

    Parameters
    ----------
    layout
        The models' blocks in ``cov``.
    n
        Rows of the split.
    cov
        Centered population covariance (ddof = 0), shape (D, D).
    norms
        Sums of squared norms of the rows centered on the split mean (for
        ``debiased_cka``; :meth:`SplitMoments.centered_norms`).
    measures
        Names from :data:`MEASURES` (``cv_r2`` is ignored here).
    where
        Names the split in the notes.
    rank_tol, svcca_variance
        See :data:`RANK_TOL` and :data:`SVCCA_VARIANCE`.
    """
    if not 0.0 < svcca_variance <= 1.0:
        raise ValueError(f"svcca_variance: must be in (0, 1], got {svcca_variance}")
    if not rank_tol >= 0.0:
        raise ValueError(f"rank_tol: must be >= 0, got {rank_tol}")
    if "debiased_cka" in measures and norms is None:
        raise ValueError("debiased_cka needs the norm sums (moments with norms=True)")
    names = layout.names
    m = len(names)
    count = round(n)
    blocks = [layout.block(name) for name in names]
    wanted = [t for key in measures for t in TABLES.get(key, ())]
    tables = {t: np.full((m, m), np.nan) for t in wanted}
    spectra = [_spectrum(cov[b, b], rank_tol) for b in blocks]
    lead = [s.leading(svcca_variance) for s in spectra]
    notes: list[str] = []
    prefix = f"{where}: " if where else ""
    constant = [names[i] for i, s in enumerate(spectra) if s.rank == 0]
    if constant:
        notes.append(
            f"{prefix}constant embedding of {', '.join(constant)}: every measure of its pairs "
            "is NaN"
        )
    if "debiased_cka" in measures and count < 4:
        notes.append(f"{prefix}n = {count} < 4: debiased CKA is NaN (the estimator needs 4 rows)")
    degenerate: list[str] = []
    correlations: dict[str, dict[tuple[str, str], Array]] = {}
    h = np.full((m, m), np.nan)
    if "debiased_cka" in measures and norms is not None and count >= 4:
        q = norms.norm_gram / n
        tr = np.array([s.trace for s in spectra])
        for i in range(m):
            for j in range(i, m):
                f2 = float(np.sum(cov[blocks[i], blocks[j]] ** 2))
                h[i, j] = h[j, i] = f2 + tr[i] * tr[j] / ((n - 1) * (n - 2)) - q[i, j] / (n - 2)
    for i, si in enumerate(spectra):
        if si.rank == 0:
            continue
        # A model with itself, exact by definition (every whitened direction correlates 1).
        for key, value in (("cka", 1.0), ("procrustes", 0.0), ("pwcca", 1.0), ("svcca", 1.0)):
            if key in tables:
                tables[key][i, i] = value
        if "debiased_cka" in tables and h[i, i] > 0:
            tables["debiased_cka"][i, i] = 1.0
        if "cca" in measures:
            correlations.setdefault("cca", {})[(names[i], names[i])] = np.ones(si.rank)
            tables["cca_mean"][i, i] = tables["cca_r2"][i, i] = 1.0
            tables["pillai"][i, i] = float(si.rank)
        if "svcca" in measures:
            correlations.setdefault("svcca", {})[(names[i], names[i])] = np.ones(lead[i].rank)
    for i in range(m):
        for j in range(i + 1, m):
            si, sj = spectra[i], spectra[j]
            if si.rank == 0 or sj.rank == 0:
                continue
            cxy = cov[blocks[i], blocks[j]]
            pair = (names[i], names[j])
            if "cka" in tables:
                value = float(np.sum(cxy**2)) / (si.frob * sj.frob)
                tables["cka"][i, j] = tables["cka"][j, i] = value
            if "debiased_cka" in tables and h[i, i] > 0 and h[j, j] > 0:
                value = h[i, j] / math.sqrt(h[i, i] * h[j, j])
                tables["debiased_cka"][i, j] = tables["debiased_cka"][j, i] = value
            if "procrustes" in tables:
                nuclear = float(np.linalg.svd(cxy, compute_uv=False).sum())
                value = max(0.0, 2.0 - 2.0 * nuclear / math.sqrt(si.trace * sj.trace))
                tables["procrustes"][i, j] = tables["procrustes"][j, i] = value
            if "cca" in measures or "pwcca" in measures:
                can = _canonical(cxy, si, sj, weights="pwcca" in measures)
                if si.rank + sj.rank > count - 1:
                    degenerate.append(f"{names[i]}/{names[j]}")
                if "cca" in measures:
                    correlations.setdefault("cca", {})[pair] = can.rho
                    r2 = can.rho**2
                    for key, value in (
                        ("cca_mean", float(can.rho.mean())),
                        ("cca_r2", float(r2.mean())),
                        ("pillai", float(r2.sum())),
                    ):
                        tables[key][i, j] = tables[key][j, i] = value
                if "pwcca" in tables:
                    tables["pwcca"][i, j] = _weighted(can.weights_x, can.rho)
                    tables["pwcca"][j, i] = _weighted(can.weights_y, can.rho)
            if "svcca" in tables:
                rho = _canonical(cxy, lead[i], lead[j], weights=False).rho
                correlations.setdefault("svcca", {})[pair] = rho
                tables["svcca"][i, j] = tables["svcca"][j, i] = float(rho.mean())
    if degenerate:
        notes.append(
            f"{prefix}n − 1 = {count - 1} is below rank_x + rank_y for {', '.join(degenerate)}: "
            "their CCA/PWCCA are degenerate (some canonical correlations are 1 whatever the "
            "models)"
        )
    return SplitSimilarity(
        n=count,
        tables=tables,
        correlations=correlations,
        ranks={name: s.rank for name, s in zip(names, spectra, strict=True)},
        svcca_dims={name: s.rank for name, s in zip(names, lead, strict=True)},
        notes=tuple(notes),
    )


def moments_similarity(
    moments: SplitMoments,
    measures: Sequence[str] = CHEAP_MEASURES,
    *,
    rank_tol: float = RANK_TOL,
    svcca_variance: float = SVCCA_VARIANCE,
) -> SplitSimilarity:
    """:func:`split_similarity` of the rows accumulated in ``moments`` (which must have
    ``norms=True`` for ``debiased_cka``)."""
    if moments.count < 2:
        raise ValueError(
            f"split {moments.split!r}: has {moments.count} rows; similarity needs at least 2"
        )
    return split_similarity(
        moments.layout,
        moments.moments.count,
        moments.covariance(0),
        moments.centered_norms() if "debiased_cka" in measures else None,
        measures,
        where=moments.split,
        rank_tol=rank_tol,
        svcca_variance=svcca_variance,
    )
