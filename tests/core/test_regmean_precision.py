"""RegMean's per-layer precision: the float32 merge, its certified output error, the
fallback to float64. Every error is measured here against the paper's formula in float64."""

from __future__ import annotations

import lmdx
import numpy as np
import pytest
import scipy.linalg
from hypothesis import given, settings
from hypothesis import strategies as st

# d_in^2 (K d_out + d_in) multiply-adds is above the single-thread threshold (2e7), so
# precision "auto" considers float32 for this shape.
K, D_IN, D_OUT, N = 3, 200, 240, 1000.0


def reduced_grams(grams, counts, alpha):
    """G̃_i = α Ĝ_i + (1 − α) diag(Ĝ_i) with Ĝ_i = G_i / n_i."""
    out = []
    for g, n in zip(grams, counts, strict=True):
        g_hat = np.asarray(g, dtype=np.float64) / n
        out.append(alpha * g_hat + (1.0 - alpha) * np.diag(np.diag(g_hat)))
    return out


def formula(grams, counts, weights, alpha, coefficients=None):
    """W_M = ((Σ c_i G̃_i)⁻¹ Σ c_i G̃_i W_iᵀ)ᵀ in float64, weights [out, in]."""
    c = np.ones(len(grams)) if coefficients is None else np.asarray(coefficients, float)
    g_tilde = reduced_grams(grams, counts, alpha)
    lhs = sum(ci * g for ci, g in zip(c, g_tilde, strict=True))
    rhs = sum(
        ci * g @ np.asarray(w, np.float64).T for ci, g, w in zip(c, g_tilde, weights, strict=True)
    )
    return scipy.linalg.solve(lhs, rhs, assume_a="pos").T, lhs


def output_error(merged, exact, s):
    """‖E‖_S / ‖W*‖_S with ‖A‖²_S = tr(A S Aᵀ) (weights [out, in])."""
    e = merged - exact
    num = np.einsum("oi,ij,oj->", e, s, e)
    return float(np.sqrt(num / np.einsum("oi,ij,oj->", exact, s, exact)))


def weight_error(merged, exact):
    return float(np.abs(merged - exact).max() / np.abs(exact).max())


def grams_of_condition(rng, kind, k, d, cond, n):
    """K Grams of condition ≈ cond (eigenvalues log-spaced, jittered): "unlike" each with
    its own eigenvectors, "alike" one Gram plus 1 % of another each."""

    def one(q):
        ev = np.logspace(0, -np.log10(cond), d) * rng.uniform(0.5, 2.0, d) if cond > 1 else None
        if ev is None:
            ev = np.ones(d)
        g = (q * ev) @ q.T * n
        return (g + g.T) / 2

    def basis():
        return np.linalg.qr(rng.standard_normal((d, d)))[0]

    if kind == "unlike":
        return [one(basis()) for _ in range(k)]
    q = basis()
    base = one(q)
    return [base + 0.01 * one(basis()) for _ in range(k)]


def fine_tuned(rng, k, d_out, d_in, spread):
    """K weights W_0 + deviations of relative size ``spread`` (float32, as checkpoints)."""
    w0 = rng.standard_normal((d_out, d_in))
    return [(w0 + spread * rng.standard_normal((d_out, d_in))).astype(np.float32) for _ in range(k)]


