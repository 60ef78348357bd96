"""Float64 NumPy references and synthetic data for the LMD tests (tests/lmd).

Every expected value is computed from the arrays themselves (np.linalg.solve, residuals
and R² over rows); lmdx only ever sees the arrays streamed in.
"""

from __future__ import annotations

import itertools

import lmdx
import numpy as np
import pytest

SPLITS = ("train", "validation", "test")


def ref_fit(u: np.ndarray, z: np.ndarray, lam: float, ddof: int = 0):
    """Ridge fit u ≈ W z + b from centered covariances with ddof, λ added to Σ_zz."""
    n = len(u)
    uc, zc = u - u.mean(0), z - z.mean(0)
    szz = zc.T @ zc / (n - ddof)
    szu = zc.T @ uc / (n - ddof)
    w = np.linalg.solve(szz + lam * np.eye(z.shape[1]), szu).T
    return w, u.mean(0) - w @ z.mean(0)


def ref_r2(u: np.ndarray, z: np.ndarray, w: np.ndarray, b: np.ndarray):
    """Pooled and mean per-dimension R² of the fit on rows (u, z), SST about their mean."""
    ssr = ((u - z @ w.T - b) ** 2).sum(0)
    sst = ((u - u.mean(0)) ** 2).sum(0)
    return 1 - ssr.sum() / sst.sum(), np.mean(1 - ssr / sst)


def rel_lambda(z: np.ndarray, rho: float) -> float:
    """λ = ρ·tr(Σ_zz)/D_z with the population covariance."""
    return rho * np.trace(np.cov(z.T, bias=True).reshape(z.shape[1], -1)) / z.shape[1]


def latent_data(rng, n: int, dims, *, noise=0.5, rank=3, scale=1.0, mean_shift=0.0):
    """Embeddings of several 'models' sharing a latent factor, plus per-model noise."""
    h = rng.standard_normal((n, rank))
    out = []
    for d in dims:
        a = rng.standard_normal((rank, d))
        x = h @ a + noise * rng.standard_normal((n, d)) + rng.uniform(-2, 2, d) + mean_shift
        out.append(scale * x)
    return out


def decomposition(names, data: dict, *, batches: int = 1, rng=None, seed=None):
    """Stream data[split] (one array per model) into a Decomposition in `batches` pieces."""
    dims = [a.shape[1] for a in next(iter(data.values()))]
    dec = lmdx.Decomposition(names, dims, seed=seed)
    for split, arrays in data.items():
        n = arrays[0].shape[0]
        if batches == 1:
            cuts = [0, n]
        else:
            inner = np.sort(rng.choice(np.arange(1, n), size=batches - 1, replace=False))
            cuts = [0, *inner.tolist(), n]
        for lo, hi in itertools.pairwise(cuts):
            dec.add(split, [a[lo:hi] for a in arrays])
    return dec


def three_splits(rng, sizes, dims, **kw):
    """Same generating weights for every split: draw once, then split the rows."""
    total = sum(sizes)
    arrays = latent_data(rng, total, dims, **kw)
    bounds = np.cumsum([0, *sizes])
    return {
        s: [a[lo:hi] for a in arrays]
        for s, lo, hi in zip(SPLITS, bounds[:-1], bounds[1:], strict=True)
    }


def stack(arrays, idx):
    return np.concatenate([arrays[i] for i in idx], axis=1)


def assert_fit_matches(fit, data, t_idx, z_idx, lam, *, rtol=1e-9, ddof=0, weights=True):
    u_tr, z_tr = stack(data["train"], t_idx), stack(data["train"], z_idx)
    w, b = ref_fit(u_tr, z_tr, lam, ddof)
    if weights:
        scale = np.abs(w).max() + 1e-300
        np.testing.assert_allclose(fit.weight, w, rtol=0, atol=rtol * scale)
        np.testing.assert_allclose(fit.bias, b, rtol=0, atol=rtol * (np.abs(b).max() + scale))
    for split, arrays in data.items():
        pooled, per_dim = ref_r2(stack(arrays, t_idx), stack(arrays, z_idx), w, b)
        assert fit.r2[split] == pytest.approx(pooled, rel=rtol, abs=rtol)
        assert fit.r2_per_dim[split] == pytest.approx(per_dim, rel=rtol, abs=rtol)
