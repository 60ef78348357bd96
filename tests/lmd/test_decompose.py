"""LMD fits (lmdx.Decomposition) against float64 NumPy references on stored embeddings.

Every expected value is computed here from the arrays themselves (np.linalg.lstsq,
np.linalg.solve, residuals and R² over rows); lmdx only ever sees the arrays streamed in.
"""

from __future__ import annotations

import csv
import itertools
import json

import lmdx
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

SPLITS = ("train", "validation", "test")
seeds = st.integers(0, 2**32 - 1)


# --------------------------------------------------------------------------- reference


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


# --------------------------------------------------------------------------- recovery


def test_known_population_r2_is_recovered(rng):
    """u = W z + b + ε with z ~ N(0, I): population R² = tr(WWᵀ) / (tr(WWᵀ) + d_u σ²),
    and of dimension j, ‖w_j‖² / (‖w_j‖² + σ²)."""
    n, d_u, d_z = 20_000, 4, 5
    w = rng.standard_normal((d_u, d_z))
    target = 0.6
    sigma = np.sqrt(np.sum(w**2) * (1 - target) / target / d_u)
    data = {}
    for split in SPLITS:
        z = rng.standard_normal((n, d_z))
        u = z @ w.T + 3.0 + sigma * rng.standard_normal((n, d_u))
        data[split] = [u, z[:, :3], z[:, 3:]]
    dec = decomposition(["u", "z1", "z2"], data)
    fit = dec.fit_one("u", ["z1", "z2"], rho=1e-8)
    signal = np.sum(w**2, axis=1)
    per_dim = np.mean(signal / (signal + sigma**2))
    # Sampling error of R² at n = 20 000 is ~0.003; in-sample bias ~ D_z/n = 2.5e-4.
    for split in SPLITS:
        assert fit.r2[split] == pytest.approx(target, abs=0.015)
        assert fit.r2_per_dim[split] == pytest.approx(per_dim, abs=0.015)


# --------------------------------------------------------------------------- direct fits


@given(dims=st.lists(st.integers(1, 4), min_size=3, max_size=4), seed=seeds)
def test_rho_zero_equals_lstsq_with_intercept(dims, seed):
    rng = np.random.default_rng(seed)
    t_idx, z_idx = [0], list(range(1, len(dims)))
    d_z = sum(dims[1:])
    n = 10 * d_z + int(rng.integers(5, 40))
    data = three_splits(rng, [n, 30, 25], dims)
    names = [f"m{i}" for i in range(len(dims))]
    fit = decomposition(names, data).fit_one("m0", names[1:], rho=0.0)

    u, z = stack(data["train"], t_idx), stack(data["train"], z_idx)
    coef, *_ = np.linalg.lstsq(np.c_[z, np.ones(len(z))], u, rcond=None)
    w, b = coef[:-1].T, coef[-1]
    np.testing.assert_allclose(fit.weight, w, rtol=0, atol=1e-9 * np.abs(w).max())
    np.testing.assert_allclose(fit.bias, b, rtol=0, atol=1e-9 * (np.abs(b).max() + 1))
    for split, arrays in data.items():
        pooled, per_dim = ref_r2(stack(arrays, t_idx), stack(arrays, z_idx), w, b)
        assert fit.r2[split] == pytest.approx(pooled, rel=1e-9, abs=1e-9)
        assert fit.r2_per_dim[split] == pytest.approx(per_dim, rel=1e-9, abs=1e-9)
    assert fit.rho == 0.0 and fit.lam == 0.0 and fit.rho_scores is None


@given(rho=st.sampled_from([1e-4, 0.01, 0.3, 1.0, 5.0]), seed=seeds)
def test_fixed_relative_ridge_matches_reference(rho, seed):
    rng = np.random.default_rng(seed)
    dims = [3, 2, 4]
    data = three_splits(rng, [150, 40, 40], dims, scale=float(rng.uniform(0.01, 100)))
    dec = decomposition(["a", "b", "c"], data)
    fit = dec.fit_one(["a", "c"], "b", rho=rho)
    lam = rel_lambda(data["train"][1], rho)
    assert fit.lam == pytest.approx(lam, rel=1e-12)
    assert fit.rho == rho
    assert fit.weight.shape == (7, 2) and fit.bias.shape == (7,)
    assert_fit_matches(fit, data, [0, 2], [1], lam)