@pytest.mark.parametrize("kind", ["alike", "unlike"])
@pytest.mark.parametrize("alpha", [0.9, 1.0])
@pytest.mark.parametrize("cond", [1.0, 1e2, 1e4, 1e6, 1e8])
@pytest.mark.parametrize("spread", [1e-3, 1e-1])
def test_certificate_bounds_the_output_error(rng, kind, alpha, cond, spread):
    grams = grams_of_condition(rng, kind, K, D_IN, cond, N)
    weights = fine_tuned(rng, K, D_OUT, D_IN, spread)
    exact, s = formula(grams, [N] * K, weights, alpha)
    full = lmdx.regmean_merge_layer(grams, weights, [N] * K, alpha=alpha, precision="float64")
    assert full.info.precision == "float64" and full.info.output_error_estimate == 0.0
    assert weight_error(full.weight, exact) <= 1e-9 * max(cond, 1.0)
    # What a certificate measures is the merge against the float64 one; both differ from
    # this reference by float64 rounding as well (its own, and the float64 merge's: ``floor``).
    floor = 2.0 * output_error(full.weight, exact, s) + 1e-15
    forced = {}
    for precision in ("float32", "float32-rhs"):
        res = lmdx.regmean_merge_layer(grams, weights, [N] * K, alpha=alpha, precision=precision)
        assert res.info.precision == precision
        true = output_error(res.weight, exact, s)
        estimate = res.info.output_error_estimate
        # The estimate includes its safety margin: never below the true error.
        assert true <= estimate + floor, f"{precision}: true {true:.3g} > estimate {estimate:.3g}"
        if cond <= 1e4 and true > 100 * floor:
            # Spread rounding errors: the estimate is the margin (4) times the error, within
            # the probes' sampling (16 probes) and the system norm standing in for S's.
            assert estimate <= 12.0 * true, f"{precision}: estimate {estimate:.3g}, true {true:.3g}"
        forced[precision] = res

    # auto: float32 where certified, else the float32 right-hand side where certified, else
    # float64 -- each the same bits as that precision forced.
    auto = lmdx.regmean_merge_layer(grams, weights, [N] * K, alpha=alpha)
    estimate32 = forced["float32"].info.output_error_estimate
    if auto.info.precision == "float64":
        assert np.array_equal(auto.weight, full.weight), "the fallback is the float64 merge"
        assert auto.info.output_error_estimate == 0.0
        assert forced["float32-rhs"].info.output_error_estimate > 1e-6
    else:
        assert auto.info.precision in forced
        assert auto.info.output_error_estimate <= 1e-6
        assert output_error(auto.weight, exact, s) <= auto.info.output_error_estimate + floor
        assert np.array_equal(auto.weight, forced[auto.info.precision].weight)
    if auto.info.precision != "float32":
        assert estimate32 > 1e-6 or cond >= 1e6  # rejected by the estimate or the refinement
    if cond <= 1e2 and spread <= 1e-2:  # well conditioned: float32 is certified
        assert auto.info.precision == "float32"


@settings(max_examples=60, deadline=None)
@given(
    k=st.integers(2, 6),
    d_in=st.integers(1, 150),
    d_out=st.integers(1, 40),
    alpha=st.sampled_from([0.5, 0.9, 1.0]),
    log_cond=st.floats(0.0, 7.0),
    spread=st.sampled_from([1e-3, 1e-2, 1e-1]),
    coefficients=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    precision=st.sampled_from(["float32", "float32-rhs"]),
)
def test_certificate_on_small_layers(
    k, d_in, d_out, alpha, log_cond, spread, coefficients, seed, precision
):
    # Few output columns make the probes' sampling the coarsest (a single output column is
    # the rank-one case the margin is sized for). K >= 4 forms each Gram difference a second
    # time after the pre-check instead of holding all of them (d_in > 64: several tiles per
    # block of rows).
    rng = np.random.default_rng(seed)
    grams = grams_of_condition(rng, "unlike", k, d_in, 10.0**log_cond, N)
    weights = fine_tuned(rng, k, d_out, d_in, spread)
    c = list(rng.uniform(0.2, 2.0, k)) if coefficients else None
    exact, s = formula(grams, [N] * k, weights, alpha, c)
    res, full = (
        lmdx.regmean_merge_layer(grams, weights, [N] * k, alpha=alpha, coefficients=c, precision=p)
        for p in (precision, "float64")
    )
    assert res.info.precision == precision
    floor = 2.0 * output_error(full.weight, exact, s) + 1e-15  # float64 rounding
    true = output_error(res.weight, exact, s)
    assert true <= res.info.output_error_estimate + floor
    if log_cond <= 2.0:  # float32 rounding amplified by at most the condition
        assert true <= 1e-5 * 10.0**log_cond * max(spread, 1e-2)


