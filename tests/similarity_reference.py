"""Float64 references for the similarity measures (tests/lmd/test_similarity*.py,
tests/cli/test_cli_similarity.py), computed from the full N × D embeddings: n × n Gram
matrices (CKA, the U-centred Gram for debiased CKA), SVDs of the centred data (CCA, SVCCA,
PWCCA) and scipy's orthogonal Procrustes solution; and paired synthetic embeddings with
known canonical correlations."""

from __future__ import annotations

import math

import numpy as np
import scipy.linalg

TOL = 1e-10


def _kernel_hsic(k: np.ndarray, ell: np.ndarray) -> float:
    n = len(k)
    h = np.eye(n) - 1.0 / n
    return float(np.sum((h @ k @ h) * (h @ ell @ h)))


def ref_cka(x: np.ndarray, y: np.ndarray) -> float:
    k, ell = x @ x.T, y @ y.T
    return _kernel_hsic(k, ell) / math.sqrt(_kernel_hsic(k, k) * _kernel_hsic(ell, ell))


def _u_centre(k: np.ndarray) -> np.ndarray:
    """U-centring of a Gram matrix (zero diagonal): <U(K), U(L)> / (n(n-3)) is the
    unbiased HSIC."""
    n = len(k)
    k = k.copy()
    np.fill_diagonal(k, 0.0)
    rows = k.sum(axis=0) / (n - 2)
    rows -= rows.sum() / (2 * (n - 1))
    k -= rows[:, None] + rows[None, :]
    np.fill_diagonal(k, 0.0)
    return k


def ref_debiased_cka(x: np.ndarray, y: np.ndarray) -> float:
    """On the raw (uncentred) rows: the estimator is translation invariant."""
    k, ell = _u_centre(x @ x.T), _u_centre(y @ y.T)
    return float(np.sum(k * ell) / math.sqrt(np.sum(k * k) * np.sum(ell * ell)))


def _basis(x: np.ndarray, tol: float = TOL) -> tuple[np.ndarray, np.ndarray]:
    """Orthonormal basis of the centred column space (singular values² > tol·max²)."""
    u, s, _ = np.linalg.svd(x - x.mean(0), full_matrices=False)
    keep = s**2 > tol * s[0] ** 2 if s.size and s[0] > 0 else np.zeros(s.shape, bool)
    return u[:, keep], s[keep]


def ref_cca(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    ux, _ = _basis(x)
    uy, _ = _basis(y)
    return np.linalg.svd(ux.T @ uy, compute_uv=False)


def ref_svcca(x: np.ndarray, y: np.ndarray, fraction: float = 0.99) -> np.ndarray:
    parts = []
    for a in (x, y):
        u, s = _basis(a)
        cum = np.cumsum(s**2)
        k = int(np.argmax(cum >= fraction * cum[-1])) + 1
        parts.append(u[:, :k])
    return np.linalg.svd(parts[0].T @ parts[1], compute_uv=False)


def ref_pwcca(x: np.ndarray, y: np.ndarray) -> float:
    ux, _ = _basis(x)
    uy, _ = _basis(y)
    a, rho, _ = np.linalg.svd(ux.T @ uy, full_matrices=False)
    h = ux @ a[:, : len(rho)]  # canonical variates of x, unit norm
    alpha = np.abs(h.T @ (x - x.mean(0))).sum(axis=1)
    return float(alpha @ rho / alpha.sum())


def ref_procrustes(x: np.ndarray, y: np.ndarray) -> float:
    xc, yc = x - x.mean(0), y - y.mean(0)
    xc, yc = xc / np.linalg.norm(xc), yc / np.linalg.norm(yc)
    width = max(xc.shape[1], yc.shape[1])
    xp = np.pad(xc, ((0, 0), (0, width - xc.shape[1])))
    yp = np.pad(yc, ((0, 0), (0, width - yc.shape[1])))
    q, _ = scipy.linalg.orthogonal_procrustes(yp, xp)
    return float(np.sum((xp - yp @ q) ** 2))


def _rows_orthonormal(rng: np.random.Generator, r: int, d: int) -> np.ndarray:
    q, _ = np.linalg.qr(rng.standard_normal((d, r)))
    return q.T  # (r, d), orthonormal rows


def paired(rng, n, p, q, rx, ry, shared, shift=3.0):
    """x (n, p) of rank rx and y (n, q) of rank ry with canonical correlations drawn in
    [0.1, 0.95] for `shared` pairs (the rest 0), each from centred orthonormal latents
    (condition number of each covariance at most 36), plus a mean shift."""
    k = rx + ry
    g = rng.standard_normal((n, k))
    g -= g.mean(0)
    lat, _ = np.linalg.qr(g)
    lx = lat[:, :rx]
    c = rng.uniform(0.1, 0.95, shared)
    ly = lat[:, rx:].copy()
    ly[:, :shared] = lat[:, :shared] * c + lat[:, rx : rx + shared] * np.sqrt(1 - c**2)
    x = lx * rng.uniform(0.5, 3.0, rx) @ _rows_orthonormal(rng, rx, p)
    y = ly * rng.uniform(0.5, 3.0, ry) @ _rows_orthonormal(rng, ry, q)
    return x + rng.uniform(-shift, shift, p), y + rng.uniform(-shift, shift, q)