def test_rho_chosen_on_validation(rng):
    """Few train rows for the basis size, so the grid's validation R² has an interior
    maximum; the chosen ρ and every grid score match the reference."""
    dims = [4, 6, 6]
    data = three_splits(rng, [130, 200, 200], dims, noise=2.0)
    dec = decomposition(["a", "b", "c"], data)
    grid = [1e-6, 1e-3, 0.03, 0.1, 0.3, 1.0, 3.0]
    fit = dec.fit_one("a", ["b", "c"], rho_grid=grid)
    u, z = stack(data["train"], [0]), stack(data["train"], [1, 2])
    expected = []
    for rho in grid:
        w, b = ref_fit(u, z, rel_lambda(z, rho))
        expected.append(ref_r2(data["validation"][0], stack(data["validation"], [1, 2]), w, b)[0])
    np.testing.assert_allclose(fit.rho_scores, expected, rtol=1e-9)
    best = grid[int(np.argmax(expected))]
    assert 1e-6 < best < 3.0  # the test is only meaningful with an interior optimum
    assert fit.rho == best
    assert_fit_matches(fit, data, [0], [1, 2], rel_lambda(z, best))


def test_default_grid_is_sorted_and_scale_free(rng):
    grid = lmdx.lmd.DEFAULT_RHO_GRID
    assert list(grid) == sorted(grid) and grid[0] > 0 and grid[-1] <= 1
    data = three_splits(rng, [200, 60, 60], [2, 3])
    small = decomposition(["a", "b"], {s: [x * 1e-4 for x in v] for s, v in data.items()})
    large = decomposition(["a", "b"], {s: [x * 1e4 for x in v] for s, v in data.items()})
    f_small, f_large = small.fit_one("a", "b"), large.fit_one("a", "b")
    np.testing.assert_allclose(f_small.rho_scores, f_large.rho_scores, rtol=1e-9)
    for s in SPLITS:
        assert f_small.r2[s] == pytest.approx(f_large.r2[s], rel=1e-8)


# --------------------------------------------------------------------------- streaming


@given(batches=st.integers(2, 12), seed=seeds, f32=st.booleans())
def test_streaming_equals_one_batch(batches, seed, f32):
    rng = np.random.default_rng(seed)
    data = three_splits(rng, [120, 40, 40], [3, 2, 2], mean_shift=5.0)
    if f32:
        data = {s: [a.astype(np.float32) for a in v] for s, v in data.items()}
    names = ["a", "b", "c"]
    one = decomposition(names, data)
    many = decomposition(names, data, batches=batches, rng=rng)
    tol = 1e-5 if f32 else 1e-11
    for s in SPLITS:
        assert many.splits[s].count == one.splits[s].count
        np.testing.assert_allclose(many.splits[s].mean(), one.splits[s].mean(), rtol=tol)
        c1 = one.splits[s].covariance()
        np.testing.assert_allclose(many.splits[s].covariance(), c1, atol=tol * np.abs(c1).max())
    r_one, r_many = one.fit(rho=1e-3), many.fit(rho=1e-3)
    for s in SPLITS:
        np.testing.assert_allclose(
            r_many.r2_target_by_basis(s), r_one.r2_target_by_basis(s), atol=tol * 10
        )


def test_split_moments_merge_and_reference_moments(rng):
    x = latent_data(rng, 90, [3, 2], mean_shift=50.0)
    whole = lmdx.lmd.SplitMoments(["a", "b"], [3, 2]).add(x)
    left = lmdx.lmd.SplitMoments(["a", "b"], [3, 2]).add([a[:40] for a in x])
    right = lmdx.lmd.SplitMoments(["a", "b"], [3, 2]).add([a[40:] for a in x])
    assert not np.allclose(left.shift, right.shift)
    left.merge(right)
    joined = np.concatenate(x, axis=1)
    for m in (whole, left):
        assert m.count == 90
        np.testing.assert_allclose(m.mean(), joined.mean(0), rtol=1e-12)
        np.testing.assert_allclose(m.covariance(), np.cov(joined.T, bias=True), rtol=1e-10)
        np.testing.assert_allclose(m.covariance(1), np.cov(joined.T), rtol=1e-10)
    assert whole.offsets == (0, 3) and whole.layout.block("b") == slice(3, 5)