def test_float32_threads_agree_and_conv1d_is_the_transpose(rng):
    grams = grams_of_condition(rng, "unlike", K, 300, 1e3, N)
    weights = fine_tuned(rng, K, 1100, 300, 1e-2)  # two 1024-column chunks, 3 row blocks
    runs = [
        lmdx.regmean_merge_layer(grams, weights, [N] * K, alpha=0.9, n_threads=t) for t in (1, 2, 3)
    ]
    assert runs[0].info.precision == "float32"
    for other in runs[1:]:
        assert np.array_equal(runs[0].weight, other.weight)
        assert other.info.output_error_estimate == runs[0].info.output_error_estimate
    conv = lmdx.regmean_merge_layer(
        grams, [np.ascontiguousarray(w.T) for w in weights], [N] * K, alpha=0.9, layout="conv1d"
    )
    assert np.array_equal(conv.weight, runs[0].weight.T)


def test_one_gram_for_every_model_gives_the_weighted_average_in_float32(rng):
    """The same statistics for every model: the right-hand side vanishes (up to the
    rounding of c_i/n_i against c_i/n_p), the merge is the coefficient-weighted average and
    the certified error is negligible."""
    gram = grams_of_condition(rng, "unlike", 1, D_IN, 1e3, N)[0]
    weights = [rng.standard_normal((D_OUT, D_IN)).astype(np.float32) for _ in range(K)]
    c = [1.0, 2.0, 0.5]
    res = lmdx.regmean_merge_layer([gram] * K, weights, [N] * K, alpha=0.9, coefficients=c)
    average = sum(ci * w.astype(np.float64) for ci, w in zip(c, weights, strict=True)) / sum(c)
    np.testing.assert_allclose(res.weight, average, rtol=0, atol=1e-12)
    assert res.info.precision == "float32" and res.info.output_error_estimate < 1e-15


def test_failed_float32_factorization_falls_back_to_float64(rng):
    # Input 0 never active: float32 cannot factor the system; the float64 path regularizes.
    grams = grams_of_condition(rng, "unlike", K, D_IN, 1e2, N)
    for g in grams:
        g[0, :] = g[:, 0] = 0.0
    weights = fine_tuned(rng, K, D_OUT, D_IN, 1e-2)
    with pytest.warns(UserWarning, match="layer"):
        forced = lmdx.regmean_merge_layer(grams, weights, [N] * K, alpha=1.0, precision="float32")
    with pytest.warns(UserWarning, match="layer"):
        full = lmdx.regmean_merge_layer(grams, weights, [N] * K, alpha=1.0, precision="float64")
    assert forced.info.precision == "float64" and forced.info.escalated
    assert np.array_equal(forced.weight, full.weight)


def test_small_layers_stay_float64_under_auto_and_bad_precision_is_named(rng):
    grams = grams_of_condition(rng, "unlike", K, 8, 10.0, N)
    weights = fine_tuned(rng, K, 6, 8, 1e-2)
    assert lmdx.regmean_merge_layer(grams, weights, [N] * K).info.precision == "float64"
    forced = lmdx.regmean_merge_layer(grams, weights, [N] * K, precision="float32")
    assert forced.info.precision == "float32" and forced.info.output_error_estimate > 0.0
    with pytest.raises(
        ValueError,
        match=r"layer: precision: expected 'auto', 'float32', 'float32-rhs' or 'float64', got "
        r"'half'",
    ):
        lmdx.regmean_merge_layer(grams, weights, [N] * K, precision="half")  # type: ignore[arg-type]


def mixed_gram(x):
    """A Gram accumulated as "mixed" statistics are: float32 products of chunks of 64 rows,
    summed in float64."""
    x32 = x.astype(np.float32)
    return sum(
        (x32[i : i + 64].T @ x32[i : i + 64]).astype(np.float64) for i in range(0, len(x32), 64)
    )


