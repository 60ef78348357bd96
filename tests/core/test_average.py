"""lmdx.weighted_average and lmdx.fisher_average against float64 NumPy references."""

from __future__ import annotations

import lmdx
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

seeds = st.integers(0, 2**32 - 1)
dtypes = st.sampled_from([np.float32, np.float64])


def reference_weighted(xs, c=None):
    """Σ c_i x_i / Σ c_i in float64, and the rounding scale Σ c_i |x_i| / Σ c_i."""
    xs = np.array([np.asarray(x, dtype=np.float64) for x in xs])
    c = np.ones(len(xs)) if c is None else np.asarray(c, dtype=np.float64)
    c = c.reshape((-1,) + (1,) * (xs.ndim - 1))
    return (c * xs).sum(axis=0) / c.sum(), (c * np.abs(xs)).sum(axis=0) / c.sum()


def reference_fisher(params, fishers, c=None, eps=0.0):
    """Σ c_i (F_i+ε) θ_i / Σ c_i (F_i+ε) in float64, and its rounding scale."""
    p = np.array([np.asarray(x, dtype=np.float64) for x in params])
    f = np.array([np.asarray(x, dtype=np.float64) for x in fishers])
    c = np.ones(len(p)) if c is None else np.asarray(c, dtype=np.float64)
    wts = c.reshape((-1,) + (1,) * (p.ndim - 1)) * (f + eps)
    den = wts.sum(axis=0)
    return (wts * p).sum(axis=0) / den, (wts * np.abs(p)).sum(axis=0) / den


def assert_average_close(got, ref, scale, shape):
    assert isinstance(got, np.ndarray) and got.dtype == np.float64
    assert got.shape == shape
    assert np.all(np.abs(got - ref) <= 1e-14 * scale + 1e-300)


@st.composite
def tensor_sets(draw, max_k=4):
    """K same-shaped arrays of mixed float32/float64, shape with 1-3 dims (incl. empty)."""
    k = draw(st.integers(1, max_k))
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=0, max_side=6))
    seed = draw(seeds)
    rng = np.random.default_rng(seed)
    return [
        (rng.standard_normal(shape) * draw(st.sampled_from([1e-3, 1.0, 1e3]))).astype(draw(dtypes))
        for _ in range(k)
    ]


def coefficients_for(k):
    nonneg = st.one_of(st.just(0.0), st.floats(1e-3, 10.0))
    return st.one_of(
        st.none(),
        st.lists(nonneg, min_size=k, max_size=k).filter(lambda c: sum(c) > 0),
    )


# --------------------------------------------------------------------------- weighted_average


@given(data=st.data(), xs=tensor_sets())
def test_weighted_average_matches_reference(data, xs):
    c = data.draw(coefficients_for(len(xs)))
    got = lmdx.weighted_average(xs, c)
    ref, scale = reference_weighted(xs, c)
    assert_average_close(got, ref, scale, xs[0].shape)


def test_weighted_average_large_threaded(rng):
    # More than 4 blocks of 4096 elements: the threaded path.
    xs = [rng.standard_normal(50_001).astype(dt) for dt in (np.float32, np.float64, np.float32)]
    c = [0.2, 1.5, 3.0]
    one = lmdx.weighted_average(xs, c, n_threads=1)
    two = lmdx.weighted_average(xs, c, n_threads=2)
    assert np.array_equal(one, two)
    ref, scale = reference_weighted(xs, c)
    assert_average_close(one, ref, scale, (50_001,))


def test_weighted_average_single_tensor_is_widened_copy(rng):
    x = rng.standard_normal((3, 4)).astype(np.float32)
    got = lmdx.weighted_average([x], [2.5])
    assert got.dtype == np.float64 and np.array_equal(got, x.astype(np.float64))


