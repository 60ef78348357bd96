"""Similarity measures from streamed moments (lmdx.lmd.similarity) against the float64
references of similarity_reference.py, computed from the full N × D embeddings."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from lmdx.lmd import SplitMoments
from lmdx.lmd.similarity import (
    CHEAP_MEASURES,
    MEASURES,
    moments_similarity,
    parse_measures,
)
from similarity_reference import (
    TOL,
    paired,
    ref_cca,
    ref_cka,
    ref_debiased_cka,
    ref_procrustes,
    ref_pwcca,
    ref_svcca,
)

seeds = st.integers(0, 2**32 - 1)


def similarity(arrays, measures=CHEAP_MEASURES, chunks=(None,), **kw):
    names = [f"m{i}" for i in range(len(arrays))]
    sm = SplitMoments(names, [a.shape[1] for a in arrays], norms=True)
    cuts = [0, *[c for c in chunks if c is not None], len(arrays[0])]
    for lo, hi in itertools.pairwise(cuts):
        sm.add([a[lo:hi] for a in arrays])
    return moments_similarity(sm, measures, **kw)


def check_pair(res, x, y, i=0, j=1, *, pwcca=(True, True)):
    """Every measure of the pair (i, j); ``pwcca`` says which sides' PWCCA weights are
    unique (not where canonical correlations repeat, e.g. several zeros)."""
    t = res.tables
    key = (f"m{min(i, j)}", f"m{max(i, j)}")  # correlations are kept for i <= j
    assert t["cka"][i, j] == pytest.approx(ref_cka(x, y), rel=TOL, abs=TOL)
    assert t["debiased_cka"][i, j] == pytest.approx(ref_debiased_cka(x, y), rel=TOL, abs=TOL)
    rho = ref_cca(x, y)
    got = res.correlations["cca"][key]
    np.testing.assert_allclose(got, rho, rtol=TOL, atol=TOL)
    assert t["cca_mean"][i, j] == pytest.approx(rho.mean(), rel=TOL, abs=TOL)
    assert t["cca_r2"][i, j] == pytest.approx((rho**2).mean(), rel=TOL, abs=TOL)
    assert t["pillai"][i, j] == pytest.approx((rho**2).sum(), rel=TOL, abs=TOL)
    sv = ref_svcca(x, y)
    np.testing.assert_allclose(res.correlations["svcca"][key], sv, atol=TOL)
    assert t["svcca"][i, j] == pytest.approx(sv.mean(), rel=TOL, abs=TOL)
    if pwcca[0]:
        assert t["pwcca"][i, j] == pytest.approx(ref_pwcca(x, y), rel=TOL, abs=TOL)
    if pwcca[1]:
        assert t["pwcca"][j, i] == pytest.approx(ref_pwcca(y, x), rel=TOL, abs=TOL)
    assert t["procrustes"][i, j] == pytest.approx(ref_procrustes(x, y), rel=TOL, abs=TOL)


# ---- tests -----------------------------------------------------------------------------


@given(data=st.data(), seed=seeds)
def test_every_measure_matches_full_matrix_reference(data, seed):
    """Different widths, rank-deficient inputs (rank < width), N ≫ D and N close to D."""
    rng = np.random.default_rng(seed)
    n = data.draw(st.sampled_from([12, 40, 400]), label="n")
    p = data.draw(st.integers(1, 9), label="p")
    q = data.draw(st.integers(1, 9), label="q")
    rx = data.draw(st.integers(1, min(p, (n - 1) // 2)), label="rx")
    ry = data.draw(st.integers(1, min(q, (n - 1) // 2)), label="ry")
    shared = data.draw(st.integers(0, min(rx, ry)), label="shared")
    x, y = paired(rng, n, p, q, rx, ry, shared)
    res = similarity([x, y])
    assert res.ranks == {"m0": rx, "m1": ry}
    # The correlations are shared values (distinct) and zeros; a side's canonical vectors
    # (and so its PWCCA weights) are unique unless zeros repeat within its own rank.
    zeros = min(rx, ry) - shared
    unique = (zeros == 0 or (zeros == 1 and rx <= ry), zeros == 0 or (zeros == 1 and ry <= rx))
    check_pair(res, x, y, pwcca=unique)
    check_pair(res, y, x, 1, 0, pwcca=unique[::-1])


@given(seed=seeds, n=st.integers(5, 12), extra=st.integers(0, 20))
def test_n_smaller_than_width(seed, n, extra):
    """N < D: each covariance has rank n − 1; the CCA family is degenerate and says so."""
    rng = np.random.default_rng(seed)
    p, q = 2 * n + extra, 2 * n + 3
    x = rng.standard_normal((n, p)) + 2.0
    y = x @ rng.standard_normal((p, q)) / math.sqrt(p) + 0.5 * rng.standard_normal((n, q))
    res = similarity([x, y])
    assert res.ranks == {"m0": n - 1, "m1": n - 1}
    check_pair(res, x, y, pwcca=(False, False))
    np.testing.assert_allclose(res.correlations["cca"][("m0", "m1")], 1.0, atol=1e-9)
    assert any("degenerate" in note for note in res.notes)


@given(seed=seeds, chunks=st.lists(st.integers(1, 149), max_size=6, unique=True))
def test_streaming_in_chunks_equals_one_chunk(seed, chunks):
    rng = np.random.default_rng(seed)
    x, y = paired(rng, 150, 6, 4, 4, 4, 4, shift=40.0)
    one = similarity([x, y])
    many = similarity([x, y], chunks=sorted(chunks))
    for key, table in one.tables.items():
        np.testing.assert_allclose(many.tables[key], table, rtol=1e-11, atol=1e-12, err_msg=key)


def test_merge_of_moments_with_different_shifts_is_exact(rng):
    x, y = paired(rng, 300, 5, 7, 5, 6, 4, shift=30.0)
    halves = []
    for lo, hi in ((0, 100), (100, 300)):
        sm = SplitMoments(["m0", "m1"], [5, 7], norms=True)
        sm.add([x[lo:hi] + 10.0 * (lo > 0), y[lo:hi] - 10.0 * (lo > 0)])
        halves.append(sm)
    assert not np.allclose(halves[0].shift, halves[1].shift)
    merged = halves[0].copy().merge(halves[1])
    xs = np.concatenate([x[:100], x[100:] + 10.0])
    ys = np.concatenate([y[:100], y[100:] - 10.0])
    res = moments_similarity(merged)
    check_pair(res, xs, ys)
    centred = merged.centered_norms()
    a = ((xs - xs.mean(0)) ** 2).sum(1)
    b = ((ys - ys.mean(0)) ** 2).sum(1)
    np.testing.assert_allclose(centred.norm_sum, [a.sum(), b.sum()], rtol=1e-12)
    ref_gram = [[a @ a, a @ b], [b @ a, b @ b]]
    np.testing.assert_allclose(centred.norm_gram, ref_gram, rtol=1e-12)
    ref_cross = np.stack([a, b]) @ (np.hstack([xs, ys]) - np.hstack([xs, ys]).mean(0))
    np.testing.assert_allclose(centred.norm_cross, ref_cross, atol=1e-9 * np.abs(ref_cross).max())


def _orthogonal(rng, d):
    q, _ = np.linalg.qr(rng.standard_normal((d, d)))
    return q


@given(seed=seeds)
def test_invariances(seed):
    """CKA, debiased CKA, Procrustes: orthogonal maps and isotropic scaling; the CCA
    family: any invertible linear map and translation."""
    rng = np.random.default_rng(seed)
    x, y = paired(rng, 80, 5, 6, 5, 6, 4)
    base = similarity([x, y])
    rotated = similarity([3.7 * x @ _orthogonal(rng, 5), y @ _orthogonal(rng, 6) * 0.02])
    for key in ("cka", "debiased_cka", "procrustes"):
        assert rotated.tables[key][0, 1] == pytest.approx(base.tables[key][0, 1], rel=1e-11)
    mix_x = _orthogonal(rng, 5) * rng.uniform(0.5, 2.0, 5) @ _orthogonal(rng, 5)
    mix_y = _orthogonal(rng, 6) * rng.uniform(0.5, 2.0, 6) @ _orthogonal(rng, 6)
    mapped = similarity([x @ mix_x - 7.0, y @ mix_y + 5.0])
    np.testing.assert_allclose(
        mapped.correlations["cca"][("m0", "m1")],
        base.correlations["cca"][("m0", "m1")],
        atol=1e-11,
    )
    assert mapped.tables["cca_r2"][0, 1] == pytest.approx(base.tables["cca_r2"][0, 1], rel=1e-11)


def test_a_model_compared_with_itself(rng):
    x, _ = paired(rng, 60, 6, 3, 5, 2, 1)
    res = similarity([x, x.copy()])
    for i in range(2):
        for j in range(2):
            assert res.tables["cka"][i, j] == pytest.approx(1.0, abs=1e-13)
            assert res.tables["debiased_cka"][i, j] == pytest.approx(1.0, abs=1e-12)
            assert res.tables["procrustes"][i, j] == pytest.approx(0.0, abs=1e-12)
            assert res.tables["pwcca"][i, j] == pytest.approx(1.0, abs=1e-12)
            assert res.tables["svcca"][i, j] == pytest.approx(1.0, abs=1e-12)
    rho = res.correlations["cca"][("m0", "m1")]
    assert len(rho) == 5
    np.testing.assert_allclose(rho, 1.0, atol=1e-12)
    # The diagonal is exact by definition.
    assert res.tables["cka"][0, 0] == 1.0 and res.tables["procrustes"][1, 1] == 0.0
    assert res.tables["pillai"][0, 0] == 5.0
    np.testing.assert_array_equal(res.correlations["cca"][("m0", "m0")], np.ones(5))


def test_constant_embedding_is_named_not_raised(rng):
    x, y = paired(rng, 50, 4, 3, 3, 3, 3)
    const = np.full((50, 2), 1.5)
    res = similarity([x, const, y])
    assert any("constant embedding of m1" in note for note in res.notes)
    for key, table in res.tables.items():
        assert np.isnan(table[1]).all() and np.isnan(table[:, 1]).all(), key
        assert np.isfinite(table[0, 2]), key
    assert res.ranks["m1"] == 0
    check_pair(res, x, y, 0, 2)


def test_debiased_cka_needs_four_rows(rng):
    x, y = rng.standard_normal((3, 2)), rng.standard_normal((3, 2))
    res = similarity([x, y])
    assert np.isnan(res.tables["debiased_cka"]).all()
    assert any("n = 3 < 4" in note for note in res.notes)
    assert res.tables["cka"][0, 1] == pytest.approx(ref_cka(x, y), rel=TOL)


def test_parse_measures():
    assert parse_measures(None) == CHEAP_MEASURES
    assert parse_measures("all") == tuple(MEASURES)
    assert parse_measures("procrustes, CKA cv_r2") == ("cka", "procrustes", "cv_r2")
    assert parse_measures(["pwcca"]) == ("pwcca",)
    with pytest.raises(ValueError, match=r"unknown measure 'ckaa'; use 'all' or any of cka, "):
        parse_measures("cka,ckaa")


def test_bad_options_are_one_line_errors(rng):
    x = rng.standard_normal((10, 2))
    with pytest.raises(ValueError, match=r"svcca_variance: must be in \(0, 1\], got 1.5"):
        similarity([x, x], svcca_variance=1.5)
    sm = SplitMoments(["a", "b"], [2, 2])
    sm.add([x, x])
    with pytest.raises(ValueError, match="split 'train': no norm sums; create the moments with"):
        moments_similarity(sm)


def test_first_canonical_correlations_agree_with_scikit_learn(rng):
    """A public implementation (scikit-learn's iterative CCA, here through the test
    dependencies) as a cross-check of the leading canonical correlations."""
    cross_decomposition = pytest.importorskip("sklearn.cross_decomposition")
    x, y = paired(rng, 500, 5, 4, 5, 4, 4, shift=2.0)
    ours = similarity([x, y]).correlations["cca"][("m0", "m1")]
    cca = cross_decomposition.CCA(n_components=2, scale=False, max_iter=10_000, tol=1e-14)
    xs, ys = cca.fit(x, y).transform(x, y)
    theirs = [np.corrcoef(xs[:, i], ys[:, i])[0, 1] for i in range(2)]
    np.testing.assert_allclose(ours[:2], theirs, rtol=1e-7)


@given(seed=seeds)
def test_float32_batches_agree_to_float32_accuracy(seed):
    """Float32 embeddings (with a large mean) go through the float32 Gram and norm products;
    the references use the same numbers in float64."""
    rng = np.random.default_rng(seed)
    x, y = paired(rng, 300, 6, 5, 6, 5, 5, shift=100.0)
    x, y = x.astype(np.float32), y.astype(np.float32)
    res = similarity([x, y], chunks=(100, 200))
    x64, y64 = x.astype(np.float64), y.astype(np.float64)
    t = res.tables
    assert t["cka"][0, 1] == pytest.approx(ref_cka(x64, y64), rel=1e-6)
    assert t["debiased_cka"][0, 1] == pytest.approx(ref_debiased_cka(x64, y64), rel=1e-6)
    assert t["procrustes"][0, 1] == pytest.approx(ref_procrustes(x64, y64), rel=1e-6)
    np.testing.assert_allclose(res.correlations["cca"][("m0", "m1")], ref_cca(x64, y64), atol=1e-6)
