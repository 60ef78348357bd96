"""The closed-form LMD fits from the moments of each split (see :mod:`lmdx.lmd`).

* :func:`fit_basis`: target sets on one basis, from one factorization of Σ_zz per ridge;
* :func:`fit_groups`: R²(f_i | all others) for every i, from one factorization of the
  joint Σ per ridge (block-inverse identity);
* :class:`RidgePlan`: which ridges a mode tries, on which covariance scale.

Group fits R²(f_i | all others)
-------------------------------
All m leave-one-out fits come from one Cholesky factorization per ridge value of the
joint regularized covariance ``M = Σ + λI`` (all ``D = Σ d_j`` dimensions): with
``P = M⁻¹``, the ridge regression of block i on the rest is ``W_i = −P_ii⁻¹ P_i,rest``
(block-inverse identity: ``P_ii⁻¹ = M_ii − M_ir M_rr⁻¹ M_ri`` and
``−P_ii⁻¹ P_ir = M_ir M_rr⁻¹``; the λ on the target block's own diagonal does not enter
``W_i``). One factorization means one λ for all m fits, so group fits use
``λ = ρ·tr(Σ)/D`` over the joint matrix; this equals the per-fit convention
``ρ·tr(Σ_rest)/D_rest`` of a direct fit only when the blocks have equal mean variance.
(In compat mode λ is the absolute ridge for every fit, so group fits equal the
reference's m separate fits exactly.) The "dependency of the set" is the mean of the m
group R² values.

P comes from the Cholesky factor in place (:func:`cholesky_inverse_lower`: ``M = L Lᵀ``,
``L⁻¹`` over ``L``, then ``P = L⁻ᵀ L⁻¹`` over that; D³ flops in all, against ~2.3·D³ for
Cholesky solves with an identity right-hand side), and each block's residual map
``a_i = P_ii⁻¹ P_i,: = [I, −W_i]`` then overwrites block row i of P. The train split is
scored without any D × D product: W_i solves the normal equations, so its SSR/n is
``diag(Σ_i,: a_iᵀ) − λ·‖rows of W_i‖²`` (d_i·D flops). A held-out split is scored as
``diag(a_i S a_iᵀ)`` with its own covariance S (2·d_i·D² flops per block).

Memory: a fit needs the D × D covariance of every scored split (8·D² bytes each) and,
for group fits, one more D × D matrix (two when the ridge is chosen on validation: the
best ``a_i`` so far are kept).
"""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import NDArray

from .. import _core
from .._errors import NotPositiveDefiniteError, SampleSizeWarning
from ..spd import spd_solve
from .results import LMDFit, Mode
from .split_moments import SPLITS, BlockLayout, SplitMoments

__all__ = [
    "COMPAT_RIDGE_ABSOLUTE",
    "DEFAULT_RIDGE_GRID",
    "FACTOR_BLOCK",
    "MIN_ROWS_PER_DIM",
    "RidgePlan",
    "SplitStats",
    "check_sample_size",
    "cholesky_inverse_lower",
    "fit_basis",
    "fit_groups",
    "ridge_plan",
    "split_stats",
]

#: Relative ridges ρ (λ = ρ·tr(Σ_zz)/D_z) tried when ρ is chosen on the validation split.
#: ρ is relative to the mean eigenvalue of Σ_zz, so one grid fits every embedding scale.
#: The smallest value, 1e-8, is ordinary least squares for all practical purposes: it
#: only lifts directions with less than 1e-8 of the average variance, and it keeps the
#: Cholesky factorization valid when Σ_zz is singular (n_train ≤ D_z, constant or
#: duplicated embedding dimensions, a basis containing near-copies of a model), where an
#: exact 0 would fail. ρ = 1 halves the fitted coefficient along a direction of average
#: variance; larger values mostly measure the penalty, not the models. Decades suffice
#: because validation R² varies slowly in log ρ near its maximum.
DEFAULT_RIDGE_GRID: tuple[float, ...] = (1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0)

#: The reference code's absolute ridge (its α; compat mode).
COMPAT_RIDGE_ABSOLUTE: float = 1e-6

#: Warn when n_train < MIN_ROWS_PER_DIM · D_z: train R² is then inflated by about D_z/n.
MIN_ROWS_PER_DIM: int = 10

