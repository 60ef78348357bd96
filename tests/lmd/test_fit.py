"""LMD fits (lmdx.lmd.fit: direct, group and compat) against float64 NumPy references.

The references (np.linalg.lstsq, np.linalg.solve, R² over rows) are in lmd_reference.py
or written in the test; lmdx only ever sees the arrays streamed in.
"""

from __future__ import annotations

import lmdx
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from lmd_reference import (
    SPLITS,
    assert_fit_matches,
    decomposition,
    ref_fit,
    ref_r2,
    rel_lambda,
    stack,
    three_splits,
)

seeds = st.integers(0, 2**32 - 1)


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
    fit = dec.fit_one("u", ["z1", "z2"], ridge=1e-8)
    signal = np.sum(w**2, axis=1)
    per_dim = np.mean(signal / (signal + sigma**2))
    # Sampling error of R² at n = 20 000 is ~0.003; in-sample bias ~ D_z/n = 2.5e-4.
    for split in SPLITS:
        assert fit.r2[split] == pytest.approx(target, abs=0.015)
        assert fit.r2_per_dim[split] == pytest.approx(per_dim, abs=0.015)


@given(dims=st.lists(st.integers(1, 4), min_size=3, max_size=4), seed=seeds)
def test_ridge_zero_equals_lstsq_with_intercept(dims, seed):
    rng = np.random.default_rng(seed)
    t_idx, z_idx = [0], list(range(1, len(dims)))
    d_z = sum(dims[1:])
    n = 10 * d_z + int(rng.integers(5, 40))
    data = three_splits(rng, [n, 30, 25], dims)
    names = [f"m{i}" for i in range(len(dims))]
    fit = decomposition(names, data).fit_one("m0", names[1:], ridge=0.0)

    u, z = stack(data["train"], t_idx), stack(data["train"], z_idx)
    coef, *_ = np.linalg.lstsq(np.c_[z, np.ones(len(z))], u, rcond=None)
    w, b = coef[:-1].T, coef[-1]
    np.testing.assert_allclose(fit.weight, w, rtol=0, atol=1e-9 * np.abs(w).max())
    np.testing.assert_allclose(fit.bias, b, rtol=0, atol=1e-9 * (np.abs(b).max() + 1))
    for split, arrays in data.items():
        pooled, per_dim = ref_r2(stack(arrays, t_idx), stack(arrays, z_idx), w, b)
        assert fit.r2[split] == pytest.approx(pooled, rel=1e-9, abs=1e-9)
        assert fit.r2_per_dim[split] == pytest.approx(per_dim, rel=1e-9, abs=1e-9)
    assert fit.ridge == 0.0 and fit.ridge_absolute == 0.0 and fit.ridge_scores is None


@given(rho=st.sampled_from([1e-4, 0.01, 0.3, 1.0, 5.0]), seed=seeds)
def test_fixed_relative_ridge_matches_reference(rho, seed):
    rng = np.random.default_rng(seed)
    dims = [3, 2, 4]
    data = three_splits(rng, [150, 40, 40], dims, scale=float(rng.uniform(0.01, 100)))
    dec = decomposition(["a", "b", "c"], data)
    fit = dec.fit_one(["a", "c"], "b", ridge=rho)
    lam = rel_lambda(data["train"][1], rho)
    assert fit.ridge_absolute == pytest.approx(lam, rel=1e-12)
    assert fit.ridge == rho
    assert fit.weight.shape == (7, 2) and fit.bias.shape == (7,)
    assert_fit_matches(fit, data, [0, 2], [1], lam)


def test_ridge_chosen_on_validation(rng):
    """Few train rows for the basis size, so the grid's validation R² has an interior
    maximum; the chosen ρ and every grid score match the reference."""
    dims = [4, 6, 6]
    data = three_splits(rng, [130, 200, 200], dims, noise=2.0)
    dec = decomposition(["a", "b", "c"], data)
    grid = [1e-6, 1e-3, 0.03, 0.1, 0.3, 1.0, 3.0]
    fit = dec.fit_one("a", ["b", "c"], ridge_grid=grid)
    u, z = stack(data["train"], [0]), stack(data["train"], [1, 2])
    expected = []
    for rho in grid:
        w, b = ref_fit(u, z, rel_lambda(z, rho))
        expected.append(ref_r2(data["validation"][0], stack(data["validation"], [1, 2]), w, b)[0])
    np.testing.assert_allclose(fit.ridge_scores, expected, rtol=1e-9)
    best = grid[int(np.argmax(expected))]
    assert 1e-6 < best < 3.0  # the test is only meaningful with an interior optimum
    assert fit.ridge == best
    assert_fit_matches(fit, data, [0], [1, 2], rel_lambda(z, best))