@given(
    x=hnp.arrays(
        np.float32,
        st.integers(1, 50),
        elements=st.floats(width=32, allow_nan=False, allow_infinity=False),
    ),
    c=st.lists(st.floats(1e-3, 1e3), min_size=2, max_size=5),
)
def test_weighted_average_of_equal_tensors_comes_back_in_float32(x, c):
    """A tensor equal in every model (a frozen layer) needs no statistics: its average,
    cast back to float32, is the tensor bit for bit, whatever the coefficients."""
    out = lmdx.weighted_average([x] * len(c), c).astype(np.float32)
    assert np.array_equal(out, x)


def test_weighted_average_zero_coefficient_ignores_that_tensor(rng):
    xs = [rng.standard_normal(5), rng.standard_normal(5), rng.standard_normal(5)]
    got = lmdx.weighted_average(xs, [1.0, 0.0, 3.0])
    np.testing.assert_allclose(got, (xs[0] + 3 * xs[2]) / 4, rtol=1e-15, atol=1e-15)


@given(data=st.data(), xs=tensor_sets(), threads=st.sampled_from([1, 2]))
def test_float32_average_is_the_float64_average_rounded_once(data, xs, threads):
    """``dtype="float32"``: the float64 average cast to float32, bit for bit (one pass)."""
    c = data.draw(coefficients_for(len(xs)))
    got = lmdx.weighted_average(xs, c, dtype="float32", n_threads=threads)
    want = lmdx.weighted_average(xs, c).astype(np.float32)
    assert got.dtype == np.float32 and got.shape == xs[0].shape
    assert np.array_equal(got, want)


def test_float32_average_large_threaded_and_its_checks(rng):
    xs = [rng.standard_normal((300, 257)).astype(np.float32) for _ in range(3)]
    c = [0.5, 2.0, 1.0]
    one = lmdx.weighted_average(xs, c, dtype="float32", n_threads=1)
    two = lmdx.weighted_average(xs, c, dtype="float32", n_threads=2)
    assert np.array_equal(one, two)
    assert np.array_equal(one, lmdx.weighted_average(xs, c).astype(np.float32))
    bad = xs[2].copy()
    bad[299, 256] = np.inf  # the very last element: found through the result
    with pytest.raises(ValueError, match=r"^tensors\[2\]: contains Inf at index 77099"):
        lmdx.weighted_average([*xs[:2], bad], c, dtype="float32", n_threads=2)
    with pytest.raises(ValueError, match=r"^tensors\[2\]: contains Inf"):  # c = 0: directly
        lmdx.weighted_average([*xs[:2], bad], [1.0, 1.0, 0.0], dtype="float32")
    big = np.full(5, np.finfo(np.float32).max, np.float32)  # the largest: still finite
    assert np.array_equal(lmdx.weighted_average([big, big], dtype="float32"), big)
    with pytest.raises(ValueError, match=r"^dtype: must be float64 or float32, got 'float16'"):
        lmdx.weighted_average(xs, dtype="float16")


# --------------------------------------------------------------------------- fisher_average


@given(data=st.data(), params=tensor_sets(), eps=st.sampled_from([0.0, 1e-8, 0.5]))
def test_fisher_average_matches_reference(data, params, eps):
    k = len(params)
    rng = np.random.default_rng(data.draw(seeds))
    fishers = []
    for p in params:
        f = rng.exponential(1.0, p.shape) * data.draw(st.sampled_from([1e-6, 1.0, 1e4]))
        fishers.append(f.astype(data.draw(dtypes)))
    if eps == 0.0:  # every element needs one positive Fisher value somewhere
        fishers[0] = fishers[0] + np.asarray(1e-3, fishers[0].dtype)
    else:  # exact zeros are allowed when eps > 0
        fishers[-1][rng.random(fishers[-1].shape) < 0.3] = 0.0
    c = data.draw(coefficients_for(k).filter(lambda c: c is None or c[0] > 0))
    got = lmdx.fisher_average(params, fishers, c, eps=eps)
    ref, scale = reference_fisher(params, fishers, c, eps)
    assert_average_close(got, ref, 4 * scale, params[0].shape)