def test_float32_with_large_mean_keeps_covariance_accurate(rng):
    """Without the per-split shift the float32 Gram would cancel: mean 1e3, spread 1."""
    x = (rng.standard_normal((5000, 6)) + 1e3).astype(np.float32)
    m = lmdx.lmd.SplitMoments(["a", "b"], [4, 2])
    for lo in range(0, 5000, 1000):
        m.add([x[lo : lo + 1000, :4], x[lo : lo + 1000, 4:]])
    ref = np.cov(x.astype(np.float64).T, bias=True)
    np.testing.assert_allclose(m.covariance(), ref, atol=1e-5 * np.abs(ref).max())
    np.testing.assert_allclose(m.mean(), x.astype(np.float64).mean(0), rtol=0, atol=1e-6)


def test_torch_and_mapping_inputs(rng):
    x = latent_data(rng, 50, [3, 2])
    ref = lmdx.lmd.SplitMoments(["a", "b"], [3, 2]).add(x)
    t = torch.tensor(x[0], requires_grad=True)
    via_torch = lmdx.lmd.SplitMoments(["a", "b"], [3, 2]).add({"b": x[1], "a": t})
    np.testing.assert_allclose(via_torch.covariance(), ref.covariance(), rtol=1e-12)


# --------------------------------------------------------------------------- group fits


@pytest.mark.parametrize("rho", [1e-6, 0.05, 1.0])
def test_group_fits_equal_direct_fits_with_the_same_lambda(rng, rho):
    dims = [3, 1, 4, 2]
    names = ["a", "b", "c", "d"]
    data = three_splits(rng, [200, 50, 50], dims, scale=float(rng.uniform(0.1, 10)))
    dec = decomposition(names, data)
    res = dec.fit(rho=rho, pairwise=False, keep_weights=True)
    joint = np.concatenate(data["train"], axis=1)
    lam = rho * np.trace(np.cov(joint.T, bias=True)) / joint.shape[1]
    assert [f.target for f in res.group] == [(n,) for n in names]
    for i, fit in enumerate(res.group):
        rest = [j for j in range(4) if j != i]
        assert fit.basis == tuple(names[j] for j in rest)
        assert fit.lam == pytest.approx(lam, rel=1e-12)
        assert_fit_matches(fit, data, [i], rest, lam, rtol=1e-7)
        # The same fit through the direct path, with ρ converted to that basis's scale.
        z = stack(data["train"], rest)
        direct = dec.fit_one(names[i], fit.basis, rho=lam / rel_lambda(z, 1.0))
        np.testing.assert_allclose(direct.weight, fit.weight, atol=1e-7 * np.abs(fit.weight).max())
        for s in SPLITS:
            assert direct.r2[s] == pytest.approx(fit.r2[s], rel=1e-7)
    groups = res.group_r2("test")
    assert res.dependency("test") == pytest.approx(np.mean(list(groups.values())))


def test_group_rho_chosen_per_model_on_validation(rng):
    dims = [3, 5, 5]
    data = three_splits(rng, [160, 150, 150], dims, noise=2.0)
    names = ["a", "b", "c"]
    grid = [1e-6, 0.01, 0.1, 1.0]
    res = decomposition(names, data).fit(rho_grid=grid, pairwise=False)
    joint = np.concatenate(data["train"], axis=1)
    trace_mean = np.trace(np.cov(joint.T, bias=True)) / joint.shape[1]
    for i, fit in enumerate(res.group):
        rest = [j for j in range(3) if j != i]
        u, z = stack(data["train"], [i]), stack(data["train"], rest)
        expected = []
        for rho in grid:
            w, b = ref_fit(u, z, rho * trace_mean)
            val = data["validation"]
            expected.append(ref_r2(stack(val, [i]), stack(val, rest), w, b)[0])
        np.testing.assert_allclose(fit.rho_scores, expected, rtol=1e-8)
        assert fit.rho == grid[int(np.argmax(expected))]
    assert res.rho_grid == tuple(grid)


# --------------------------------------------------------------------------- special cases