def test_default_grid_is_sorted_and_scale_free(rng):
    grid = lmdx.lmd.DEFAULT_RIDGE_GRID
    assert list(grid) == sorted(grid) and grid[0] > 0 and grid[-1] <= 1
    data = three_splits(rng, [200, 60, 60], [2, 3])
    small = decomposition(["a", "b"], {s: [x * 1e-4 for x in v] for s, v in data.items()})
    large = decomposition(["a", "b"], {s: [x * 1e4 for x in v] for s, v in data.items()})
    f_small, f_large = small.fit_one("a", "b"), large.fit_one("a", "b")
    np.testing.assert_allclose(f_small.ridge_scores, f_large.ridge_scores, rtol=1e-9)
    for s in SPLITS:
        assert f_small.r2[s] == pytest.approx(f_large.r2[s], rel=1e-8)


@pytest.mark.parametrize("rho", [1e-6, 0.05, 1.0])
def test_group_fits_equal_direct_fits_with_the_same_lambda(rng, rho):
    dims = [3, 1, 4, 2]
    names = ["a", "b", "c", "d"]
    data = three_splits(rng, [200, 50, 50], dims, scale=float(rng.uniform(0.1, 10)))
    dec = decomposition(names, data)
    res = dec.fit(ridge=rho, pairwise=False, keep_weights=True)
    joint = np.concatenate(data["train"], axis=1)
    lam = rho * np.trace(np.cov(joint.T, bias=True)) / joint.shape[1]
    assert [f.target for f in res.group] == [(n,) for n in names]
    for i, fit in enumerate(res.group):
        rest = [j for j in range(4) if j != i]
        assert fit.basis == tuple(names[j] for j in rest)
        assert fit.ridge_absolute == pytest.approx(lam, rel=1e-12)
        assert_fit_matches(fit, data, [i], rest, lam, rtol=1e-7)
        # The same fit through the direct path, with ρ converted to that basis's scale.
        z = stack(data["train"], rest)
        direct = dec.fit_one(names[i], fit.basis, ridge=lam / rel_lambda(z, 1.0))
        np.testing.assert_allclose(direct.weight, fit.weight, atol=1e-7 * np.abs(fit.weight).max())
        for s in SPLITS:
            assert direct.r2[s] == pytest.approx(fit.r2[s], rel=1e-7)
    groups = res.group_r2("test")
    assert res.dependency("test") == pytest.approx(np.mean(list(groups.values())))


def group_fits(dec, *, block, **plan_args):
    """fit_groups with the factorization's block size set (the public fit uses 512)."""
    plan = lmdx.lmd.fit.ridge_plan("default", **plan_args)
    stats = lmdx.lmd.fit.split_stats(dec.splits, plan)
    return lmdx.lmd.fit.fit_groups(
        dec.layout, stats, plan, keep_weights=True, allow_regularization=True, n_threads=1,
        block=block,
    )  # fmt: skip


@given(
    dims=st.lists(st.integers(1, 5), min_size=2, max_size=4),
    scales=st.lists(st.sampled_from([1e-2, 1.0, 30.0]), min_size=4, max_size=4),
    rho=st.sampled_from([0.0, 1e-6, 0.05, 1.0]),
    block=st.integers(1, 7),
    seed=seeds,
)
def test_group_fits_of_any_widths_and_blocks_match_reference(dims, scales, rho, block, seed):
    """Blocks of different widths and scales, the factorization split into blocks that do
    not line up with the models' blocks; every fit against its own float64 solve."""
    rng = np.random.default_rng(seed)
    n = 12 * sum(dims) + 20
    data = three_splits(rng, [n, 40, 30], dims)
    data = {s: [a * c for a, c in zip(v, scales, strict=False)] for s, v in data.items()}
    names = [f"m{i}" for i in range(len(dims))]
    fits = group_fits(decomposition(names, data), block=block, ridge=rho)
    joint = np.concatenate(data["train"], axis=1)
    lam = rho * np.trace(np.cov(joint.T, bias=True)) / joint.shape[1]
    for i, fit in enumerate(fits):
        rest = [j for j in range(len(dims)) if j != i]
        assert fit.ridge == rho and fit.ridge_absolute == pytest.approx(lam, rel=1e-12)
        assert_fit_matches(fit, data, [i], rest, lam, rtol=1e-9)