def test_fisher_average_large_threaded(rng):
    n = 40_000
    params = [rng.standard_normal(n), rng.standard_normal(n).astype(np.float32)]
    fishers = [rng.exponential(1.0, n).astype(np.float32), rng.exponential(1.0, n)]
    one = lmdx.fisher_average(params, fishers, [1.0, 2.0], eps=1e-6, n_threads=1)
    two = lmdx.fisher_average(params, fishers, [1.0, 2.0], eps=1e-6, n_threads=2)
    assert np.array_equal(one, two)
    ref, scale = reference_fisher(params, fishers, [1.0, 2.0], 1e-6)
    assert_average_close(one, ref, 4 * scale, (n,))


def test_fisher_average_equal_fishers_is_plain_average(rng):
    params = [rng.standard_normal((4, 3)) for _ in range(3)]
    f = rng.exponential(1.0, (4, 3))
    got = lmdx.fisher_average(params, [f, f, f])
    np.testing.assert_allclose(got, np.mean(params, axis=0), rtol=1e-13, atol=1e-15)


def test_fisher_average_zero_fisher_where_another_model_is_positive(rng):
    params = [np.array([1.0, 2.0]), np.array([5.0, 7.0])]
    fishers = [np.array([0.0, 1.0]), np.array([2.0, 0.0])]
    got = lmdx.fisher_average(params, fishers)  # eps = 0 is fine: each element has F > 0
    np.testing.assert_array_equal(got, [5.0, 2.0])


# --------------------------------------------------------------------------- shapes


@pytest.mark.parametrize("kind", ["python", "numpy", "torch"])
def test_zero_dimensional_tensors_keep_their_shape(kind):
    # A scalar parameter (e.g. a logit scale) averages to a scalar, not to shape (1,).
    make = {
        "python": float,
        "numpy": np.float64,
        "torch": lambda v: torch.tensor(v, dtype=torch.float32),
    }[kind]
    got = lmdx.weighted_average([make(1.0), make(4.0)], [2.0, 1.0])
    assert got.shape == ()
    assert float(got) == pytest.approx(2.0, rel=1e-15)
    fisher = lmdx.fisher_average([make(1.0), make(4.0)], [make(1.0), make(3.0)])
    assert fisher.shape == ()
    assert float(fisher) == pytest.approx(13.0 / 4.0, rel=1e-15)


def test_empty_tensors():
    got = lmdx.weighted_average([np.zeros((0, 3)), np.zeros((0, 3), np.float32)])
    assert got.shape == (0, 3) and got.dtype == np.float64
    got = lmdx.fisher_average([np.zeros((2, 0))], [np.zeros((2, 0))])
    assert got.shape == (2, 0) and got.dtype == np.float64


# --------------------------------------------------------------------------- errors


