"""lmdx.regmean_merge_layer against the RegMean paper's formula, in float64, written here."""

from __future__ import annotations

import lmdx
import numpy as np
import pytest
import scipy.linalg
from hypothesis import given
from hypothesis import strategies as st

ALPHAS = (1.0, 0.9, 0.1, 0.0)
seeds = st.integers(0, 2**32 - 1)


def reference_merge(grams, counts, weights, alpha, coefficients=None, layout="linear"):
    """Jin et al. (2023): Ĝ_i = G_i/n_i, G̃_i = α Ĝ_i + (1−α) diag(Ĝ_i),
    W_Mᵀ = (Σ c_i G̃_i)⁻¹ Σ c_i G̃_i W_iᵀ.  Returned in the layout of the inputs."""
    k = len(grams)
    c = np.ones(k) if coefficients is None else np.asarray(coefficients, dtype=np.float64)
    lhs = 0.0
    rhs = 0.0
    for i in range(k):
        g_hat = np.asarray(grams[i], dtype=np.float64) / counts[i]
        g_tilde = alpha * g_hat + (1.0 - alpha) * np.diag(np.diag(g_hat))
        w = np.asarray(weights[i], dtype=np.float64)
        w_t = w.T if layout == "linear" else w  # W_iᵀ: [in, out]
        lhs = lhs + c[i] * g_tilde
        rhs = rhs + c[i] * g_tilde @ w_t
    merged_t = scipy.linalg.solve(lhs, rhs, assume_a="pos")
    return merged_t.T if layout == "linear" else merged_t


def make_models(rng, k, d_in, d_out, dtype=np.float64):
    """K models: input rows X_i (n_i, d_in) with per-model scales, G_i = X_iᵀX_i, W_i."""
    grams, counts, weights, rows = [], [], [], []
    for _ in range(k):
        n = int(rng.integers(2 * d_in + 3, 3 * d_in + 10))
        x = rng.standard_normal((n, d_in)) * rng.uniform(0.2, 3.0, d_in) + rng.normal(0, 0.5, d_in)
        rows.append(x)
        grams.append(x.T @ x)
        counts.append(float(n))
        weights.append(rng.standard_normal((d_out, d_in)).astype(dtype))
    return grams, counts, weights, rows


def assert_merged_close(got, ref, rtol=1e-9):
    assert got.shape == ref.shape and got.dtype == np.float64
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    assert err <= rtol, f"relative error {err:.3g}"


# --------------------------------------------------------------------------- accuracy


@given(
    k=st.integers(1, 3),
    d_in=st.integers(1, 12),
    d_out=st.integers(1, 10),
    alpha=st.sampled_from(ALPHAS),
    use_coefficients=st.booleans(),
    dtype=st.sampled_from([np.float32, np.float64]),
    layout=st.sampled_from(["linear", "conv1d"]),
    threads=st.sampled_from([1, 2]),
    seed=seeds,
)
def test_matches_paper_formula(
    k, d_in, d_out, alpha, use_coefficients, dtype, layout, threads, seed
):
    rng = np.random.default_rng(seed)
    grams, counts, weights, _ = make_models(rng, k, d_in, d_out, dtype)
    coefficients = list(rng.uniform(0.1, 3.0, k)) if use_coefficients else None
    if layout == "conv1d":
        weights = [np.ascontiguousarray(w.T) for w in weights]
    res = lmdx.regmean_merge_layer(
        grams,
        weights,
        counts,
        alpha=alpha,
        coefficients=coefficients,
        layout=layout,
        n_threads=threads,
    )
    ref = reference_merge(grams, counts, weights, alpha, coefficients, layout)
    assert_merged_close(res.weight, ref)
    assert not res.info.escalated


@given(
    k=st.integers(1, 3),
    d_in=st.integers(1, 10),
    d_out=st.integers(1, 8),
    alpha=st.sampled_from(ALPHAS),
    seed=seeds,
)
def test_conv1d_layout_is_the_transposed_linear_result(k, d_in, d_out, alpha, seed):
    rng = np.random.default_rng(seed)
    grams, counts, weights, _ = make_models(rng, k, d_in, d_out)
    linear = lmdx.regmean_merge_layer(grams, weights, counts, alpha=alpha).weight
    conv = lmdx.regmean_merge_layer(
        grams, [np.ascontiguousarray(w.T) for w in weights], counts, alpha=alpha, layout="conv1d"
    ).weight
    assert linear.shape == (d_out, d_in) and conv.shape == (d_in, d_out)
    np.testing.assert_allclose(conv, linear.T, rtol=1e-13, atol=1e-13 * np.abs(linear).max())


