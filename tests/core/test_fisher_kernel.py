"""The native kernel of the diagonal Fisher of linear weights (sum_squared_products)
against a float64 NumPy reference: Σ_e (a_eᵀ b_e)², element-wise."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lmdx._core import core


def reference(a, b):
    """Σ_e (a_eᵀ b_e)² in float64, and its rounding scale Σ_e (|a_e|ᵀ |b_e|)²."""
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    g = np.einsum("etp,etq->epq", a64, b64)
    s = np.einsum("etp,etq->epq", np.abs(a64), np.abs(b64))
    return (g * g).sum(axis=0), (s * s).sum(axis=0)


def assert_close(got, a, b, start=0.0):
    """got is start + the formula: within the rounding of the products and float32 sums,
    and of adding a few float64 partial sums into start."""
    ref, scale = reference(a, b)
    n, t = a.shape[:2]
    # float32 products: each of t terms rounded (≤ (t + 1)·2⁻²⁴ relative to Σ|a||b|),
    # doubled by squaring, and up to 16 squares summed in float32 (≤ 16·2⁻²⁴ of their
    # sum); float64 likewise at 2⁻⁵³.
    unit = 2.0**-24 if a.dtype == np.float32 else 2.0**-53
    want = start + ref
    bound = (4 * (t + 1) + min(n, 16)) * unit * scale + 4 * 2.0**-53 * want + 1e-300
    assert got.dtype == np.float64 and got.shape == ref.shape
    assert np.all(np.abs(got - want) <= bound)


def arrays(rng, n, t, p, q, dtype, scale=1.0):
    a = (rng.standard_normal((n, t, p)) * scale).astype(dtype)
    b = (rng.standard_normal((n, t, q)) / scale).astype(dtype)
    return a, b


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 4),
    t=st.integers(0, 6),
    p=st.integers(1, 9),
    q=st.integers(1, 9),
    dtype=st.sampled_from([np.float32, np.float64]),
    scale=st.sampled_from([1e-3, 1.0, 1e3]),
    seed=st.integers(0, 2**32 - 1),
)
def test_matches_the_float64_formula(n, t, p, q, dtype, scale, seed):
    a, b = arrays(np.random.default_rng(seed), n, t, p, q, dtype, scale)
    assert_close(core.sum_squared_products(a=a, b=b, n_threads=1), a, b)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("p", "q"), [(64, 256), (65, 257), (130, 600), (1, 513)])
def test_tiles_and_their_edges(dtype, p, q):
    """Results tiled by 64 rows x 256 columns: full tiles, one more, several, thin ones."""
    a, b = arrays(np.random.default_rng(p * 1000 + q), 5, 7, p, q, dtype)
    assert_close(core.sum_squared_products(a=a, b=b, n_threads=2), a, b)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_many_examples_and_long_sequences(dtype):
    """More examples than one float32 partial sum takes (16), and rows in the hundreds."""
    a, b = arrays(np.random.default_rng(3), 37, 300, 50, 20, dtype)
    assert_close(core.sum_squared_products(a=a, b=b, n_threads=2), a, b)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(0, 20),
    t=st.integers(0, 6),
    extra=st.integers(1, 5),
    p=st.integers(1, 70),
    q=st.integers(1, 40),
    dtype=st.sampled_from([np.float32, np.float64]),
    seed=st.integers(0, 2**32 - 1),
)
def test_rows_of_zeros_change_nothing(n, t, extra, p, q, dtype, seed):
    """Rows inserted anywhere whose a, b or both are zero (padding; positions a loss does
    not read) leave the sums the same bit for bit, and the float64 formula's."""
    rng = np.random.default_rng(seed)
    a, b = arrays(rng, n, t, p, q, dtype)
    wide_a = np.zeros((n, t + extra, p), dtype)
    wide_b = np.zeros((n, t + extra, q), dtype)
    for e in range(n):
        real = np.sort(rng.choice(t + extra, size=t, replace=False))
        wide_a[e, real], wide_b[e, real] = a[e], b[e]
        for s in np.setdiff1d(np.arange(t + extra), real):
            side = rng.integers(3)  # which operand's row stays zero: a, b or both
            if side == 1:
                wide_a[e, s] = rng.standard_normal(p)
            elif side == 0:
                wide_b[e, s] = rng.standard_normal(q)
    want = core.sum_squared_products(a=a, b=b, n_threads=2)
    got = core.sum_squared_products(a=wide_a, b=wide_b, n_threads=2)
    assert np.array_equal(got, want)
    assert_close(got, wide_a, wide_b)


def test_examples_are_summed_after_their_rows():
    """One example with two rows: (a₁b₁ + a₂b₂)², not a₁²b₁² + a₂²b₂²."""
    a = np.array([[[1.0], [2.0]]])
    b = np.array([[[3.0], [-1.0]]])
    assert core.sum_squared_products(a=a, b=b, n_threads=1).tolist() == [[1.0]]


