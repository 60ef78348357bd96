"""Similarity measures through lmdx.Decomposition: per split and over all rows, k-fold
cross-validated R², result.json / results.csv, heatmaps; references computed here from
the full arrays (similarity_reference.py; least squares with numpy.linalg.lstsq)."""

from __future__ import annotations

import csv
import json

import lmdx
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from lmdx.lmd.similarity import CHEAP_MEASURES
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

NAMES = ["x", "y", "z"]
SIZES = {"train": 150, "validation": 60, "test": 50}


def _data(rng):
    n = sum(SIZES.values())
    x, y = paired(rng, n, 6, 4, 6, 4, 4)
    z = paired(rng, n, 3, 5, 3, 5, 3)[1]
    cuts = np.cumsum([0, *SIZES.values()])
    return {
        s: [a[lo:hi] for a in (x, y, z)]
        for s, lo, hi in zip(SIZES, cuts[:-1], cuts[1:], strict=True)
    }


def _decomposition(data, *, measures="all", folds=3, batch=40):
    dec = lmdx.Decomposition(NAMES, [6, 4, 5], measures=measures, folds=folds)
    for split, arrays in data.items():
        for lo in range(0, len(arrays[0]), batch):
            part = [a[lo : lo + batch] for a in arrays]
            if lo == batch:  # one torch batch, one name -> array mapping
                part = [torch.from_numpy(a) for a in part]
            if lo == 2 * batch:
                part = dict(zip(NAMES, part, strict=True))
            dec.add(split, part)
    return dec


def _ols_r2(u_tr, z_tr, u_te, z_te):
    design = np.hstack([z_tr, np.ones((len(z_tr), 1))])
    coef, *_ = np.linalg.lstsq(design, u_tr, rcond=None)
    resid = u_te - np.hstack([z_te, np.ones((len(z_te), 1))]) @ coef
    return 1.0 - (resid**2).sum() / ((u_te - u_te.mean(0)) ** 2).sum()


@pytest.fixture(scope="module")
def fitted():
    data = _data(np.random.default_rng(2026))
    dec = _decomposition(data)
    return data, dec.fit(ridge=0.0)


def test_every_split_and_all_rows_match_the_reference(fitted):
    data, res = fitted
    sim = res.similarity
    assert sim.measures == tuple(lmdx.lmd.MEASURES)
    assert set(sim.splits) == {"train", "validation", "test", "all"}
    pieces = {**data, "all": [np.concatenate([data[s][j] for s in SIZES]) for j in range(3)]}
    for split, arrays in pieces.items():
        assert sim.splits[split].n == len(arrays[0])
        for i in range(3):
            for j in range(3):
                if i == j:
                    continue
                x, y = arrays[i], arrays[j]
                assert sim.table("cka", split)[i, j] == pytest.approx(ref_cka(x, y), rel=TOL)
                assert sim.table("debiased_cka", split)[i, j] == pytest.approx(
                    ref_debiased_cka(x, y), rel=TOL, abs=TOL
                )
                rho = ref_cca(x, y)
                assert sim.table("cca_mean", split)[i, j] == pytest.approx(rho.mean(), rel=TOL)
                assert sim.table("pillai", split)[i, j] == pytest.approx((rho**2).sum(), rel=TOL)
                sv = ref_svcca(x, y).mean()
                assert sim.table("svcca", split)[i, j] == pytest.approx(sv, rel=TOL)
                assert sim.table("pwcca", split)[i, j] == pytest.approx(ref_pwcca(x, y), rel=TOL)
                assert sim.table("procrustes", split)[i, j] == pytest.approx(
                    ref_procrustes(x, y), rel=TOL
                )