@given(k=st.integers(1, 3), d_in=st.integers(1, 8), seed=seeds)
def test_alpha_zero_is_per_feature_weighted_average(k, d_in, seed):
    # α = 0: W_M[:, j] = Σ_i c_i Ĝ_i[j, j] W_i[:, j] / Σ_i c_i Ĝ_i[j, j]  (no solve needed)
    rng = np.random.default_rng(seed)
    grams, counts, weights, _ = make_models(rng, k, d_in, 5)
    c = rng.uniform(0.5, 2.0, k)
    scale = np.array([c[i] * np.diag(grams[i]) / counts[i] for i in range(k)])  # (k, d_in)
    expected = np.einsum("kj,koj->oj", scale, np.array(weights)) / scale.sum(axis=0)
    got = lmdx.regmean_merge_layer(grams, weights, counts, alpha=0.0, coefficients=list(c))
    np.testing.assert_allclose(got.weight, expected, rtol=1e-12, atol=1e-14)


def test_moments_as_grams_take_counts_from_them(rng):
    d_in, d_out = 6, 4
    weights = [rng.standard_normal((d_out, d_in)) for _ in range(2)]
    grams, counts, stats = [], [], []
    for _ in range(2):
        x = rng.standard_normal((3, 30, d_in)) + 0.3
        mask = rng.random((3, 30)) < 0.8
        stats.append(lmdx.Moments(d_in, chunk_rows=16).update(x, mask=mask))
        kept = x[mask]
        grams.append(kept.T @ kept)  # independent reference statistics
        counts.append(float(mask.sum()))
    res = lmdx.regmean_merge_layer(stats, weights, alpha=0.9)
    assert_merged_close(res.weight, reference_merge(grams, counts, weights, 0.9))
    # Explicit counts override the Moments' own counts.
    doubled = lmdx.regmean_merge_layer(stats, weights, [2 * c for c in counts], alpha=0.9)
    assert_merged_close(
        doubled.weight, reference_merge(grams, [2 * c for c in counts], weights, 0.9)
    )


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("layout", ["linear", "conv1d"])
def test_wide_output_uses_chunks_and_row_blocks_and_threads_agree(rng, alpha, layout):
    # d_out = 1100 spans two 1024-column chunks of the right-hand side (W_i^T widened per
    # chunk) and d_in = 300 three row blocks of 128; the solve spans column blocks too.
    grams, counts, weights, _ = make_models(rng, 3, 300, 1100, np.float32)
    if layout == "conv1d":
        weights = [np.ascontiguousarray(w.T) for w in weights]
    coefficients = [1.0, 0.5, 2.0]
    runs = [
        lmdx.regmean_merge_layer(
            grams,
            weights,
            counts,
            alpha=alpha,
            coefficients=coefficients,
            layout=layout,
            precision="float64",
            n_threads=t,
        )
        for t in (1, 2, 3)
    ]
    for other in runs[1:]:
        assert np.array_equal(runs[0].weight, other.weight), "thread counts must agree bit for bit"
    ref = reference_merge(grams, counts, weights, alpha, coefficients, layout=layout)
    assert_merged_close(runs[0].weight, ref)


def test_large_input_dimension_uses_blocked_factorization(rng):
    # d_in = 300 > 256: the blocked, threaded Cholesky path.
    grams, counts, weights, _ = make_models(rng, 2, 300, 20)
    one, two = (
        lmdx.regmean_merge_layer(
            grams, weights, counts, alpha=0.9, precision="float64", n_threads=threads
        )
        for threads in (1, 2)
    )
    assert np.array_equal(one.weight, two.weight)
    assert_merged_close(one.weight, reference_merge(grams, counts, weights, 0.9))