@pytest.mark.parametrize(("statistics", "roundoff"), [("mixed", 2.0**-24), ("float64", 2.0**-53)])
def test_directions_below_the_noise_floor_keep_the_average(rng, statistics, roundoff):
    # A BERT-768 pooler whose statistics hold 48 rows in all (16 per model), merged at
    # alpha 1: 720 input directions were never seen, and the Grams' own rounding is all
    # the system holds there.
    k, d, rows = 3, 768, 16
    xs = [rng.standard_normal((rows, d)) * rng.uniform(0.5, 2.0, d) for _ in range(k)]
    grams = [mixed_gram(x) if statistics == "mixed" else x.T @ x for x in xs]
    weights = fine_tuned(rng, k, d, d, 5e-2)
    counts = [float(rows)] * k
    average = sum(w.astype(np.float64) for w in weights) / k
    vt = np.linalg.svd(np.vstack(xs), full_matrices=True)[2]
    seen, unseen = vt[: k * rows].T, vt[k * rows :].T  # (d, 48), (d, 720)
    res = lmdx.regmean_merge_layer(grams, weights, counts, alpha=1.0, noise_floor=roundoff)
    assert res.info.precision == "float64" and res.info.unseen_directions == d - k * rows
    moved = res.weight - average
    assert np.abs(moved @ unseen).max() / np.abs(average).max() <= 1e-6
    # In the seen directions: the formula on the statistics' range (float64 Grams).
    s = sum(x.T @ x / rows for x in xs)
    b = sum(
        (x.T @ x / rows) @ (w.astype(np.float64) - average).T
        for x, w in zip(xs, weights, strict=True)
    )
    s_seen = seen.T @ s @ seen
    expected = seen @ np.linalg.solve(s_seen, seen.T @ b)  # (d_in, d_out)
    tol = 1e-4 if statistics == "mixed" else 1e-9  # the Grams' own rounding, amplified
    assert np.abs(moved.T - expected).max() / np.abs(expected).max() <= tol
    # Without a noise floor the rounding is amplified by 1/ridge into those directions.
    if statistics == "mixed":
        with pytest.warns(UserWarning, match="layer"):
            exact = lmdx.regmean_merge_layer(grams, weights, counts, alpha=1.0)
        assert np.abs((exact.weight - average) @ unseen).max() / np.abs(average).max() > 1e-3


def test_a_system_near_the_noise_floor_without_directions_below_it_needs_no_eigensolve(rng):
    """A system whose smallest pivot is near the noise floor (within the factor 1e3 that
    asks for a closer look) but whose smallest eigenvalue is still 3 times above it: the
    shifted factorization shows that no direction is below the floor, so the float64 merge
    is the plain Cholesky solve -- the same bits as with no noise floor at all -- and
    matches the formula."""
    d, k = D_IN, K
    q = np.linalg.qr(rng.standard_normal((d, d)))[0]
    roundoff = 2.0**-24
    floor = roundoff * np.sqrt(d)  # relative to the mean diagonal
    ev = np.logspace(0, np.log10(3 * floor), d)
    ev *= d / ev.sum()  # mean diagonal 1 per model
    grams = []
    for _ in range(k):
        g = (q * (ev * rng.uniform(0.9, 1.1, d))) @ q.T * N
        grams.append((g + g.T) / 2)
    weights = fine_tuned(rng, k, D_OUT, d, 1e-2)
    counts = [N] * k
    merged = {
        f: lmdx.regmean_merge_layer(
            grams, weights, counts, alpha=1.0, precision="float64", noise_floor=f
        )
        for f in (roundoff, 0.0)
    }
    info = merged[roundoff].info
    assert info.min_pivot**2 <= 1e3 * floor * info.mean_diagonal, "the case the closer look is for"
    assert info.unseen_directions == 0 and info.precision == "float64"
    assert np.array_equal(merged[roundoff].weight, merged[0.0].weight)
    exact, s = formula(grams, counts, weights, 1.0)
    assert output_error(merged[roundoff].weight, exact, s) <= 1e-10


def test_noise_floor_must_be_a_fraction(rng):
    grams = grams_of_condition(rng, "unlike", K, 8, 10.0, N)
    weights = fine_tuned(rng, K, 6, 8, 1e-2)
    with pytest.raises(ValueError, match=r"layer: noise_floor: must be in \[0, 1\), got -1"):
        lmdx.regmean_merge_layer(grams, weights, [N] * K, noise_floor=-1.0)