#: Rows per block of the group fits' in-place factorization and inverse
#: (:func:`cholesky_inverse_lower`): NumPy matrix products of this width, (D/FACTOR_BLOCK)²/2
#: of them per pass.
FACTOR_BLOCK: int = 512

#: Names the joint system of the group fits in errors and warnings.
GROUP_SYSTEM = "LMD group fits: Σ"

Array = NDArray[np.float64]


@dataclass(frozen=True)
class SplitStats:
    """Population moments of one split: n, mean (D,), centered covariance (D, D), and
    its diagonal."""

    n: float
    mean: Array
    cov: Array
    diag: Array


@dataclass(frozen=True)
class RidgePlan:
    """The ridges a fit tries: relative ones (default mode) or one absolute ridge on the
    N − 1 covariance (compat mode)."""

    mode: Mode
    ddof: int
    ridges: tuple[float, ...]  # default mode: relative ridges to try
    ridge_absolute: float | None  # compat mode: absolute ridge on the N - 1 covariance
    select: bool  # choose among ridges by validation pooled R²

    def relative(self, mean_diagonal: float, n: float) -> tuple[float, ...]:
        """Relative ridges for spd_solve on a population (ddof=0) covariance."""
        if self.ridge_absolute is None:
            return self.ridges
        # (Σ₁ + λI) with Σ₁ = Σ₀·n/(n−1) is proportional to Σ₀ + λ(n−1)/n·I.
        return (self.ridge_absolute * (n - self.ddof) / n / mean_diagonal,)

    def scale(self, n: float) -> float:
        """Factor from a ridge on the ddof=0 covariance to one on this mode's covariance."""
        return n / (n - self.ddof)


def ridge_plan(
    mode: str,
    ridge: float | None = None,
    ridge_grid: Sequence[float] | None = None,
    ridge_absolute: float | None = None,
) -> RidgePlan:
    """Check a fit's ridge arguments (see :meth:`lmdx.lmd.Decomposition.fit`) and plan."""
    if mode == "compat":
        if ridge is not None or ridge_grid is not None:
            raise ValueError(
                "mode='compat' uses the reference's absolute alpha (ridge_absolute=); "
                "ridge and ridge_grid belong to mode='default'"
            )
        value = COMPAT_RIDGE_ABSOLUTE if ridge_absolute is None else float(ridge_absolute)
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"ridge_absolute: must be finite and >= 0, got {value}")
        return RidgePlan("compat", 1, (), value, False)
    if mode != "default":
        raise ValueError(f"mode: expected 'default' or 'compat', got {mode!r}")
    if ridge_absolute is not None:
        raise ValueError(
            "ridge_absolute belongs to mode='compat'; the default mode's ridge is relative "
            "(ridge= or ridge_grid=)"
        )
    if ridge is not None and ridge_grid is not None:
        raise ValueError("pass either ridge (fixed) or ridge_grid (chosen on validation), not both")
    if ridge is not None:
        values: tuple[float, ...] = (ridge,)
    else:
        values = DEFAULT_RIDGE_GRID if ridge_grid is None else tuple(ridge_grid)
    if not values:
        raise ValueError("ridge_grid: is empty")
    label = "ridge" if ridge is not None else "ridge_grid"
    for v in values:
        if not (math.isfinite(float(v)) and float(v) >= 0):
            raise ValueError(f"{label}: ridge values must be finite and >= 0, got {v}")
    grid = tuple(sorted({float(v) for v in values}))
    return RidgePlan("default", 0, grid, None, len(grid) > 1)


def split_stats(splits: Mapping[str, SplitMoments], plan: RidgePlan) -> dict[str, SplitStats]:
    """Population moments of every split with rows (train always; validation when the
    ridge is chosen on it)."""
    required = ["train", "validation"] if plan.select else ["train"]
    for s in required:
        if splits[s].count == 0:
            why = (
                " (the ridge is chosen on it; pass ridge= to fix it instead)"
                if s != "train"
                else ""
            )
            raise ValueError(f"split {s!r} is empty{why}; add embeddings with .add({s!r}, ...)")
    out: dict[str, SplitStats] = {}
    for s in SPLITS:
        sm = splits[s]
        if sm.count == 0:
            continue
        if sm.count < 2:
            raise ValueError(f"split {s!r} has {sm.count} row; R² needs at least 2 rows per split")
        cov = sm.covariance(0)
        out[s] = SplitStats(sm.moments.count, sm.mean(), cov, np.diag(cov).copy())
    return out


