"""lmdx.moments.gram_product (G Y from a full or packed Gram) against NumPy's float64
``G @ Y`` on the unpacked matrix, written here."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lmdx.moments import gram_product


def packed_upper(g: np.ndarray) -> np.ndarray:
    """The upper triangle row by row, as statistics files store a Gram."""
    return g[np.triu_indices(g.shape[0])]


@settings(max_examples=80, deadline=None)
@given(
    d=st.integers(1, 130),
    p=st.integers(0, 40),
    rows=st.integers(1, 200),
    seed=st.integers(0, 2**31 - 1),
    packed=st.booleans(),
)
def test_gram_product_equals_the_reference(d, p, rows, seed, packed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, d)) * rng.uniform(0.01, 100.0, d)
    g = x.T @ x
    y = rng.standard_normal((d, p))
    expected = g @ y
    # rounding of any order of the sums: d terms of |G||Y|
    scale = np.abs(g) @ np.abs(y)
    for threads in (1, 2):
        got = gram_product(packed_upper(g) if packed else g, y, n_threads=threads)
        assert got.shape == (d, p)
        assert np.all(np.abs(got - expected) <= 4 * d * np.finfo(float).eps * scale + 1e-300)
    # one fixed order of the sums: the same bits on 1 and 2 threads and wherever y lies
    g_in = packed_upper(g) if packed else g
    one = gram_product(g_in, y, n_threads=1)
    shifted = np.empty(d * p + 1)[1:].reshape(d, p)
    shifted[...] = y
    assert np.array_equal(one, gram_product(g_in, y, n_threads=2))
    assert np.array_equal(one, gram_product(g_in, shifted, n_threads=2))


def test_gram_product_reads_a_mapped_read_only_triangle():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((50, 20))
    packed = packed_upper(x.T @ x)
    packed.setflags(write=False)
    y = rng.standard_normal((20, 3))
    np.testing.assert_allclose(gram_product(packed, y), (x.T @ x) @ y, rtol=1e-12)


@pytest.mark.parametrize(
    "gram,y,match",
    [
        (np.zeros(7), np.zeros((3, 1)), "no packed triangle"),
        (np.zeros((3, 4)), np.zeros((3, 1)), "square"),
        (np.zeros(6), np.zeros((4, 1)), r"shape \(3, p\)"),
        (np.zeros((3, 3)), np.zeros(3), "y"),
        (np.zeros((3, 3), np.float32), np.zeros((3, 1)), "gram"),
    ],
)
def test_gram_product_refuses_shapes_that_disagree(gram, y, match):
    with pytest.raises(ValueError, match=match):
        gram_product(gram, y) if gram.dtype == np.float64 else _raw(gram, y)


def _raw(gram, y):
    from lmdx import _core

    return _core.core.gram_product(gram=gram, y=y, n_threads=1)