def test_cross_validated_r2_matches_least_squares_on_the_folds(fitted):
    data, res = fitted
    cv = res.similarity.cv
    rows = [np.concatenate([data[s][j] for s in SIZES]) for j in range(3)]
    n = len(rows[0])
    fold = np.arange(n) % 3
    assert cv.counts == tuple(int((fold == f).sum()) for f in range(3)) and cv.ridge == 0.0
    for f in range(3):
        tr, te = fold != f, fold == f
        for a in range(3):
            for b in range(3):
                if a != b:
                    ref = _ols_r2(rows[a][tr], rows[b][tr], rows[a][te], rows[b][te])
                    assert cv.pairwise[f, a, b] == pytest.approx(ref, rel=TOL, abs=TOL)
            rest = np.hstack([rows[j] for j in range(3) if j != a])
            ref = _ols_r2(rows[a][tr], rest[tr], rows[a][te], rest[te])
            assert cv.group[f, a] == pytest.approx(ref, rel=TOL, abs=TOL)
    np.testing.assert_allclose(res.similarity.table("cv_r2"), cv.pairwise.mean(0))
    np.testing.assert_allclose(res.similarity.table("cv_r2_std"), cv.pairwise.std(0, ddof=1))


@given(batch=st.integers(7, 200))
def test_batch_size_does_not_change_the_measures(batch):
    data = _data(np.random.default_rng(5))
    one = _decomposition(data, batch=1000).similarity(cv_ridge=0.0)
    many = _decomposition(data, batch=batch).similarity(cv_ridge=0.0)
    for split in one.splits:
        for key, table in one.splits[split].tables.items():
            np.testing.assert_allclose(
                many.splits[split].tables[key], table, rtol=1e-10, atol=1e-12, err_msg=key
            )
    # The folds follow the order rows were added, not the batches.
    np.testing.assert_allclose(many.cv.pairwise, one.cv.pairwise, rtol=1e-9, atol=1e-12)


def test_json_and_csv_hold_the_tables(fitted, tmp_path):
    _, res = fitted
    doc = json.loads(res.to_json(tmp_path / "r.json"))["similarity"]
    assert doc["measures"] == list(lmdx.lmd.MEASURES)
    assert set(doc["conventions"]) == set(lmdx.lmd.MEASURES)
    assert doc["rank_tol"] == 1e-10 and doc["svcca_variance"] == 0.99
    cka = np.array(doc["splits"]["test"]["tables"]["cka"])
    np.testing.assert_array_equal(cka, res.similarity.table("cka", "test"))
    pairs = doc["splits"]["all"]["canonical_correlations"]["cca"]
    xy = next(p for p in pairs if p["models"] == ["x", "y"])
    np.testing.assert_array_equal(
        xy["rho"], res.similarity.splits["all"].correlations["cca"][("x", "y")]
    )
    assert doc["cv_r2"]["folds"] == 3 and doc["cv_r2"]["pairwise"][0][0][0] is None
    res.to_csv(tmp_path / "r.csv")
    with open(tmp_path / "r.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    pw = next(
        r
        for r in rows
        if (r["kind"], r["target"], r["basis"], r["split"]) == ("pwcca", "z", "x", "validation")
    )
    assert float(pw["value"]) == res.similarity.table("pwcca", "validation")[2, 0]
    assert int(pw["n"]) == SIZES["validation"] and pw["r2"] == ""
    cv = next(r for r in rows if (r["kind"], r["target"], r["basis"]) == ("cv_r2", "y", "x"))
    assert cv["split"] == "all" and float(cv["value"]) == res.similarity.table("cv_r2")[1, 0]
    group = [r for r in rows if r["kind"] == "cv_r2_group"]
    assert [(r["target"], r["basis"]) for r in group] == [("x", "y;z"), ("y", "x;z"), ("z", "x;y")]


def test_measure_heatmaps_are_figures(fitted, tmp_path):
    _, res = fitted
    for measure in res.similarity.measures:
        fig = lmdx.lmd.plot_measure_heatmap(
            res.similarity, measure, path=tmp_path / f"{measure}.png"
        )
        assert fig.axes and (tmp_path / f"{measure}.png").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(ValueError, match="no measure 'cca_r2'; the result has cka, "):
        lmdx.lmd.plot_measure_heatmap(res.similarity, "cca_r2")