@pytest.mark.parametrize("d_out", [1, 7, 16, 17, 32, 33])
def test_few_output_columns_solve_by_rows_and_threads_agree(rng, d_out):
    # Up to 32 right-hand sides are solved by rows across the threads, 16 at a time (17 and
    # 32: two slices, the second padded); d_in = 203 spans four diagonal blocks of 64, the
    # last partial, and tasks of 8 rows, the last partial. 33 takes the column blocks.
    grams, counts, weights, _ = make_models(rng, 3, 203, d_out)
    runs = [
        lmdx.regmean_merge_layer(
            grams, weights, counts, alpha=0.9, precision="float64", n_threads=threads
        )
        for threads in (1, 2, 3)
    ]
    for other in runs[1:]:
        assert np.array_equal(runs[0].weight, other.weight), "thread counts must agree bit for bit"
    assert_merged_close(runs[0].weight, reference_merge(grams, counts, weights, 0.9))


@given(d_in=st.integers(1, 10), d_out=st.integers(1, 10), alpha=st.sampled_from(ALPHAS), seed=seeds)
def test_single_model_returns_its_own_weight(d_in, d_out, alpha, seed):
    rng = np.random.default_rng(seed)
    grams, counts, weights, _ = make_models(rng, 1, d_in, d_out)
    res = lmdx.regmean_merge_layer(grams, weights, counts, alpha=alpha)
    np.testing.assert_allclose(res.weight, weights[0], rtol=1e-10, atol=1e-10)


@given(k=st.integers(2, 3), alpha=st.sampled_from(ALPHAS), seed=seeds, f32=st.booleans())
def test_identical_models_return_that_weight(k, alpha, seed, f32):
    rng = np.random.default_rng(seed)
    grams, counts, weights, _ = make_models(rng, k, 7, 5)
    w = weights[0].astype(np.float32) if f32 else weights[0]
    res = lmdx.regmean_merge_layer(grams, [w] * k, counts, alpha=alpha)
    np.testing.assert_allclose(res.weight, w.astype(np.float64), rtol=1e-10, atol=1e-10)


def test_zero_coefficient_drops_a_model(rng):
    grams, counts, weights, _ = make_models(rng, 3, 5, 4)
    got = lmdx.regmean_merge_layer(grams, weights, counts, coefficients=[1.0, 0.0, 2.0]).weight
    ref = reference_merge(
        [grams[0], grams[2]], [counts[0], counts[2]], [weights[0], weights[2]], 1.0, [1.0, 2.0]
    )
    assert_merged_close(got, ref)


def test_inputs_not_modified(rng):
    grams, counts, weights, _ = make_models(rng, 2, 5, 4, np.float32)
    before = [g.copy() for g in grams], [w.copy() for w in weights]
    lmdx.regmean_merge_layer(grams, weights, counts, alpha=0.5)
    assert all(np.array_equal(a, b) for a, b in zip(grams, before[0], strict=False))
    assert all(np.array_equal(a, b) for a, b in zip(weights, before[1], strict=False))


# --------------------------------------------------------------------------- singular sums


def test_never_active_feature_is_regularized_with_a_warning_naming_the_layer(rng):
    grams, counts, weights, rows = make_models(rng, 2, 6, 3)
    for i, x in enumerate(rows):  # input feature 2 is never active in any model
        x[:, 2] = 0.0
        grams[i] = x.T @ x
    with pytest.warns(lmdx.RegularizationWarning, match=r"^h\.0\.mlp\.fc: not numerically"):
        res = lmdx.regmean_merge_layer(grams, weights, counts, name="h.0.mlp.fc")
    assert res.info.escalated
    # Reference with the ridge the solver reports, relative to mean diag of Σ c_i Ĝ_i,
    # solved for the deviation from the average W̄ (the documented formula).
    mean = sum(weights) / 2
    lhs = sum(g / n for g, n in zip(grams, counts, strict=False))
    ridge = res.info.ridge * np.mean(np.diag(lhs))
    rhs = sum(g / n @ (w - mean).T for g, n, w in zip(grams, counts, weights, strict=False))
    expected = mean + np.linalg.solve(lhs + ridge * np.eye(6), rhs).T
    assert_merged_close(res.weight, expected, rtol=1e-6)
    # The input direction no statistics reached keeps the models' average exactly.
    np.testing.assert_allclose(res.weight[:, 2], mean[:, 2], rtol=0, atol=1e-12)
    with pytest.raises(
        lmdx.NotPositiveDefiniteError, match=r"^h\.0\.mlp\.fc: not numerically positive definite"
    ):
        lmdx.regmean_merge_layer(
            grams, weights, counts, allow_regularization=False, name="h.0.mlp.fc"
        )