def test_one_dimensional_r2_is_squared_pearson(rng):
    data = three_splits(rng, [300, 50, 50], [1, 1], noise=1.0)
    res = decomposition(["u", "z"], data).fit(rho=0.0)
    r = np.corrcoef(data["train"][0][:, 0], data["train"][1][:, 0])[0, 1]
    table = res.r2_target_by_basis("train")
    assert table[0, 1] == pytest.approx(r**2, rel=1e-10)
    assert table[1, 0] == pytest.approx(r**2, rel=1e-10)
    assert np.isnan(table[0, 0]) and np.isnan(table[1, 1])
    assert res.pairwise[0].r2_per_dim["train"] == pytest.approx(r**2, rel=1e-10)


def test_invariant_to_basis_order_and_invertible_transforms(rng):
    dims = [3, 2, 3]
    data = three_splits(rng, [200, 60, 60], dims)
    fit = decomposition(["u", "b", "c"], data).fit_one("u", ["b", "c"], rho=0.0)
    swapped = decomposition(["u", "b", "c"], data).fit_one("u", ["c", "b"], rho=0.0)
    t = rng.standard_normal((5, 5)) + 3 * np.eye(5)
    shift = rng.standard_normal(5) * 10
    perm = rng.permutation(5)  # also move columns across the two blocks
    moved = {}
    for s, (u, b, c) in data.items():
        z = np.c_[b, c] @ t + shift
        moved[s] = [u, z[:, perm[:1]], z[:, perm[1:]]]
    transformed = decomposition(["u", "p", "q"], moved).fit_one("u", ["p", "q"], rho=0.0)
    for s in SPLITS:
        assert swapped.r2[s] == pytest.approx(fit.r2[s], rel=1e-10)
        assert transformed.r2[s] == pytest.approx(fit.r2[s], rel=1e-8)
        assert transformed.r2_per_dim[s] == pytest.approx(fit.r2_per_dim[s], rel=1e-8)


def test_held_out_r2_uses_the_scored_splits_own_mean(rng):
    data = three_splits(rng, [200, 60, 60], [2, 3])
    data["test"] = [data["test"][0] + 4.0, data["test"][1]]  # target shifted on test only
    fit = decomposition(["u", "z"], data).fit_one("u", "z", rho=0.01)
    u, z = data["test"]
    w, b = fit.weight, fit.bias
    ssr = ((u - z @ w.T - b) ** 2).sum()
    sst_own = ((u - u.mean(0)) ** 2).sum()
    sst_train = ((u - data["train"][0].mean(0)) ** 2).sum()
    assert fit.r2["test"] == pytest.approx(1 - ssr / sst_own, rel=1e-10)
    assert abs((1 - ssr / sst_train) - fit.r2["test"]) > 0.5
    assert fit.r2["test"] < 0  # the shift is an error the fit cannot explain


# --------------------------------------------------------------------------- compat mode


def ref_compat_f32(u, z):
    """The reference code's formula in float32: N−1 covariances, + 1e-6·I, solve."""
    u, z = u.astype(np.float32), z.astype(np.float32)
    d_z = z.shape[1]
    c = np.cov(np.concatenate([z, u], axis=1).T, dtype=np.float32)
    szz, szu = c[:d_z, :d_z], c[:d_z, d_z:]
    w = np.linalg.solve(szz + np.float32(1e-6) * np.eye(d_z, dtype=np.float32), szu).T
    b = u.mean(0) - w @ z.mean(0)
    return w, b


def ref_compat_r2_f32(u, z, w, b):
    u, z = u.astype(np.float32), z.astype(np.float32)
    e = u - z @ w.T - b
    return 1 - np.sum(e * e) / np.sum((u - u.mean(0)) ** 2)


