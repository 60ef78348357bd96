"""The renamed LMD names (lmdx.lmd.names): each old spelling gives what the new one
gives, and warns naming the new one."""

from __future__ import annotations

import lmdx
import numpy as np
import pytest
from lmd_reference import decomposition, three_splits


@pytest.fixture
def dec(rng):
    return decomposition(["a", "b", "c"], three_splits(rng, [200, 60, 60], [3, 2, 2]))


def _same_fits(old, new):
    assert old.ridge == new.ridge and old.ridge_absolute == new.ridge_absolute
    assert old.ridge_scores == new.ridge_scores
    assert old.r2 == new.r2 and old.r2_per_dim == new.r2_per_dim


@pytest.mark.parametrize("method", ["fit", "fit_one"])
@pytest.mark.parametrize(
    ("old", "new"),
    [
        ({"rho": 0.01}, {"ridge": 0.01}),
        ({"rho_grid": [1e-6, 0.1]}, {"ridge_grid": [1e-6, 0.1]}),
        ({"mode": "compat", "alpha": 0.02}, {"mode": "compat", "ridge_absolute": 0.02}),
    ],
)
def test_deprecated_keywords_still_work(dec, method, old, new):
    key = next(k for k in old if k != "mode")
    target = next(k for k in new if k != "mode")
    call = getattr(dec, method)
    args = ("a", ["b", "c"]) if method == "fit_one" else ()
    with pytest.warns(DeprecationWarning, match=rf"{key}=\.\.\.\) is deprecated; use {target}="):
        got = call(*args, **old)
    want = call(*args, **new)
    if method == "fit_one":
        _same_fits(got, want)
        np.testing.assert_array_equal(got.weight, want.weight)
    else:
        assert got.ridge_grid == want.ridge_grid and got.ridge_absolute == want.ridge_absolute
        for f_old, f_new in zip(got.pairwise + got.group, want.pairwise + want.group, strict=True):
            _same_fits(f_old, f_new)


def test_old_and_new_spelling_together_or_unknown_keywords_are_refused(dec):
    with pytest.raises(TypeError, match=r"Decomposition.fit\(\): pass ridge= only"):
        dec.fit(ridge=0.1, rho=0.1)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'rhoo'"):
        dec.fit_one("a", "b", rhoo=0.1)
    with pytest.raises(ValueError, match=r"ridge_absolute belongs to mode='compat'"):
        dec.fit(ridge_absolute=1e-6)


@pytest.mark.parametrize(
    ("old", "new"),
    [("rho", "ridge"), ("lam", "ridge_absolute"), ("rho_scores", "ridge_scores")],
)
def test_deprecated_fit_attributes_still_work(dec, old, new):
    fit = dec.fit_one("a", "b")
    assert getattr(fit, new) is not None
    with pytest.warns(DeprecationWarning, match=rf"LMDFit\.{old} is deprecated; use LMDFit\.{new}"):
        assert getattr(fit, old) == getattr(fit, new)


@pytest.mark.parametrize(
    ("mode", "old", "new"),
    [("default", "rho_grid", "ridge_grid"), ("compat", "alpha", "ridge_absolute")],
)
def test_deprecated_result_attributes_still_work(dec, mode, old, new):
    result = dec.fit(mode=mode, pairwise=False)
    assert getattr(result, new) is not None
    with pytest.warns(DeprecationWarning, match=rf"DecompositionResult\.{old} is deprecated"):
        assert getattr(result, old) == getattr(result, new)


@pytest.mark.parametrize(
    ("old", "new"),
    [("DEFAULT_RHO_GRID", "DEFAULT_RIDGE_GRID"), ("COMPAT_ALPHA", "COMPAT_RIDGE_ABSOLUTE")],
)
def test_deprecated_constants_still_resolve(old, new):
    expected = getattr(lmdx.lmd, new)
    with pytest.warns(DeprecationWarning, match=rf"lmdx\.lmd\.{old} is deprecated; use .*{new}"):
        assert getattr(lmdx.lmd, old) == expected
    # The names that left the top level still resolve there, with one notice naming the
    # new place and the new name.
    with pytest.warns(DeprecationWarning) as record:
        assert getattr(lmdx, old) == expected
    assert [str(w.message) for w in record] == [f"lmdx.{old} is now lmdx.lmd.{new}; use that"]
    with pytest.raises(AttributeError, match="has no attribute 'RHO'"):
        _ = lmdx.lmd.RHO