def check_sample_size(
    stats: Mapping[str, SplitStats], d_z: int, what: str, notes: list[str]
) -> None:
    """Warn (:class:`lmdx.SampleSizeWarning`, also appended to ``notes``) when the train
    split has fewer than :data:`MIN_ROWS_PER_DIM` rows per basis dimension."""
    n = stats["train"].n
    if n < MIN_ROWS_PER_DIM * d_z:
        msg = (
            f"{what}: n_train = {n:g} is less than {MIN_ROWS_PER_DIM} x the basis "
            f"dimension D_z = {d_z}; train R² is inflated by about D_z/n = {d_z / n:.2g}. "
            "Judge the fit by the validation/test R²."
        )
        notes.append(msg)
        warnings.warn(msg, SampleSizeWarning, stacklevel=3)


def fit_basis(
    layout: BlockLayout,
    stats: Mapping[str, SplitStats],
    plan: RidgePlan,
    basis: tuple[str, ...],
    targets: Sequence[tuple[str, ...]],
    *,
    keep_weights: bool,
    allow_regularization: bool,
    n_threads: int | None,
) -> list[LMDFit]:
    """Fit each target set on one basis from one Σ_zz factorization per ridge value."""
    tr = stats["train"]
    iz = layout.indices(basis)
    ius = [layout.indices(t) for t in targets]
    iu = np.concatenate(ius)
    bounds = np.cumsum([0] + [len(i) for i in ius])
    cols = [slice(int(lo), int(hi)) for lo, hi in itertools.pairwise(bounds)]
    szz = tr.cov[np.ix_(iz, iz)]
    szu = tr.cov[np.ix_(iz, iu)]
    mean_diag = float(np.mean(np.diag(szz)))
    if not mean_diag > 0:
        raise ValueError(f"basis {list(basis)}: the embeddings are constant on the train split")
    name = f"LMD basis {'+'.join(basis)}: Σ_zz"
    ridges = plan.relative(mean_diag, tr.n)
    scores = np.full((len(targets), len(ridges)), -np.inf)
    best_x = np.empty_like(szu)
    best_ridge = [(0.0, 0.0)] * len(targets)
    for r_i, ridge in enumerate(ridges):
        x, info = spd_solve(
            szz,
            szu,
            ridge=ridge,
            allow_regularization=allow_regularization,
            name=name,
            n_threads=n_threads,
        )
        if plan.select:
            b = tr.mean[iu] - x.T @ tr.mean[iz]
            ssr, sst = _direct_ss(x, b, iz, iu, stats["validation"])
            for t, c in enumerate(cols):
                scores[t, r_i] = _r2(ssr[c], sst[c])[0]
        for t, c in enumerate(cols):
            if r_i == 0 or scores[t, r_i] > scores[t, :r_i].max():
                best_x[:, c] = x[:, c]
                best_ridge[t] = (float(info.ridge), float(info.ridge_absolute))
    fits = []
    for t, (c, idx) in enumerate(zip(cols, ius, strict=True)):
        x = best_x[:, c]
        b = tr.mean[idx] - x.T @ tr.mean[iz]
        r2: dict[str, float] = {}
        r2d: dict[str, float] = {}
        for s, st in stats.items():
            r2[s], r2d[s] = _r2(*_direct_ss(x, b, iz, idx, st))
        relative, absolute = best_ridge[t]
        fits.append(
            LMDFit(
                target=targets[t],
                basis=basis,
                ridge=relative,
                ridge_absolute=absolute * plan.scale(tr.n),
                r2=r2,
                r2_per_dim=r2d,
                ridge_scores=tuple(float(v) for v in scores[t]) if plan.select else None,
                weight=np.ascontiguousarray(x.T) if keep_weights else None,
                bias=b if keep_weights else None,
            )
        )
    return fits