def test_weighted_average_errors():
    ones = np.ones(3)
    with pytest.raises(
        ValueError,
        match=r"^tensors\[1\]: is a float64 array of shape \(4,\) but expected the shape of "
        r"tensors\[0\]",
    ):
        lmdx.weighted_average([ones, np.ones(4)])
    with pytest.raises(ValueError, match=r"^tensors\[1\]: is a .* \(3, 1\)"):
        lmdx.weighted_average([ones, np.ones((3, 1))])
    with pytest.raises(ValueError, match=r"^tensors\[1\]: contains NaN at index 1"):
        lmdx.weighted_average([ones, np.array([1.0, np.nan, 2.0])])
    with pytest.raises(ValueError, match=r"^tensors\[0\]: contains Inf at index 2"):
        lmdx.weighted_average([np.array([1.0, 2.0, -np.inf], np.float32), ones])
    with pytest.raises(ValueError, match=r"^coefficients\[1\]: must be finite and >= 0"):
        lmdx.weighted_average([ones, ones], [1.0, -1.0])
    with pytest.raises(ValueError, match=r"^coefficients: must not all be zero"):
        lmdx.weighted_average([ones, ones], [0.0, 0.0])
    with pytest.raises(
        ValueError, match=r"^coefficients: expected 2 values \(one per model\), got 3"
    ):
        lmdx.weighted_average([ones, ones], [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match=r"^tensors: need at least one tensor"):
        lmdx.weighted_average([])
    with pytest.raises(
        ValueError, match=r"^tensors\[0\]: expected numbers, got an array of dtype <U1"
    ):
        lmdx.weighted_average([np.array(["a"])])
    with pytest.raises(ValueError, match=r"^n_threads: must be >= 1"):
        lmdx.weighted_average([ones], n_threads=-1)


def test_fisher_average_errors():
    ones = np.ones(3)
    with pytest.raises(
        ValueError,
        match=r"^fishers\[1\]: is a float64 array of shape \(4,\) but expected the shape of "
        r"params\[0\]",
    ):
        lmdx.fisher_average([ones, ones], [ones, np.ones(4)])
    with pytest.raises(
        ValueError, match=r"^params\[1\]: is a .*\(4,\) but expected the shape of params\[0\]"
    ):
        lmdx.fisher_average([ones, np.ones(4)], [ones, ones])
    with pytest.raises(
        ValueError, match=r"^fishers\[1\]: must be >= 0 \(squared gradients\), min is -2"
    ):
        lmdx.fisher_average([ones, ones], [ones, np.array([1.0, -2.0, 1.0])])
    with pytest.raises(ValueError, match=r"^fishers\[0\]: must be >= 0"):
        lmdx.fisher_average([ones], [np.array([0.0, -1e-30, 0.0], np.float32)], eps=1.0)
    with pytest.raises(
        ValueError, match=r"^fishers: the weights sum to zero at element 1 .*pass eps > 0"
    ):
        lmdx.fisher_average([ones, ones], [np.array([1.0, 0, 1]), np.array([1.0, 0, 1])])
    with pytest.raises(ValueError, match=r"^fishers: the weights sum to zero at element 0"):
        lmdx.fisher_average([ones, ones], [np.zeros(3), np.zeros(3)], eps=0.0)
    with pytest.raises(ValueError, match=r"^fishers: the weights sum to zero at element 1 "):
        # the only model with a positive Fisher there has coefficient 0
        lmdx.fisher_average([ones, ones], [np.array([1.0, 0, 1]), ones], [1.0, 0.0])
    with pytest.raises(ValueError, match=r"^fishers\[1\]: contains NaN at index 1"):
        lmdx.fisher_average([ones, ones], [ones, np.array([1.0, np.nan, 1.0])])
    with pytest.raises(ValueError, match=r"^params\[1\]: contains Inf at index 0"):
        lmdx.fisher_average([ones, np.array([np.inf, 1.0, 1.0])], [ones, ones])
    with pytest.raises(ValueError, match=r"^fishers: expected 2 tensors \(one per model\), got 1"):
        lmdx.fisher_average([ones, ones], [ones])
    with pytest.raises(ValueError, match=r"^fishers: expected 1 tensors \(one per model\), got 2"):
        lmdx.fisher_average([ones], [ones, ones])
    with pytest.raises(ValueError, match=r"^eps: must be finite and >= 0"):
        lmdx.fisher_average([ones], [ones], eps=-1.0)
    with pytest.raises(ValueError, match=r"^eps: must be finite and >= 0"):
        lmdx.fisher_average([ones], [ones], eps=float("nan"))
    with pytest.raises(ValueError, match=r"^coefficients: must not all be zero"):
        lmdx.fisher_average([ones, ones], [ones, ones], [0.0, 0.0])


def test_fisher_zero_sum_deep_in_a_large_threaded_array_is_reported(rng):
    n = 40_000
    f = rng.exponential(1.0, n) + 0.1
    f[33_333] = 0.0
    with pytest.raises(ValueError, match=r"^fishers: the weights sum to zero at element 33333 "):
        lmdx.fisher_average([np.ones(n)], [f], n_threads=2)
