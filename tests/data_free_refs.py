"""Float64 NumPy/SciPy references of the data-free merges added after the 2023 set, one
tensor at a time, written here from the papers' definitions (and FusionBench's or
mergekit's code where lmdx documents following it), independent of lmdx: SVDs by SciPy's
``gesvd`` driver (lmdx uses NumPy's ``gesdd``), polar factors by ``scipy.linalg.polar``,
WUDI by its normal equations with ``numpy.linalg.solve``, DELLA's ranks by counting.
Shared by merge/test_matrix_methods.py, merge/test_wudi.py, merge/test_sparsified.py,
merge/test_spherical.py and cli/test_cli_data_free.py.

A "task matrix" here is ``c_i (θ_i − θ_0)`` in the ``[out, in]`` orientation: the caller
transposes a ``Conv1D`` weight (GPT-2) for the methods whose result depends on it.
"""

from __future__ import annotations

import hashlib

import numpy as np
import scipy.linalg
from task_vectors import ref_elect_mean


def ref_svd(a):
    return scipy.linalg.svd(a, full_matrices=False, lapack_driver="gesvd")


def ref_polar(a):
    """The orthogonal polar factor (orthonormal columns, or rows for a wide ``a``)."""
    if a.shape[0] >= a.shape[1]:
        return scipy.linalg.polar(a)[0]
    return scipy.linalg.polar(a.T)[0].T


def ref_tsv(taus, fraction=None):
    """TSV-M's update: top-k triplets of each task matrix, concatenated, U and V replaced
    by their polar factors, U_⊥ Σ V_⊥ᵀ."""
    r = min(taus[0].shape)
    k = max(1, int(r * (fraction if fraction is not None else 1 / len(taus))))
    parts = [ref_svd(t) for t in taus]
    u = np.hstack([p[0][:, :k] for p in parts])
    s = np.concatenate([p[1][:k] for p in parts])
    vt = np.vstack([p[2][:k] for p in parts])
    return ref_polar(u) @ np.diag(s) @ ref_polar(vt)


def ref_iso_c(taus):
    total = np.sum(taus, axis=0)
    return scipy.linalg.svdvals(total).mean() * ref_polar(total)


def ref_iso_cts_split(r, k, fraction):
    """ISO-CTS's ``(common, per_task)`` for rank ``r``, K tasks (FusionBench's rule)."""
    common = int(r * fraction)
    per_task = round((r - common) / k)
    if per_task * k > r:
        per_task = r // k
    return r - per_task * k, per_task


def ref_iso_cts(taus, fraction):
    common, per_task = ref_iso_cts_split(min(taus[0].shape), len(taus), fraction)
    u, s, vt = ref_svd(np.sum(taus, axis=0))
    uc, sc, vtc = u[:, :common], s[:common], vt[:common]
    us, ss, vts = [], [], []
    for tau in taus:
        specific = (np.eye(tau.shape[0]) - uc @ uc.T) @ tau
        ut, st, vtt = ref_svd(specific)
        us.append(ut[:, :per_task])
        ss.append(st[:per_task])
        vts.append(vtt[:per_task])
    sigma = np.concatenate([*ss, sc]).mean()
    return sigma * ref_polar(np.hstack([*us, uc])) @ ref_polar(np.vstack([*vts, vtc]))


def ref_svc(delta, task_deltas, coefficients, alpha):
    """SVC as FusionBench's loop computes it (exact zero responses: s = 0)."""
    u, s, vt = ref_svd(delta)
    gamma = np.empty_like(s)
    for r in range(len(s)):
        merged_response = u[:, r] @ delta
        total = 0.0
        for c, task in zip(coefficients, task_deltas, strict=True):
            response = u[:, r] @ task
            norm2 = response @ response
            ratio = (merged_response @ response) / norm2 if norm2 > 0 else 0.0
            total += c * max(alpha, ratio)
        gamma[r] = sum(coefficients) / total
    return u @ np.diag(gamma * s) @ vt


def ref_wudi(taus, coefficients, ridge):
    """argmin_τ Σ c_i ‖(τ − τ_i) τ_iᵀ‖²/‖τ_i‖² + ρ m ‖τ − Σ c_i τ_i‖², m = Σ c_i / in, by
    its normal equations τ S = R (S positive definite where this is used)."""
    d = taus[0].shape[1]
    s = sum(c * t.T @ t / np.sum(t * t) for c, t in zip(coefficients, taus, strict=True))
    rhs = sum(c * t @ (t.T @ t) / np.sum(t * t) for c, t in zip(coefficients, taus, strict=True))
    m = ridge * sum(coefficients) / d
    rhs = rhs + m * sum(c * t for c, t in zip(coefficients, taus, strict=True))
    return np.linalg.solve(s + m * np.eye(d), rhs.T).T


def ref_swudi(taus, coefficients, flow_time, top_fraction=None):
    """The gradient flow dτ/ds = −(τ C − D) from T = Σ c_i τ_i at time ``flow_time``, by
    SciPy's matrix exponential of the augmented linear system [τ 1]' = [τ 1] [[−C, 0], [D,
    0]] (any C, singular too); with ``top_fraction``, C replaced by its projection on the
    ⌈r · in⌉ largest eigendirections' span (the others do not move)."""
    d = taus[0].shape[1]
    c_mat = sum(c * t.T @ t / np.sum(t * t) for c, t in zip(coefficients, taus, strict=True))
    d_mat = sum(c * t @ (t.T @ t) / np.sum(t * t) for c, t in zip(coefficients, taus, strict=True))
    start = sum(c * t for c, t in zip(coefficients, taus, strict=True))
    if top_fraction is not None:
        lam, v = np.linalg.eigh(c_mat)
        v = v[:, lam.size - int(np.ceil(top_fraction * d)) :]
        proj = v @ v.T  # the flow restricted to the kept directions
        c_mat, d_mat = proj @ c_mat @ proj, d_mat @ proj
    out = start.shape[0]
    # each output row's [τ_r 1] flows by [[−C, 0], [D_r, 0]]
    result = np.empty_like(start)
    for r in range(out):
        m = np.zeros((d + 1, d + 1))
        m[:d, :d] = -c_mat
        m[d, :d] = d_mat[r]
        result[r] = (np.append(start[r], 1.0) @ scipy.linalg.expm(flow_time * m))[:d]
    return result