def test_each_merge_reports_its_phases(rng):
    """``info.phases``: the path taken; ``info.timings``: seconds per phase, only in a
    build with LMDX_PROFILE=ON (a benchmark's breakdown; the default build reads no
    clock)."""
    grams = grams_of_condition(rng, "unlike", K, D_IN, 1e2, N)
    weights = fine_tuned(rng, K, D_OUT, D_IN, 1e-3)
    counts = [N] * K
    f32 = lmdx.regmean_merge_layer(grams, weights, counts, alpha=0.9, precision="float32").info
    f64 = lmdx.regmean_merge_layer(grams, weights, counts, alpha=0.9, precision="float64").info
    rhs = lmdx.regmean_merge_layer(grams, weights, counts, alpha=0.9, precision="float32-rhs").info
    assert (f32.precision, f64.precision, rhs.precision) == ("float32", "float64", "float32-rhs")
    common = ["checks", "average", "system"]
    float32 = ["convert32", "factor32", "deviations", "differences", "precheck"]
    float32 += ["products32", "solve32", "certificate"]
    assert f32.phases == common + float32
    assert f64.phases == [*common, "factor64", "products64", "solve64"]
    rhs32 = ["factor64", "deviations", "differences", "products32", "certificate", "solve64"]
    assert rhs.phases == common + rhs32
    for info in (f32, f64, rhs):
        if lmdx.config()["profiled"]:
            assert list(info.timings) == info.phases
            assert all(t >= 0.0 for t in info.timings.values())
        else:
            assert info.timings == {}


def test_auto_predictor_sends_hopeless_layers_to_float64_before_the_precheck(rng):
    """A layer far from certifiable in float32 (unlike Grams of condition 1e6, deviations
    ten times the weights) is sent to float64 right after the float32 factorization (the
    a-priori predictor), without trying the float32 right-hand side either: the same bits
    as precision "float64", and the certificates (forced float32 and float32-rhs) agree
    both were out of reach."""
    grams = grams_of_condition(rng, "unlike", K, D_IN, 1e6, N)
    weights = fine_tuned(rng, K, D_OUT, D_IN, 10.0)
    counts = [N] * K
    auto = lmdx.regmean_merge_layer(grams, weights, counts, alpha=0.9)
    forced = {
        p: lmdx.regmean_merge_layer(grams, weights, counts, alpha=0.9, precision=p)
        for p in ("float32", "float32-rhs", "float64")
    }
    assert auto.info.precision == "float64" and auto.info.output_error_estimate == 0.0
    assert auto.info.phases == [
        *["checks", "average", "system", "convert32", "factor32", "predictor"],
        *["factor64", "products64", "solve64"],
    ]
    assert np.array_equal(auto.weight, forced["float64"].weight)
    assert forced["float32"].info.output_error_estimate > 1e-6
    assert forced["float32-rhs"].info.output_error_estimate > 1e-6