def test_explicit_ridge(rng):
    grams, counts, weights, _ = make_models(rng, 2, 5, 4)
    res = lmdx.regmean_merge_layer(grams, weights, counts, alpha=0.9, ridge=0.05)
    mean = (weights[0] + weights[1]) / 2
    reduced = [
        0.9 * g / n + 0.1 * np.diag(np.diag(g / n)) for g, n in zip(grams, counts, strict=False)
    ]
    lhs = sum(reduced)
    rhs = sum(r @ (w - mean).T for r, w in zip(reduced, weights, strict=False))
    lhs_reg = lhs + 0.05 * np.mean(np.diag(lhs)) * np.eye(5)
    assert_merged_close(res.weight, mean + np.linalg.solve(lhs_reg, rhs).T)
    assert res.info.ridge == 0.05 and not res.info.escalated


# --------------------------------------------------------------------------- errors


@pytest.fixture
def models(rng):
    grams, counts, weights, _ = make_models(rng, 2, 5, 4)
    return grams, counts, weights


def test_mismatched_weight_shapes(models):
    grams, counts, weights = models
    with pytest.raises(
        ValueError,
        match=r"^enc\.q: weights\[1\] is a float64 array of shape \(4, 3\) .*same architecture",
    ):
        lmdx.regmean_merge_layer(grams, [weights[0], weights[1][:, :3]], counts, name="enc.q")


def test_gram_dimension_mismatch(models):
    grams, counts, weights = models
    with pytest.raises(
        ValueError,
        match=r"^enc\.q: grams\[1\] is a .*\(4, 4\) but the layer's input dimension is 5",
    ):
        lmdx.regmean_merge_layer([grams[0], np.eye(4)], weights, counts, name="enc.q")
    with pytest.raises(
        ValueError, match=r"^enc\.q: grams\[0\] is a .*\(5, 5\) .*input dimension is 4"
    ):
        lmdx.regmean_merge_layer(grams, weights, counts, layout="conv1d", name="enc.q")


def test_wrong_number_of_counts_weights_or_models(models):
    grams, counts, weights = models
    with pytest.raises(ValueError, match=r"^enc\.q: counts has 1 entries but there are 2 grams"):
        lmdx.regmean_merge_layer(grams, weights, counts[:1], name="enc.q")
    with pytest.raises(ValueError, match=r"^enc\.q: counts are required when grams are arrays"):
        lmdx.regmean_merge_layer(grams, weights, name="enc.q")
    with pytest.raises(ValueError, match=r"need one entry per model, got 2, 2, 1"):
        lmdx.regmean_merge_layer(grams, weights[:1], counts)
    with pytest.raises(ValueError, match=r"need at least one model"):
        lmdx.regmean_merge_layer([], [], [])


@pytest.mark.parametrize("bad", [0.0, -3.0, float("nan")])
def test_non_positive_count(models, bad):
    grams, counts, weights = models
    with pytest.raises(ValueError, match=r"^enc\.q: counts\[1\] must be > 0"):
        lmdx.regmean_merge_layer(grams, weights, [counts[0], bad], name="enc.q")


def test_count_zero_from_empty_moments(models):
    _, _, weights = models
    stats = [lmdx.Moments(5).update(np.ones((3, 5)) + np.eye(3, 5)), lmdx.Moments(5)]
    with pytest.raises(ValueError, match=r"^enc\.q: counts\[1\] must be > 0"):
        lmdx.regmean_merge_layer(stats, weights, name="enc.q")