def test_compat_mode_matches_float32_reference(rng):
    """At embedding scale 1e-3 the absolute α = 1e-6 is as large as the variances, so this
    checks the convention (absolute α on the N−1 covariance), not just the algebra."""
    names = ["a", "b", "c"]
    data = three_splits(rng, [400, 100, 100], [4, 3, 5], scale=1e-3)
    data = {s: [a.astype(np.float32) for a in v] for s, v in data.items()}
    dec = decomposition(names, data)
    res = dec.fit(mode="compat")
    assert res.mode == "compat" and res.ddof == 1 and res.alpha == 1e-6
    for fit in res.pairwise:
        i, j = names.index(fit.target[0]), names.index(fit.basis[0])
        w, b = ref_compat_f32(data["train"][i], data["train"][j])
        assert fit.lam == pytest.approx(1e-6, rel=1e-12)
        for s in SPLITS:
            ref = ref_compat_r2_f32(data[s][i], data[s][j], w, b)
            assert fit.r2[s] == pytest.approx(float(ref), abs=2e-4)
    for i, fit in enumerate(res.group):
        rest = [j for j in range(3) if j != i]
        w, b = ref_compat_f32(data["train"][i], stack(data["train"], rest))
        for s in SPLITS:
            ref = ref_compat_r2_f32(data[s][i], stack(data[s], rest), w, b)
            assert fit.r2[s] == pytest.approx(float(ref), abs=2e-4)
    default = dec.fit(rho=1e-8)
    gap = default.r2_target_by_basis("train") - res.r2_target_by_basis("train")
    assert np.nanmin(gap) > 0.01  # the absolute α shrinks these fits noticeably


def test_compat_mode_equals_float64_formula(rng):
    data = three_splits(rng, [150, 40, 40], [2, 3])
    fit = decomposition(["u", "z"], data).fit_one("u", "z", mode="compat", alpha=0.05)
    assert fit.lam == pytest.approx(0.05, rel=1e-12)
    n = 150
    assert_fit_matches(fit, data, [0], [1], 0.05, ddof=1, rtol=1e-10)
    assert fit.rho == pytest.approx(0.05 * (n - 1) / n / rel_lambda(data["train"][1], 1.0))


# --------------------------------------------------------------------------- outputs


def test_result_tables_json_and_csv(rng, tmp_path):
    names = ["bert", "roberta", "gpt2"]
    data = three_splits(rng, [300, 80, 80], [3, 2, 4])
    dec = decomposition(names, data, seed=7)
    res = dec.fit()
    assert len(res.pairwise) == 6 and len(res.group) == 3
    table = res.r2_target_by_basis("validation")
    for fit in res.pairwise:
        a, b = names.index(fit.target[0]), names.index(fit.basis[0])
        assert table[a, b] == fit.r2["validation"]
    one = dec.fit_one("gpt2", "bert")
    assert table[2, 0] == pytest.approx(one.r2["validation"], rel=1e-12)
    assert "target" in res.orientation and "columns are bases" in res.orientation

    doc = json.loads(res.to_json(tmp_path / "lmd.json"))
    assert doc == json.loads((tmp_path / "lmd.json").read_text(encoding="utf-8"))
    assert doc["models"] == [{"name": n, "dim": d} for n, d in zip(names, [3, 2, 4], strict=True)]
    assert doc["n"] == {"train": 300, "validation": 80, "test": 80}
    assert doc["seed"] == 7 and doc["lmdx_version"] == lmdx.__version__
    assert doc["regularization"]["rho_grid"] == list(lmdx.lmd.DEFAULT_RHO_GRID)
    assert doc["pairwise"][0]["target"] == ["bert"] and doc["pairwise"][0]["basis"] == ["roberta"]
    assert doc["dependency"]["test"] == pytest.approx(res.dependency("test"))
    assert all(isinstance(g["rho"], float) and g["lambda"] > 0 for g in doc["group"])

    res.to_csv(tmp_path / "lmd.csv")
    with open(tmp_path / "lmd.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len(rows) == (6 + 3) * 3
    row = next(
        r
        for r in rows
        if r["kind"] == "pairwise"
        and r["target"] == "gpt2"
        and r["basis"] == "bert"
        and r["split"] == "test"
    )
    assert float(row["r2"]) == res.r2_target_by_basis("test")[2, 0]
    assert int(row["n"]) == 80
    group_row = next(r for r in rows if r["kind"] == "group" and r["target"] == "bert")
    assert group_row["basis"] == "roberta;gpt2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lmd.csv", "lmd.json"]