def test_result_does_not_depend_on_the_thread_count():
    a, b = arrays(np.random.default_rng(7), 9, 11, 150, 700, np.float32)
    one = core.sum_squared_products(a=a, b=b, n_threads=1)
    two = core.sum_squared_products(a=a, b=b, n_threads=2)
    assert np.array_equal(one, two)


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(0, 40),
    t=st.integers(1, 5),
    p=st.integers(1, 70),
    q=st.integers(1, 20),
    dtype=st.sampled_from([np.float32, np.float64]),
    seed=st.integers(0, 2**32 - 1),
)
def test_out_is_added_into_and_returned(n, t, p, q, dtype, seed):
    """With out, the sums are added into it (in place, returned): its old values plus the
    float64 formula, over more examples than one float32 partial sum takes."""
    rng = np.random.default_rng(seed)
    a, b = arrays(rng, n, t, p, q, dtype)
    start = rng.standard_normal((p, q)) ** 2
    out = start.copy()
    assert core.sum_squared_products(a=a, b=b, out=out, n_threads=2) is out
    assert_close(out, a, b, start)


def test_out_starting_at_zero_equals_a_new_result():
    a, b = arrays(np.random.default_rng(11), 9, 6, 100, 37, np.float32)
    out = np.zeros((100, 37))
    core.sum_squared_products(a=a, b=b, out=out, n_threads=2)
    assert np.array_equal(out, core.sum_squared_products(a=a, b=b, n_threads=1))


@pytest.mark.parametrize(
    ("out", "message"),
    [
        (np.zeros((5, 4)), r"out: .*\(5, 4\).* expected the shape of the result"),
        (np.zeros((4, 5), np.float32), "out: expected a float64 array"),
        (np.zeros((5, 4)).T, "out: .*not C-contiguous"),
    ],
)
def test_bad_out_is_named(out, message):
    a, b = np.ones((2, 3, 4)), np.ones((2, 3, 5))
    with pytest.raises(ValueError, match=message):
        core.sum_squared_products(a=a, b=b, out=out, n_threads=1)


def test_read_only_or_overlapping_out_is_refused():
    a, b = np.ones((2, 3, 4)), np.ones((2, 3, 4))
    frozen = np.zeros((4, 4))
    frozen.flags.writeable = False
    with pytest.raises(ValueError, match="out: is read-only"):
        core.sum_squared_products(a=a, b=b, out=frozen, n_threads=1)
    shared = np.zeros(40)  # a is its last 24 values, out the 16 from 8: 8 in common
    a_view, out_view = shared[16:].reshape(2, 3, 4), shared[8:24].reshape(4, 4)
    with pytest.raises(ValueError, match="out: shares memory with a or b"):
        core.sum_squared_products(a=a_view, b=b, out=out_view, n_threads=1)
    assert np.array_equal(shared, np.zeros(40))


def test_no_examples_give_zeros():
    a, b = np.zeros((0, 3, 4), np.float32), np.zeros((0, 3, 5), np.float32)
    assert np.array_equal(core.sum_squared_products(a=a, b=b, n_threads=1), np.zeros((4, 5)))


@pytest.mark.parametrize(
    ("a", "b", "message"),
    [
        (np.zeros((2, 3, 4)), np.zeros((3, 3, 4)), "b: expected the examples and rows of a"),
        (np.zeros((2, 3, 4)), np.zeros((2, 2, 4)), "b: expected the examples and rows of a"),
        (np.zeros((2, 3, 4)), np.zeros((2, 3, 4), np.float32), "expected one dtype"),
        (np.zeros((2, 3)), np.zeros((2, 3, 4)), "a: expected a C-contiguous"),
        (np.zeros((2, 3, 4), np.int64), np.zeros((2, 3, 4)), "a: expected a C-contiguous"),
        (np.zeros((2, 4, 3)).transpose(0, 2, 1), np.zeros((2, 3, 4)), "not C-contiguous"),
        (np.full((2, 3, 4), np.nan), np.zeros((2, 3, 4)), "a:"),
        (np.zeros((2, 3, 4)), np.full((2, 3, 4), np.inf), "b:"),
    ],
)
def test_bad_arguments_are_named(a, b, message):
    with pytest.raises(ValueError, match=message):
        core.sum_squared_products(a=a, b=b, n_threads=1)


def test_packed_operands_are_not_kept_in_the_scratch_pool():
    """Calls of growing batches leave the pool only the fixed per-thread tile buffers, not
    copies of their inputs (the pool keeps every buffer size it is given)."""
    core.release_scratch()
    rng = np.random.default_rng(5)
    for n, t in ((4, 16), (8, 64), (16, 128)):  # the last inputs: 16 x 128 x 1024 floats, 8 MiB
        a, b = arrays(rng, n, t, 1024, 1024, np.float32)
        core.sum_squared_products(a=a, b=b, n_threads=2)
    assert core.scratch_bytes() < 1 << 20