def test_non_symmetric_gram(models):
    grams, counts, weights = models
    skewed = grams[1] + np.triu(np.ones((5, 5)), 1)
    with pytest.raises(ValueError, match=r"^enc\.q: grams\[1\]: not symmetric"):
        lmdx.regmean_merge_layer([grams[0], skewed], weights, counts, name="enc.q")


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("value", [np.nan, np.inf])
def test_non_finite_weight_names_layer_and_index(models, dtype, value):
    grams, counts, weights = models
    bad = weights[1].astype(dtype)
    bad[2, 3] = value
    kind = "NaN" if np.isnan(value) else "Inf"
    with pytest.raises(
        ValueError,
        match=rf"^blocks\.7\.attn\.out: weights\[1\]: contains {kind} at row 2, column 3",
    ):
        lmdx.regmean_merge_layer(grams, [weights[0], bad], counts, name="blocks.7.attn.out")


def test_non_finite_gram_names_layer_and_index(models):
    grams, counts, weights = models
    bad = grams[0].copy()
    bad[1, 1] = np.nan
    with pytest.raises(ValueError, match=r"^enc\.q: grams\[0\]: contains NaN at row 1, column 1"):
        lmdx.regmean_merge_layer([bad, grams[1]], weights, counts, name="enc.q")


def test_bad_layout(models):
    grams, counts, weights = models
    with pytest.raises(ValueError, match=r"layout: expected 'linear' .* or 'conv1d' .*got 'rows'"):
        lmdx.regmean_merge_layer(grams, weights, counts, layout="rows")


@pytest.mark.parametrize(
    ("coefficients", "pattern"),
    [
        ([1.0, -1.0], r"coefficients\[1\]: must be finite and >= 0"),
        ([1.0, float("nan")], r"coefficients\[1\]: must be finite and >= 0"),
        ([0.0, 0.0], r"coefficients: must not all be zero"),
        ([1.0], r"coefficients: expected 2 values \(one per model\), got 1"),
    ],
)
def test_bad_coefficients(models, coefficients, pattern):
    grams, counts, weights = models
    with pytest.raises(ValueError, match=pattern):
        lmdx.regmean_merge_layer(grams, weights, counts, coefficients=coefficients)


@pytest.mark.parametrize("alpha", [-0.5, 1.01, float("nan")])
def test_alpha_out_of_range(models, alpha):
    grams, counts, weights = models
    with pytest.raises(ValueError, match=r"alpha: must be in \[0, 1\]"):
        lmdx.regmean_merge_layer(grams, weights, counts, alpha=alpha)


# --------------------------------------------------------------------------- deviation form


def packed(g):
    """Upper triangle row by row, as statistics files store a Gram (independent of lmdx)."""
    return np.ascontiguousarray(g[np.triu_indices(g.shape[0])])


@given(
    k=st.integers(1, 3),
    d_in=st.integers(1, 9),
    alpha=st.sampled_from(ALPHAS),
    layout=st.sampled_from(["linear", "conv1d"]),
    seed=seeds,
)
def test_packed_grams_give_the_bits_of_full_grams(k, d_in, alpha, layout, seed):
    rng = np.random.default_rng(seed)
    grams, counts, weights, _ = make_models(rng, k, d_in, 4, np.float32)
    if layout == "conv1d":
        weights = [np.ascontiguousarray(w.T) for w in weights]
    full = lmdx.regmean_merge_layer(grams, weights, counts, alpha=alpha, layout=layout)
    tri = lmdx.regmean_merge_layer(
        [packed(g) for g in grams], weights, counts, alpha=alpha, layout=layout
    )
    assert np.array_equal(full.weight, tri.weight)


def test_packed_gram_of_the_wrong_length_names_the_shape(models):
    grams, counts, weights = models
    with pytest.raises(
        ValueError, match=r"^enc\.q: grams\[1\] is a .*\(14,\) .*expected shape \(15,\)"
    ):
        lmdx.regmean_merge_layer(
            [packed(grams[0]), packed(grams[1])[:-1]], weights, counts, name="enc.q"
        )


@given(
    k=st.integers(2, 4),
    alpha=st.sampled_from(ALPHAS),
    f32=st.booleans(),
    singular=st.booleans(),
    seed=seeds,
)
def test_model_merged_with_itself_comes_back_bit_exact(k, alpha, f32, singular, seed):
    # Each copy has its own statistics (here even singular ones: no solve is needed).
    rng = np.random.default_rng(seed)
    grams, counts, weights, rows = make_models(rng, k, 7, 5)
    if singular:
        grams = [np.outer(x[0], x[0]) for x in rows]  # rank one
    w = weights[0].astype(np.float32) if f32 else weights[0]
    res = lmdx.regmean_merge_layer(grams, [w] * k, counts, alpha=alpha, coefficients=[1.0] * k)
    assert np.array_equal(res.weight, w.astype(np.float64))
    assert res.info.precision == "identical"