def test_auto_takes_the_float32_right_hand_side_where_float32_just_misses(rng):
    """Deviations growing past what float32 certifies (unlike Grams of condition 1e6, 600
    inputs, where the float32 factor's error is about a tenth of the total): each layer is
    merged in float32 while its certificate allows, then -- refused by the pre-check or the
    final certificate, not by the a-priori predictor -- with the float32 right-hand side and
    the float64 factorization, then in float64; each time the same bits as that precision
    forced and within its certified estimate of the formula. The window between the two
    certificates is narrow, and where it lies depends on the SIMD path (its float32
    rounding), so the middle deviation is found by bisection on this path: the smallest
    one float32 no longer certifies, where it just misses."""
    d_in = 600
    grams = grams_of_condition(rng, "unlike", K, d_in, 1e6, N)
    counts = [N] * K
    w0 = rng.standard_normal((D_OUT, d_in))
    devs = [rng.standard_normal((D_OUT, d_in)) for _ in range(K)]

    def weights_at(spread):
        return [(w0 + spread * dv).astype(np.float32) for dv in devs]

    def merged(spread, precision="auto"):
        return lmdx.regmean_merge_layer(
            grams, weights_at(spread), counts, alpha=0.9, precision=precision
        ).info

    low, high = 0.05, 1.0  # float32 certifies at the first, not at the second
    assert merged(low).precision == "float32" != merged(high).precision
    for _ in range(12):
        mid = (low + high) / 2
        low, high = (mid, high) if merged(mid).precision == "float32" else (low, mid)
    middle = high
    assert merged(middle, "float32").output_error_estimate > 1e-6, "float32 just misses"
    seen = []
    for spread in (0.05, middle, 10.0):
        weights = weights_at(spread)
        auto = lmdx.regmean_merge_layer(grams, weights, counts, alpha=0.9)
        forced = lmdx.regmean_merge_layer(
            grams, weights, counts, alpha=0.9, precision=auto.info.precision
        )
        assert np.array_equal(auto.weight, forced.weight)
        exact, s = formula(grams, counts, weights, 0.9)
        assert output_error(auto.weight, exact, s) <= auto.info.output_error_estimate + 1e-12
        assert auto.info.output_error_estimate <= 1e-6
        if auto.info.precision == "float32-rhs":
            assert "predictor" not in auto.info.phases
            assert auto.info.phases.index("factor64") > auto.info.phases.index("precheck")
            # Refused by float32's final certificate (after its solve): the float32
            # right-hand side that attempt formed is the one certified here (the same bits
            # as float32-rhs forced, which forms its own).
            assert auto.info.phases.index("factor64") > auto.info.phases.index("solve32")
        seen.append(auto.info.precision)
    # The tiers in order as the deviations grow, each reached.
    assert seen == ["float32", "float32-rhs", "float64"], seen


@pytest.mark.parametrize("cond", [1.0, 1e2, 1e3])
def test_auto_keeps_float32_on_well_conditioned_small_deviations(rng, cond):
    grams = grams_of_condition(rng, "alike", K, D_IN, cond, N)
    weights = fine_tuned(rng, K, D_OUT, D_IN, 1e-3)
    res = lmdx.regmean_merge_layer(grams, weights, [N] * K, alpha=0.9)
    assert res.info.precision == "float32" and "predictor" not in res.info.phases
    exact, lhs = formula(grams, [N] * K, weights, 0.9)
    floor = 1e-15  # float64 rounding (the estimate of an exact solve is ~0)
    assert output_error(res.weight, exact, lhs) <= res.info.output_error_estimate + floor
    assert res.info.output_error_estimate <= 1e-6


@pytest.mark.parametrize("k", [4, 5, 6])
def test_auto_keeps_float32_with_many_models_and_threads_agree(rng, k):
    # D_IN = 200: two blocks of rows (112 and 88), each formed in tiles of 64 rows.
    grams = grams_of_condition(rng, "alike", k, D_IN, 1e2, N)
    weights = fine_tuned(rng, k, D_OUT, D_IN, 1e-3)
    c = list(rng.uniform(0.2, 2.0, k))
    exact, s = formula(grams, [N] * k, weights, 0.9, c)
    runs = [
        lmdx.regmean_merge_layer(grams, weights, [N] * k, alpha=0.9, coefficients=c, n_threads=t)
        for t in (1, 2, 3)
    ]
    auto = runs[0]
    assert auto.info.precision == "float32" and auto.info.output_error_estimate <= 1e-6
    assert output_error(auto.weight, exact, s) <= auto.info.output_error_estimate + 1e-15
    for other in runs[1:]:
        assert np.array_equal(other.weight, auto.weight)
        assert other.info.output_error_estimate == auto.info.output_error_estimate


@pytest.mark.parametrize("precision", ["float64", "float32"])
@pytest.mark.parametrize("d_in", [96, 1100])
def test_condition_estimate_at_every_input_size(rng, precision, d_in):
    """``info.condition_estimate`` estimates cond₁(Σ c_i G̃_i) (Hager's estimator: at most
    the true value, usually within 3× of it) from the factor of the precision used, at
    every input size: also above 1024 inputs, where it used to be 0.0 (not estimated)."""
    counts = [N] * K
    grams = grams_of_condition(rng, "alike", K, d_in, 1e5, N)
    weights = fine_tuned(rng, K, 8, d_in, 0.1)
    res = lmdx.regmean_merge_layer(grams, weights, counts, alpha=0.9, precision=precision)
    assert res.info.precision == precision
    exact = np.linalg.cond(sum(reduced_grams(grams, counts, 0.9)), 1)
    assert exact > 1e3
    assert exact / 3 <= res.info.condition_estimate <= exact * 1.01