def test_test_split_is_optional_and_validation_only_needed_for_a_grid(rng):
    data = three_splits(rng, [100, 30, 30], [2, 2])
    dec = decomposition(["a", "b"], {"train": data["train"]})
    res = dec.fit(rho=0.1)
    assert set(res.pairwise[0].r2) == {"train"}
    assert np.isnan(res.r2_target_by_basis("test")).all()
    with pytest.raises(ValueError, match=r"split 'validation' is empty.*rho"):
        dec.fit()


# --------------------------------------------------------------------------- errors


def test_warns_when_train_rows_are_few_per_basis_dimension(rng):
    data = three_splits(rng, [30, 20, 20], [2, 4, 4])
    dec = decomposition(["a", "b", "c"], data)
    with pytest.warns(lmdx.SampleSizeWarning, match=r"n_train = 30 .* D_z = 8"):
        fit = dec.fit_one("a", ["b", "c"], rho=0.1)
    assert fit.r2["train"] > fit.r2["test"]  # the optimism the warning is about
    with pytest.warns(lmdx.SampleSizeWarning) as record:
        res = dec.fit(rho=0.1)
    messages = [str(w.message) for w in record]
    assert len(messages) == 2
    assert "pairwise" in messages[0] and "D_z = 4" in messages[0]
    assert "group" in messages[1] and "D_z = 8" in messages[1]
    assert list(res.warnings) == messages
    dec.fit_one("b", "a", rho=0.1)  # 30 rows for D_z = 2: no warning (warnings are errors)


@pytest.mark.filterwarnings("ignore::lmdx.SampleSizeWarning")
def test_bad_inputs_give_clear_errors(rng):
    dec = lmdx.Decomposition(["bert", "gpt2"], [3, 2])
    good = [rng.standard_normal((5, 3)), rng.standard_normal((5, 2))]
    with pytest.raises(ValueError, match=r"model 'gpt2' has 4 rows but model 'bert' has 5"):
        dec.add("train", [good[0], good[1][:4]])
    nan = good[1].copy()
    nan[2, 1] = np.nan
    with pytest.raises(ValueError, match=r"split 'train', model 'gpt2'.*NaN or Inf.*row 2"):
        dec.add("train", [good[0], nan])
    with pytest.raises(ValueError, match=r"unknown split 'dev'"):
        dec.add("dev", good)
    with pytest.raises(ValueError, match=r"model 'bert': expected embeddings of shape \(n, 3\)"):
        dec.add("test", [good[0][:, :2], good[1]])
    with pytest.raises(ValueError, match=r"expected 2 arrays \(one per model: bert, gpt2\)"):
        dec.add("train", good[:1])
    with pytest.raises(ValueError, match=r"missing \['gpt2'\]"):
        dec.add("train", {"bert": good[0]})
    with pytest.raises(ValueError, match=r"split 'train' is empty"):
        dec.fit(rho=0.1)
    assert dec.counts == {"train": 0, "validation": 0, "test": 0}  # nothing partial was added

    dec.add("train", [g[:1] for g in good])
    with pytest.raises(ValueError, match=r"split 'train' has 1 row"):
        dec.fit(rho=0.1)
    dec.add("train", good)
    with pytest.raises(ValueError, match=r"unknown model 'gpt3'"):
        dec.fit_one("gpt3", "bert", rho=0.1)
    with pytest.raises(ValueError, match=r"in both target and basis"):
        dec.fit_one("bert", ["bert", "gpt2"], rho=0.1)
    with pytest.raises(ValueError, match=r"either rho .* or rho_grid"):
        dec.fit(rho=0.1, rho_grid=[0.1])
    with pytest.raises(ValueError, match=r"mode='compat' uses the reference's absolute alpha"):
        dec.fit(mode="compat", rho=0.1)
    with pytest.raises(ValueError, match=r"rho_grid: is empty"):
        dec.fit(rho_grid=[])
    with pytest.raises(ValueError, match=r"ridge values must be finite and >= 0"):
        dec.fit(rho=-1.0)
    with pytest.raises(ValueError, match=r"unknown split 'dev'"):
        dec.fit(rho=0.1).r2_target_by_basis("dev")
    with pytest.raises(ValueError, match=r"model 'bert' is listed twice"):
        lmdx.Decomposition(["bert", "bert"], [3, 3])
    with pytest.raises(ValueError, match=r"need at least two models"):
        lmdx.Decomposition(["bert"], [3]).fit()