def ref_outlier_trim(tau, density, gamma):
    """Breadcrumbs' mask by a stable sort: entries by descending |τ|, equal ones by lowest
    index first; the first ``top`` dropped, the next ``kept`` kept."""
    flat = np.asarray(tau, np.float64).reshape(-1)
    n = flat.size
    kept = int(density * n)
    if kept >= n:
        return np.asarray(tau, np.float64)
    top = min(int(gamma * n), n - kept)
    order = np.argsort(-np.abs(flat), kind="stable")
    out = np.zeros(n)
    chosen = order[top : top + kept]
    out[chosen] = flat[chosen]
    return out.reshape(np.shape(tau))


def ref_draws(name, i, shape, seed):
    """The documented uniform draws: PCG64 from SeedSequence([seed, i, *SHA-256 words of
    the name])."""
    words = np.frombuffer(hashlib.sha256(name.encode()).digest(), dtype="<u4").tolist()
    gen = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, i, *words])))
    return gen.random(shape)


def ref_magprune(name, i, tau, density, epsilon, seed):
    """DELLA's MAGPRUNE as documented: per row (``shape[0]`` rows; a vector is one row),
    rank = how many entries of the row are smaller in magnitude, or equal at a lower
    index; keep probability density − ε + 2ε rank/(n − 1); kept entries divided by it."""
    tau = np.asarray(tau, np.float64)
    rows = tau.reshape(tau.shape[0] if tau.ndim >= 2 else 1, -1)
    n = rows.shape[1]
    p = np.full(rows.shape, float(density))
    if n > 1:
        mag = np.abs(rows)
        idx = np.arange(n)
        smaller = (mag[:, None, :] < mag[:, :, None]) | (
            (mag[:, None, :] == mag[:, :, None]) & (idx[None, None, :] < idx[None, :, None])
        )
        p = density - epsilon + 2 * epsilon * smaller.sum(axis=2) / (n - 1)
    draws = ref_draws(name, i, rows.shape, seed)
    return np.where(draws < p, rows / p, 0.0).reshape(tau.shape)


def ref_sparsified_merge(method, name, theta0, thetas, coefficients, options):
    """breadcrumbs, breadcrumbs_ties, della, della_linear: θ_0 + λ (Σ or elected mean)."""
    c = [1.0] * len(thetas) if coefficients is None else list(coefficients)
    taus = [np.asarray(t, np.float64) - theta0 for t in thetas]
    if method.startswith("breadcrumbs"):
        taus = [ref_outlier_trim(t, options["density"], options["gamma"]) for t in taus]
    else:
        taus = [
            ref_magprune(name, i, t, options["density"], options["epsilon"], options["seed"])
            for i, t in enumerate(taus)
        ]
    if method in ("breadcrumbs_ties", "della"):
        delta = ref_elect_mean(taus, c)
    else:
        delta = sum(ci * t for ci, t in zip(c, taus, strict=True))
    return theta0 + options["scaling"] * delta


def ref_model_stock(theta0, thetas, coefficients=None):
    c = [1.0] * len(thetas) if coefficients is None else list(coefficients)
    used = [(ci, np.asarray(t, np.float64)) for ci, t in zip(c, thetas, strict=True) if ci > 0]
    taus = [(t - theta0).ravel() for _, t in used]
    k = len(taus)
    cosines = []
    for i in range(k):
        for j in range(i + 1, k):
            ni, nj = np.linalg.norm(taus[i]), np.linalg.norm(taus[j])
            cosines.append(np.clip(taus[i] @ taus[j] / (ni * nj), -1, 1) if ni * nj else 0.0)
    cos = np.mean(cosines)
    t = k * cos / (1 + (k - 1) * cos) if k > 1 else 1.0
    mean = sum(ci * x for ci, x in used) / sum(c)
    return t * mean + (1 - t) * theta0


def ref_slerp(t, a, b):
    """Shoemake's slerp of the flat tensors (linear where |cos| > 0.9995), the angle
    from arctan2 of the sine and cosine."""
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    ua = a / na if na > 1e-8 else a
    ub = b / nb if nb > 1e-8 else b
    cos = np.sum(ua * ub)
    if abs(cos) > 0.9995:
        return (1 - t) * a + t * b
    sin = np.linalg.norm(ub - cos * ua)
    omega = np.arctan2(sin, cos)
    return (np.sin((1 - t) * omega) * a + np.sin(t * omega) * b) / np.sin(omega)


def karcher_gradient(u, tensors, weights):
    """The Riemannian gradient of Σ w_i d(u, u_i)² / 2 at the unit vector ``u`` (0 at the
    Karcher mean), the angles by arctan2."""
    grad = np.zeros_like(u)
    total = sum(w for w, x in zip(weights, tensors, strict=True) if np.linalg.norm(x) > 0)
    for w, x in zip(weights, tensors, strict=True):
        n = np.linalg.norm(x)
        if n == 0:
            continue
        ui = x.ravel() / n
        cos = u @ ui
        tangent = ui - cos * u
        sin = np.linalg.norm(tangent)
        if sin > 0:
            grad += (w / total) * np.arctan2(sin, cos) * tangent / sin
    return grad