def fit_groups(
    layout: BlockLayout,
    stats: Mapping[str, SplitStats],
    plan: RidgePlan,
    *,
    keep_weights: bool,
    allow_regularization: bool,
    n_threads: int | None,
    block: int = FACTOR_BLOCK,
) -> list[LMDFit]:
    """R²(f_i | all others) for every i from one factorization of Σ + λI per ridge
    (``block``: as in :func:`cholesky_inverse_lower`)."""
    tr = stats["train"]
    dim = layout.dim
    names = layout.names
    mean_diag = float(np.mean(tr.diag))
    if not mean_diag > 0:
        raise ValueError("group fits: all embeddings are constant on the train split")
    ridges = plan.relative(mean_diag, tr.n)
    m = len(names)
    blocks = [layout.block(n) for n in names]
    scores = np.full((m, len(ridges)), -np.inf)
    best_a: list[Array] = [np.empty(0)] * m
    best_train: list[Array] = [np.empty(0)] * m
    best_ridge = [(0.0, 0.0)] * m
    for r_i, ridge in enumerate(ridges):
        buf, used = _joint_precision(
            tr.cov, mean_diag, ridge, block, allow_regularization=allow_regularization,
            n_threads=n_threads,
        )  # fmt: skip
        lam = used * mean_diag
        for i, blk in enumerate(blocks):
            a = _group_rows_in_place(buf, blk, names[i], n_threads)
            train_ssr = _group_train_ssr(a, blk, tr.cov, lam)
            if plan.select:
                val = _group_ss(a, blk.start, blk.stop, stats["validation"], tr.mean)
                scores[i, r_i] = _r2(*val)[0]
            if r_i == 0 or scores[i, r_i] > scores[i, :r_i].max():
                # One ridge: the rows stay in buf; several: buf is refilled per ridge.
                best_a[i] = a.copy() if plan.select else a
                best_train[i] = train_ssr
                best_ridge[i] = (used, lam)
        del buf, a
    fits = []
    for i, (name, blk) in enumerate(zip(names, blocks, strict=True)):
        a = best_a[i]
        rest = np.r_[0 : blk.start, blk.stop : dim]
        r2: dict[str, float] = {}
        r2d: dict[str, float] = {}
        for s, st in stats.items():
            ss = (
                (best_train[i], tr.diag[blk])
                if s == "train"
                else _group_ss(a, blk.start, blk.stop, st, tr.mean)
            )
            r2[s], r2d[s] = _r2(*ss)
        weight = bias = None
        if keep_weights:
            weight = np.ascontiguousarray(-a[:, rest])
            bias = tr.mean[blk] - weight @ tr.mean[rest]
        relative, absolute = best_ridge[i]
        fits.append(
            LMDFit(
                target=(name,),
                basis=tuple(n for n in names if n != name),
                ridge=relative,
                ridge_absolute=absolute * plan.scale(tr.n),
                r2=r2,
                r2_per_dim=r2d,
                ridge_scores=tuple(float(v) for v in scores[i]) if plan.select else None,
                weight=weight,
                bias=bias,
            )
        )
    return fits