def test_group_fits_do_not_depend_on_the_block_size(rng):
    dims = [3, 1, 4, 2, 5]
    data = three_splits(rng, [300, 60, 60], dims)
    dec = decomposition([f"m{i}" for i in range(5)], data)
    whole = group_fits(dec, block=512, ridge=1e-4)
    for block in (1, 2, 6):
        for a, b in zip(whole, group_fits(dec, block=block, ridge=1e-4), strict=True):
            np.testing.assert_allclose(b.weight, a.weight, rtol=0, atol=1e-11 * abs(a.weight).max())
            for s in SPLITS:
                assert b.r2[s] == pytest.approx(a.r2[s], rel=1e-12)


@given(d=st.integers(1, 40), block=st.integers(1, 12), seed=seeds)
def test_cholesky_inverse_lower_matches_numpy_inverse(d, block, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((d + 5, d)) * rng.uniform(0.1, 10, d)
    a = x.T @ x / (d + 5) + 0.1 * np.eye(d)
    m = a.copy()
    assert lmdx.lmd.fit.cholesky_inverse_lower(m, 1e-13, block=block)
    expected = np.linalg.inv(a)
    scale = np.abs(expected).max()
    np.testing.assert_allclose(np.tril(m), np.tril(expected), rtol=0, atol=1e-10 * scale)
    for lo in range(0, d, block):  # the diagonal blocks are written in full
        hi = min(lo + block, d)
        np.testing.assert_allclose(m[lo:hi, lo:hi], expected[lo:hi, lo:hi], atol=1e-10 * scale)


@pytest.mark.parametrize("block", [1, 3, 512])
def test_cholesky_inverse_lower_refuses_what_is_not_positive_definite(rng, block):
    x = rng.standard_normal((4, 9))
    singular = x.T @ x  # rank 4 of 9
    indefinite = np.diag([1.0, 2.0, -1e-3, 4.0, 5.0])
    for a in (singular, indefinite):
        assert not lmdx.lmd.fit.cholesky_inverse_lower(a.copy(), 1e-13, block=block)
    # Positive definite, but a squared pivot (1e-14) below tiny = 1e-13 x mean diagonal 1.
    assert not lmdx.lmd.fit.cholesky_inverse_lower(np.diag([1.0, 1e-14, 2.0]), 1e-13, block=block)
    assert lmdx.lmd.fit.cholesky_inverse_lower(np.diag([1.0, 1e-12, 2.0]), 1e-13, block=block)


def test_singular_joint_covariance_escalates_the_ridge_or_fails(rng):
    """A model that is an exact copy of another makes Σ singular: at ridge 0 the ridge is
    escalated as lmdx.spd_solve does (with its warning), and the fits use that ridge; with
    regularization forbidden it is an error naming the system."""
    data = three_splits(rng, [200, 50, 50], [3, 2])
    data = {s: [v[0], v[1], v[0].copy()] for s, v in data.items()}
    names = ["a", "b", "a_copy"]
    dec = decomposition(names, data)
    with pytest.warns(lmdx.RegularizationWarning, match="LMD group fits: Σ"):
        res = dec.fit(ridge=0.0, pairwise=False, keep_weights=True)
    joint = np.concatenate(data["train"], axis=1)
    mean_diag = np.trace(np.cov(joint.T, bias=True)) / joint.shape[1]
    for i, fit in enumerate(res.group):
        assert fit.ridge > 0
        assert fit.ridge_absolute == pytest.approx(fit.ridge * mean_diag, rel=1e-12)
        rest = [j for j in range(3) if j != i]
        assert_fit_matches(fit, data, [i], rest, fit.ridge_absolute, rtol=1e-6, weights=False)
    assert (
        res.group[1].r2["train"] < 0.999 < res.group[0].r2["train"]
    )  # the copies explain each other
    with pytest.raises(lmdx.NotPositiveDefiniteError, match="LMD group fits: Σ"):
        dec.fit(ridge=0.0, pairwise=False, allow_regularization=False)


def test_group_ridge_chosen_per_model_on_validation(rng):
    dims = [3, 5, 5]
    data = three_splits(rng, [160, 150, 150], dims, noise=2.0)
    names = ["a", "b", "c"]
    grid = [1e-6, 0.01, 0.1, 1.0]
    res = decomposition(names, data).fit(ridge_grid=grid, pairwise=False)
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
        np.testing.assert_allclose(fit.ridge_scores, expected, rtol=1e-8)
        assert fit.ridge == grid[int(np.argmax(expected))]
    assert res.ridge_grid == tuple(grid)


def test_one_dimensional_r2_is_squared_pearson(rng):
    data = three_splits(rng, [300, 50, 50], [1, 1], noise=1.0)
    res = decomposition(["u", "z"], data).fit(ridge=0.0)
    r = np.corrcoef(data["train"][0][:, 0], data["train"][1][:, 0])[0, 1]
    table = res.r2_target_by_basis("train")
    assert table[0, 1] == pytest.approx(r**2, rel=1e-10)
    assert table[1, 0] == pytest.approx(r**2, rel=1e-10)
    assert np.isnan(table[0, 0]) and np.isnan(table[1, 1])
    assert res.pairwise[0].r2_per_dim["train"] == pytest.approx(r**2, rel=1e-10)


def test_invariant_to_basis_order_and_invertible_transforms(rng):
    dims = [3, 2, 3]
    data = three_splits(rng, [200, 60, 60], dims)
    fit = decomposition(["u", "b", "c"], data).fit_one("u", ["b", "c"], ridge=0.0)
    swapped = decomposition(["u", "b", "c"], data).fit_one("u", ["c", "b"], ridge=0.0)
    t = rng.standard_normal((5, 5)) + 3 * np.eye(5)
    shift = rng.standard_normal(5) * 10
    perm = rng.permutation(5)  # also move columns across the two blocks
    moved = {}
    for s, (u, b, c) in data.items():
        z = np.c_[b, c] @ t + shift
        moved[s] = [u, z[:, perm[:1]], z[:, perm[1:]]]
    transformed = decomposition(["u", "p", "q"], moved).fit_one("u", ["p", "q"], ridge=0.0)
    for s in SPLITS:
        assert swapped.r2[s] == pytest.approx(fit.r2[s], rel=1e-10)
        assert transformed.r2[s] == pytest.approx(fit.r2[s], rel=1e-8)
        assert transformed.r2_per_dim[s] == pytest.approx(fit.r2_per_dim[s], rel=1e-8)


def test_held_out_r2_uses_the_scored_splits_own_mean(rng):
    data = three_splits(rng, [200, 60, 60], [2, 3])
    data["test"] = [data["test"][0] + 4.0, data["test"][1]]  # target shifted on test only
    fit = decomposition(["u", "z"], data).fit_one("u", "z", ridge=0.01)
    u, z = data["test"]
    w, b = fit.weight, fit.bias
    ssr = ((u - z @ w.T - b) ** 2).sum()
    sst_own = ((u - u.mean(0)) ** 2).sum()
    sst_train = ((u - data["train"][0].mean(0)) ** 2).sum()
    assert fit.r2["test"] == pytest.approx(1 - ssr / sst_own, rel=1e-10)
    assert abs((1 - ssr / sst_train) - fit.r2["test"]) > 0.5
    assert fit.r2["test"] < 0  # the shift is an error the fit cannot explain


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
    assert res.mode == "compat" and res.ddof == 1 and res.ridge_absolute == 1e-6
    for fit in res.pairwise:
        i, j = names.index(fit.target[0]), names.index(fit.basis[0])
        w, b = ref_compat_f32(data["train"][i], data["train"][j])
        assert fit.ridge_absolute == pytest.approx(1e-6, rel=1e-12)
        for s in SPLITS:
            ref = ref_compat_r2_f32(data[s][i], data[s][j], w, b)
            assert fit.r2[s] == pytest.approx(float(ref), abs=2e-4)
    for i, fit in enumerate(res.group):
        rest = [j for j in range(3) if j != i]
        w, b = ref_compat_f32(data["train"][i], stack(data["train"], rest))
        for s in SPLITS:
            ref = ref_compat_r2_f32(data[s][i], stack(data[s], rest), w, b)
            assert fit.r2[s] == pytest.approx(float(ref), abs=2e-4)
    default = dec.fit(ridge=1e-8)
    gap = default.r2_target_by_basis("train") - res.r2_target_by_basis("train")
    assert np.nanmin(gap) > 0.01  # the absolute α shrinks these fits noticeably


def test_compat_mode_equals_float64_formula(rng):
    data = three_splits(rng, [150, 40, 40], [2, 3])
    fit = decomposition(["u", "z"], data).fit_one("u", "z", mode="compat", ridge_absolute=0.05)
    assert fit.ridge_absolute == pytest.approx(0.05, rel=1e-12)
    n = 150
    assert_fit_matches(fit, data, [0], [1], 0.05, ddof=1, rtol=1e-10)
    assert fit.ridge == pytest.approx(0.05 * (n - 1) / n / rel_lambda(data["train"][1], 1.0))