def test_equal_weights_of_a_zero_coefficient_model_do_not_matter(rng):
    grams, counts, weights, _ = make_models(rng, 3, 6, 4)
    res = lmdx.regmean_merge_layer(
        grams, [weights[0], weights[0], weights[1]], counts, coefficients=[1.0, 2.0, 0.0]
    )
    assert np.array_equal(res.weight, weights[0]) and res.info.precision == "identical"


@given(
    seeds,
    st.integers(2, 12),
    st.lists(st.integers(0, 3), min_size=1, max_size=4),
    st.sampled_from(ALPHAS),
    st.booleans(),
    st.sampled_from([0.0, 1e-3]),
)
def test_low_rank_solve_matches_a_float64_reference(seed, d_in, ranks, alpha, packed, ridge):
    """F = S⁻¹ [c_i G̃_i A_iᵀ] + λ S⁻¹ [c_i A_iᵀ / C] with S = Σ c_i G̃_i + λ I, λ relative
    to S's mean diagonal (lmdx.regmean.regmean_low_rank_solve, the LoRA path's solve)."""
    rng = np.random.default_rng(seed)
    k = len(ranks)
    coef = rng.choice([0.0, 0.5, 1.0, 2.0], size=k)
    coef[0] = max(coef[0], 0.5)
    grams, counts, factors = [], [], []
    for r in ranks:
        n = int(rng.integers(2 * d_in + 3, 3 * d_in + 10))
        x = rng.standard_normal((n, d_in)) * rng.uniform(0.2, 3.0, d_in)
        grams.append(x.T @ x)
        counts.append(float(n))
        factors.append(rng.standard_normal((r, d_in)))
    reduced = []
    for g, n in zip(grams, counts, strict=True):
        gh = g / n
        reduced.append(alpha * gh + (1.0 - alpha) * np.diag(np.diag(gh)))
    s = sum(c * g for c, g in zip(coef, reduced, strict=True))
    lam = ridge * np.mean(np.diag(s))
    used = [i for i in range(k) if coef[i] > 0 and ranks[i] > 0]
    u = [coef[i] * reduced[i] @ factors[i].T for i in used]
    a = [coef[i] / coef.sum() * factors[i].T for i in used]
    system = s + lam * np.eye(d_in)
    width = sum(ranks[i] for i in used)
    expected = np.zeros((d_in, width))
    if used:
        expected = np.linalg.solve(system, np.hstack(u)) + lam * np.linalg.solve(
            system, np.hstack(a)
        )
    given_grams = [g[np.triu_indices(d_in)] for g in grams] if packed else grams
    f, info = lmdx.regmean.regmean_low_rank_solve(
        given_grams, factors, counts, alpha=alpha, coefficients=list(coef), ridge=ridge
    )
    assert f.shape == (d_in, width) and info.ridge == ridge
    scale = max(np.abs(expected).max(initial=0.0), 1e-300)
    assert np.abs(f - expected).max(initial=0.0) <= 1e-9 * scale * np.linalg.cond(system)


def test_low_rank_solve_names_bad_inputs(rng):
    g = np.eye(4)
    a = rng.standard_normal((2, 4))
    solve = lmdx.regmean.regmean_low_rank_solve
    with pytest.raises(ValueError, match=r"lora\.q: factors\[1\] .*expected a float64 \(r, 4\)"):
        solve([g, g], [a, a[:, :3]], [5.0, 5.0], name="lora.q")
    with pytest.raises(ValueError, match=r"lora\.q: grams\[1\] .*expected shape \(4, 4\)"):
        solve([g, np.eye(3)], [a, a], [5.0, 5.0], name="lora.q")
    with pytest.raises(ValueError, match=r"lora\.q: counts\[0\] must be > 0"):
        solve([g, g], [a, a], [0.0, 5.0], name="lora.q")
    with pytest.raises(ValueError, match=r"grams, counts, factors: need one entry per model"):
        solve([g, g], [a], [5.0, 5.0], name="lora.q")