def predictor(grams, counts, weights, alpha):
    """The a-priori predictor of "auto", computed here: 24 × 2⁻²⁴ × the weights' relative
    spread × the largest / smallest pivot of the system's float32 Cholesky factor ×
    min(1, δ / 0.1), δ = max |diag(Ĝ_i − Ĝ_0)| / diag(Σ Ĝ_i) (model 0 the pivot)."""
    w = [np.asarray(x, np.float64) for x in weights]
    mean = sum(w) / len(w)
    spread = max(np.abs(x - mean).max() for x in w) / np.abs(mean).max()
    lhs = sum(reduced_grams(grams, counts, alpha))
    diag = [np.diag(g) / n for g, n in zip(grams, counts, strict=True)]
    delta = max(np.max(np.abs(d - diag[0]) / np.diag(lhs)) for d in diag[1:])
    pivots = np.diag(np.linalg.cholesky(lhs.astype(np.float32))).astype(np.float64)
    return 24 * 2.0**-24 * spread * pivots.max() / pivots.min() * min(1.0, delta / 0.1)


def grams_with_a_small_input(rng, k, d, column, scale):
    """K Grams XᵀX of 2d rows where input ``column`` is ``scale`` times smaller than the
    others (the float32 factor's pivot ratio ≈ 1 / scale, its smallest pivot in that
    column's diagonal block); each model's rows differ by 30 %."""
    x = rng.standard_normal((2 * d, d))
    out = []
    for _ in range(k):
        xi = x + 0.3 * rng.standard_normal(x.shape)
        xi[:, column] *= scale
        out.append(xi.T @ xi)
    return out


@pytest.mark.parametrize("column", [40, 590], ids=["first-block", "last-block"])
@pytest.mark.parametrize("target", [1e-8, 3e-6, 3e-5])
def test_auto_predictor_routes_by_the_pivot_ratio_and_keeps_the_certificate(rng, column, target):
    """ "auto"'s a-priori predictor against the same predictor computed here in NumPy, on
    600-input systems (three diagonal blocks of the factorization, which stops as soon as
    the pivots so far exceed the ratio the tolerance allows): a layer it predicts above 1e-6
    goes to float64 (the same bits as precision "float64", within 1e-6 of the formula),
    whether its smallest pivot comes in the first block or the last; one predicted well
    below it is merged in float32 and certified, its output error against the formula at
    most the certified estimate (≤ 1e-6)."""
    d_in, d_out = 600, 16
    counts = [N] * K
    grams = grams_with_a_small_input(rng, K, d_in, column, 1e-3)
    w0 = rng.standard_normal((d_out, d_in))
    devs = [rng.standard_normal((d_out, d_in)) for _ in range(K)]

    def weights_of(scale):
        return [(w0 + scale * dv).astype(np.float32) for dv in devs]

    # The deviations scaled so that the predictor lands at the target (it is linear in them).
    scale = target / predictor(grams, counts, weights_of(1e-2), 0.9) * 1e-2
    weights = weights_of(scale)
    predicted = predictor(grams, counts, weights, 0.9)
    assert 0.8 * target <= predicted <= 1.25 * target
    auto = lmdx.regmean_merge_layer(grams, weights, counts, alpha=0.9)
    exact, s = formula(grams, counts, weights, 0.9)
    if predicted > 1e-6:
        full = lmdx.regmean_merge_layer(grams, weights, counts, alpha=0.9, precision="float64")
        assert auto.info.precision == "float64" and "predictor" in auto.info.phases
        assert auto.info.phases[-4:] == ["predictor", "factor64", "products64", "solve64"]
        assert np.array_equal(auto.weight, full.weight)
        assert weight_error(auto.weight, exact) <= 1e-6
    else:
        assert auto.info.precision == "float32" and "predictor" not in auto.info.phases
        assert auto.info.output_error_estimate <= 1e-6
        assert output_error(auto.weight, exact, s) <= auto.info.output_error_estimate + 1e-15