def cholesky_inverse_lower(m: Array, tiny: float, *, block: int = FACTOR_BLOCK) -> bool:
    """Overwrite the lower triangle of the symmetric positive-definite ``m`` with that of
    ``m⁻¹``, in place, from its Cholesky factor (no D × D temporary).

    Three blocked passes over the lower triangle, each D³/3 flops in NumPy matrix products
    of ``block`` rows or columns: ``m = L Lᵀ`` (left-looking: block column k from the
    finished columns left of it), ``L⁻¹`` over ``L`` (block columns right to left),
    ``L⁻ᵀ L⁻¹`` over ``L⁻¹`` (block rows top to bottom; each block row reads only itself
    and the rows below it). NumPy's BLAS runs the products with its own thread count.

    Parameters
    ----------
    m
        C-contiguous float64, shape (D, D); only the lower triangle is read. The strictly
        upper blocks are left as they were (garbage afterwards); the diagonal blocks are
        written in full (symmetric).
    tiny
        A squared pivot of the factor must exceed this (as :func:`lmdx.spd_solve`'s
        ``SINGULAR_PIVOT`` × mean diagonal).
    block
        Rows per block.

    Returns
    -------
    bool
        False (``m`` partly overwritten) if ``m`` is not numerically positive definite.
    """
    d = m.shape[0]
    starts = range(0, d, block)
    inverses: list[Array] = []  # L_kk⁻¹ of every diagonal block (lower triangular)
    # Products go into one workspace (not a new temporary a call: a large allocation is a
    # fresh mapping, and its page faults cost as much as the product).
    flat = np.empty(d * min(block, d))

    def work(rows: int, cols: int) -> Array:
        return flat[: rows * cols].reshape(rows, cols)

    for k0 in starts:
        k1 = min(k0 + block, d)
        if k0 > 0:  # left-looking: A_:k −= L_:,<k L_k,<kᵀ, one product a block column
            m[k0:, k0:k1] -= np.matmul(m[k0:, :k0], m[k0:k1, :k0].T, out=work(d - k0, k1 - k0))
        a = m[k0:k1, k0:k1]
        try:
            l_kk = np.linalg.cholesky(np.tril(a) + np.tril(a, -1).T)
        except np.linalg.LinAlgError:
            return False
        pivots = np.diag(l_kk)
        if not (np.all(np.isfinite(pivots)) and float(np.min(pivots)) ** 2 > tiny):
            return False
        inv = np.tril(np.linalg.solve(l_kk, np.eye(k1 - k0)))
        inverses.append(inv)
        m[k0:k1, k0:k1] = l_kk
        if k1 < d:  # L_21 = A_21 L_11⁻ᵀ
            m[k1:, k0:k1] = np.matmul(m[k1:, k0:k1], inv.T, out=work(d - k1, k1 - k0))
    for k, k0 in reversed(list(enumerate(starts))):
        k1 = min(k0 + block, d)
        if k1 < d:
            # Y_ik = −(Σ_{k<c≤i} Y_ic L_ck) L_kk⁻¹ for the block rows i below k, where the
            # block columns c > k already hold Y = L⁻¹ and column k still holds L.
            t = work(d - k1, k1 - k0)
            for i0 in range(k1, d, block):
                i1 = min(i0 + block, d)
                np.matmul(m[i0:i1, k1:i1], m[k1:i1, k0:k1], out=t[i0 - k1 : i1 - k1])
            np.negative(t @ inverses[k], out=m[k1:, k0:k1])
        m[k0:k1, k0:k1] = inverses[k]
    for i0 in starts:
        i1 = min(i0 + block, d)
        # P_ij = Σ_{c≥i} Y_ciᵀ Y_cj for j ≤ i
        m[i0:i1, :i1] = np.matmul(m[i0:, i0:i1].T, m[i0:, :i1], out=work(i1 - i0, i1))
    return True


def _joint_precision(
    cov: Array,
    mean_diag: float,
    ridge: float,
    block: int,
    *,
    allow_regularization: bool,
    n_threads: int | None,
) -> tuple[Array, float]:
    """The lower triangle of (Σ + ridge·mean_diag·I)⁻¹ in a new array, and the relative
    ridge it used: ``ridge``, or where Σ + ridge·mean_diag·I is not numerically positive
    definite the one :func:`lmdx.spd_solve` escalates to (with its warning), or its error."""
    dim = cov.shape[0]
    tiny = float(_core.core.SINGULAR_PIVOT) * mean_diag
    buf = cov.copy()
    buf.flat[:: dim + 1] += ridge * mean_diag
    if cholesky_inverse_lower(buf, tiny, block=block):
        return buf, ridge
    del buf
    # The solver of the core decides what a singular Σ gets (one mechanism for every fit).
    info = spd_solve(
        cov,
        np.zeros(dim),
        ridge=ridge,
        allow_regularization=allow_regularization,
        name=GROUP_SYSTEM,
        n_threads=n_threads,
    ).info
    used = float(info.ridge)
    buf = cov.copy()
    buf.flat[:: dim + 1] += used * mean_diag
    if not cholesky_inverse_lower(buf, tiny, block=block):
        raise NotPositiveDefiniteError(
            f"{GROUP_SYSTEM}: not numerically positive definite with relative ridge {used:g} "
            "(a pivot of its blocked factorization is below the threshold); pass a larger "
            "ridge"
        )
    return buf, used