def test_measures_chosen_at_construction(rng):
    data = _data(rng)
    default = _decomposition(data, measures=None).fit(ridge=1e-3)
    assert default.similarity.measures == CHEAP_MEASURES and default.similarity.cv is None
    dec = _decomposition(data, measures="cka")
    assert not dec.splits["train"].has_norms and dec.folds is None  # nothing extra streamed
    only = dec.fit(ridge=1e-3)
    assert list(only.similarity.splits["all"].tables) == ["cka"]
    none = _decomposition(data, measures=()).fit(ridge=1e-3)
    assert none.similarity is None and "similarity" not in none.to_dict()
    with pytest.raises(ValueError, match="table: unknown table 'svcca'; this result has cka"):
        only.similarity.table("svcca")
    with pytest.raises(ValueError, match="table: cv_r2 was not computed"):
        only.similarity.table("cv_r2")


def test_errors_are_one_line(rng):
    with pytest.raises(ValueError, match="measures: unknown measure 'cca2'; use 'all' or any of"):
        lmdx.Decomposition(["a", "b"], [2, 2], measures="cka cca2")
    with pytest.raises(ValueError, match="folds: need an integer >= 2, got 1"):
        lmdx.Decomposition(["a", "b"], [2, 2], measures="cv_r2", folds=1)
    dec = lmdx.Decomposition(["a", "b"], [2, 2], measures="cv_r2", folds=5)
    dec.add("train", [rng.standard_normal((6, 2)), rng.standard_normal((6, 2))])
    with pytest.raises(ValueError, match=r"cv_r2: the 5 folds have \[2, 1, 1, 1, 1\] rows"):
        dec.similarity()
    with pytest.raises(ValueError, match="similarity: no split has 2 rows yet"):
        lmdx.Decomposition(["a", "b"], [2, 2]).similarity()


def _ridge_r2(u_tr, z_tr, u_te, z_te, rho):
    """Ridge fit with λ = ρ·tr(Σ_zz)/D_z (population covariance of the training rows) and
    an intercept; pooled R² on the other rows about their own mean."""
    zc, uc = z_tr - z_tr.mean(0), u_tr - u_tr.mean(0)
    szz, szu = zc.T @ zc / len(z_tr), zc.T @ uc / len(z_tr)
    lam = rho * np.trace(szz) / szz.shape[0]
    w = np.linalg.solve(szz + lam * np.eye(len(szz)), szu)
    b = u_tr.mean(0) - z_tr.mean(0) @ w
    resid = u_te - z_te @ w - b
    return 1.0 - (resid**2).sum() / ((u_te - u_te.mean(0)) ** 2).sum()


def test_cross_validated_ridge_is_chosen_on_the_next_fold(rng):
    grid = (1e-3, 0.3, 30.0)
    data = _data(rng)
    data = {
        s: [a + 0.3 * rng.standard_normal(a.shape) for a in arrays] for s, arrays in data.items()
    }
    res = _decomposition(data, folds=4).fit(ridge_grid=grid)
    cv = res.similarity.cv
    assert cv.ridge is None and cv.ridge_grid == grid
    rows = [np.concatenate([data[s][j] for s in SIZES]) for j in range(3)]
    fold = np.arange(len(rows[0])) % 4
    chosen = set()
    for f in range(4):
        v = (f + 1) % 4
        tr, va, te = (fold != f) & (fold != v), fold == v, fold == f
        for a in range(3):
            for b in range(3):
                if a == b:
                    continue
                u, z = rows[a], rows[b]
                scores = [_ridge_r2(u[tr], z[tr], u[va], z[va], r) for r in grid]
                best = grid[int(np.argmax(scores))]
                chosen.add(best)
                ref = _ridge_r2(u[tr], z[tr], u[te], z[te], best)
                assert cv.pairwise[f, a, b] == pytest.approx(ref, rel=1e-9, abs=1e-10)
    assert len(chosen) > 1  # the choice matters in this test
    with pytest.raises(ValueError, match="choosing the ridge on an inner fold needs at least 3"):
        _decomposition(data, folds=2).similarity()