def _r2(ssr: Array, sst: Array) -> tuple[float, float]:
    """Pooled 1 − ΣSSR/ΣSST and the mean of 1 − SSR_j/SST_j over dims with SST_j > 0."""
    total = float(np.sum(sst))
    pooled = 1.0 - float(np.sum(ssr)) / total if total > 0 else math.nan
    ok = sst > 0
    per_dim = float(np.mean(1.0 - ssr[ok] / sst[ok])) if ok.any() else math.nan
    return pooled, per_dim


def _direct_ss(
    x: Array, b: Array, iz: NDArray[np.intp], iu: NDArray[np.intp], st: SplitStats
) -> tuple[Array, Array]:
    """Per-target-dim SSR/n and SST/n of u ≈ xᵀ z + b on a split (x = Wᵀ, (D_z, D_u))."""
    s_zu = st.cov[np.ix_(iz, iu)]
    szz_x = st.cov[np.ix_(iz, iz)] @ x
    resid_mean = st.mean[iu] - x.T @ st.mean[iz] - b
    ssr = (
        st.diag[iu]
        - 2.0 * np.einsum("kj,kj->j", x, s_zu)
        + np.einsum("kj,kj->j", x, szz_x)
        + resid_mean**2
    )
    # The expansion can round a tiny true SSR to a tiny negative one.
    return np.maximum(ssr, 0.0), st.diag[iu]


def _group_ss(a: Array, lo: int, hi: int, st: SplitStats, train_mean: Array) -> tuple[Array, Array]:
    """SSR/n and SST/n of block lo:hi with residual a·(x − train mean), a = [I, −W] (d, D)."""
    resid_mean = a @ (st.mean - train_mean)
    ssr = np.einsum("jk,jk->j", a, a @ st.cov) + resid_mean**2
    return np.maximum(ssr, 0.0), st.diag[lo:hi]


def _group_rows_in_place(buf: Array, blk: slice, name: str, n_threads: int | None) -> Array:
    """a_i = P_ii⁻¹ P_i,: = [I, −W_i] (in the columns of all models) over block row i of
    ``buf``.

    ``buf`` holds the lower triangle of P, with the block rows above i already replaced by
    their a; block row i reads its own row and the rows below, as
    :func:`cholesky_inverse_lower` leaves them. Returns the view of ``buf``."""
    lo, hi = blk.start, blk.stop
    x = buf[lo:hi, lo:hi]
    p_ii = np.tril(x) + np.tril(x, -1).T
    rhs = np.empty((hi - lo, buf.shape[0]))
    rhs[:, :lo] = buf[lo:hi, :lo]
    rhs[:, lo:hi] = 0.0  # P_ii⁻¹ P_ii is set to I exactly below
    rhs[:, hi:] = buf[hi:, lo:hi].T
    a = spd_solve(
        p_ii,
        rhs,
        allow_regularization=False,
        name=f"LMD group fit of {name}: precision block P_ii",
        n_threads=n_threads,
    ).x
    del rhs
    a[:, lo:hi] = np.eye(hi - lo)
    buf[lo:hi] = a
    return buf[lo:hi]


def _group_train_ssr(a: Array, blk: slice, cov: Array, lam: float) -> Array:
    """Train SSR/n of the group fit a = [I, −W] of block ``blk`` without a D × D product.

    W solves the normal equations ``W (Σ_rr + λI) = Σ_ir``, so ``W Σ_rr Wᵀ = Σ_ir Wᵀ − λ W Wᵀ``
    and ``SSR/n = diag(Σ_ii − 2 Σ_ir Wᵀ + W Σ_rr Wᵀ) = diag(Σ_i,: aᵀ) − λ·‖rows of W‖²``.
    (Not ``diag(P_ii⁻¹) − λ·‖rows of a‖²``, equal in exact arithmetic: that subtracts
    numbers of size λ, which cancel where λ is much larger than the block's variance.)"""
    lo, hi = blk.start, blk.stop
    fitted = np.einsum("jk,jk->j", cov[lo:hi], a)
    w_sq = np.einsum("jk,jk->j", a[:, :lo], a[:, :lo]) + np.einsum("jk,jk->j", a[:, hi:], a[:, hi:])
    ssr: Array = np.maximum(fitted - lam * w_sq, 0.0)
    return ssr
