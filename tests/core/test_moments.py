"""lmdx.Moments: count, sum and Gram against a float64 NumPy reference written here."""

from __future__ import annotations

import threading

import lmdx
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

DTYPES = (np.float32, np.float64)
F32_GRAM_RTOL = 1e-6  # DESIGN.md: float32 chunks stay within 1e-6 relative (Frobenius)
F64_RTOL = 1e-12


# --------------------------------------------------------------------------- reference


def reference(x: np.ndarray, w: np.ndarray | None = None):
    """float64 count, sum and Gram of rows x (r, d) with optional per-row weights w (r,).

    Also returns elementwise error scales Σ w|x| and Σ w|x||x|ᵀ, the natural bound for
    rounding errors of any summation order.
    """
    x = np.asarray(x, dtype=np.float64).reshape(-1, np.shape(x)[-1])
    w = np.ones(x.shape[0]) if w is None else np.asarray(w, dtype=np.float64).reshape(-1)
    n = float(np.sum(w))
    s = np.einsum("t,ti->i", w, x)
    g = np.einsum("t,ti,tj->ij", w, x, x)
    ax = np.abs(x)
    return n, s, g, np.einsum("t,ti->i", w, ax), np.einsum("t,ti,tj->ij", w, ax, ax)


# float32 products are summed in float32 over at most this many rows before they are added
# into float64 (the Gram kernel's flush): whatever the data, each entry's error is at most
# about that many float32 roundings of the sum of the absolute products.
F32_FLUSH_ROWS = 64


def assert_moments_match(
    m: lmdx.Moments, x, w=None, *, input_dtype=np.float64, typical: bool = False
) -> None:
    """``typical``: float32 rows like activations (no adversarial magnitudes), for which the
    Gram stays within 1e-6 relative (Frobenius) of the float64 one; any rows stay within
    the elementwise bound of float32 sums over F32_FLUSH_ROWS rows (a row 200 times the
    others followed by 63 small ones reaches 1.01e-6)."""
    n, s, g, s_scale, g_scale = reference(x, w)
    assert m.count == pytest.approx(n, rel=1e-13, abs=0)
    # Sums are accumulated in float64 whatever the input dtype.
    assert np.all(np.abs(m.sum - s) <= F64_RTOL * s_scale + 1e-300)
    gram = m.gram()
    assert gram.dtype == np.float64 and gram.shape == (m.dim, m.dim)
    assert np.array_equal(gram, gram.T), "the Gram must be exactly symmetric"
    if np.dtype(input_dtype) == np.float64:
        assert np.all(np.abs(gram - g) <= F64_RTOL * g_scale + 1e-300)
    else:
        # float32 products below float32's smallest normal number underflow (in any float32
        # arithmetic): each of the n products of an entry may lose up to that much.
        rows = np.asarray(x).reshape(-1, m.dim).shape[0]
        underflow = rows * m.dim * float(np.finfo(np.float32).smallest_normal)
        bound = (F32_FLUSH_ROWS + 4) * 2.0**-24 * g_scale
        assert np.all(np.abs(gram - g) <= bound + underflow)
        if typical:
            assert np.linalg.norm(gram - g) <= F32_GRAM_RTOL * np.linalg.norm(g) + underflow


def assert_same_state(a: lmdx.Moments, b: lmdx.Moments) -> None:
    assert a.count == b.count
    assert np.array_equal(a.sum, b.sum)
    assert np.array_equal(a.gram(), b.gram())


# --------------------------------------------------------------------------- strategies


def finite(dtype) -> st.SearchStrategy[float]:
    width = 32 if np.dtype(dtype) == np.float32 else 64
    return st.floats(-1e3, 1e3, width=width, allow_subnormal=False)


@st.composite
def batches(draw, max_rows: int = 40, max_dim: int = 9, dtypes=DTYPES):
    """An array of shape (*leading, d): float32 or float64, 1-2 leading dims."""
    dtype = draw(st.sampled_from(dtypes))
    d = draw(st.integers(1, max_dim))
    if draw(st.booleans()):
        lead: tuple[int, ...] = (draw(st.integers(0, max_rows)),)
    else:
        outer = draw(st.integers(0, 6))
        lead = (outer, draw(st.integers(0, max_rows // max(outer, 1))))
    return draw(hnp.arrays(dtype, (*lead, d), elements=finite(dtype)))


@st.composite
def gaussian_batches(
    draw, max_rows: int = 120, max_dim: int = 12, dtypes=DTYPES, min_rows: int = 0
):
    """Gaussian rows (rows, d) with a random offset and scale (as activations look)."""
    dtype = draw(st.sampled_from(dtypes))
    d = draw(st.integers(1, max_dim))
    rows = draw(st.integers(min_rows, max_rows))
    seed = draw(st.integers(0, 2**32 - 1))
    shift = draw(st.sampled_from([0.0, 0.5, 3.0, -20.0]))
    scale = draw(st.sampled_from([1e-3, 1.0, 50.0]))
    rng = np.random.default_rng(seed)
    return (shift + scale * rng.standard_normal((rows, d))).astype(dtype)


seeds = st.integers(0, 2**32 - 1)


# --------------------------------------------------------------------------- basic statistics


@given(x=batches())
def test_count_sum_gram_match_float64_reference(x):
    m = lmdx.Moments(x.shape[-1]).update(x)
    assert_moments_match(m, x, input_dtype=x.dtype)


@given(x=gaussian_batches(), chunk=st.integers(1, 9), threads=st.sampled_from([1, 2]))
def test_small_chunks_match_reference(x, chunk, threads):
    m = lmdx.Moments(x.shape[-1], chunk_rows=chunk).update(x, n_threads=threads)
    assert m.chunk_rows == chunk and m.dim == x.shape[-1]
    assert_moments_match(m, x, input_dtype=x.dtype, typical=True)


def test_single_row_vector_and_empty_batch(rng):
    x = rng.standard_normal(5)
    m = lmdx.Moments(5).update(x)
    assert_moments_match(m, x[None, :])
    m.update(np.zeros((0, 5)))
    assert_moments_match(m, x[None, :])
    empty = lmdx.Moments(5).update(np.zeros((0, 5), np.float32))
    assert empty.count == 0.0
    assert np.array_equal(empty.sum, np.zeros(5)) and np.array_equal(empty.gram(), np.zeros((5, 5)))


@given(
    d=st.integers(1, 48),
    seed=seeds,
    shift=st.sampled_from([0.0, 1.0, 10.0]),
    chunks=st.sampled_from([1.0, 2.5]),
)
def test_float32_gram_within_1e6_at_default_chunk_rows(d, seed, shift, chunks):
    rows = int(chunks * lmdx.moments.DEFAULT_CHUNK_ROWS)
    x = (shift + np.random.default_rng(seed).standard_normal((rows, d))).astype(np.float32)
    m = lmdx.Moments(d).update(x)
    assert_moments_match(m, x, input_dtype=np.float32, typical=True)


@pytest.mark.parametrize("value", [1 / 3, 1.7], ids=["one_third", "1.7"])
def test_float32_gram_within_1e6_for_repeated_rows(value):
    # moments.hpp: float32 products summed over <= 64 rows, then in float64, stay within
    # 1e-6 (relative, Frobenius) of a float64 accumulation -- for any data, including
    # one row repeated (a saturated feature, a constant input).
    x = np.full((lmdx.moments.DEFAULT_CHUNK_ROWS, 8), value, dtype=np.float32)
    m = lmdx.Moments(8).update(x, n_threads=1)
    exact = x.astype(np.float64).T @ x.astype(np.float64)
    rel = np.linalg.norm(m.gram() - exact) / np.linalg.norm(exact)
    assert rel <= F32_GRAM_RTOL, f"relative Frobenius error {rel:.3g} > 1e-6"


# --------------------------------------------------------------------------- masks and weights


@given(x=batches(), mask_seed=seeds, kind=st.sampled_from(["int", "float", "bool", "torch"]))
def test_mask_excludes_rows(x, mask_seed, kind):
    lead = x.shape[:-1]
    keep = np.random.default_rng(mask_seed).random(lead) < 0.6
    mask = {
        "int": keep.astype(np.int64),
        "float": keep.astype(np.float32),
        "bool": keep,
        "torch": torch.from_numpy(keep),
    }[kind]
    m = lmdx.Moments(x.shape[-1], chunk_rows=7).update(x, mask=mask)
    assert_moments_match(m, x.reshape(-1, x.shape[-1])[keep.reshape(-1)], input_dtype=x.dtype)
    assert m.count == int(keep.sum())


@given(x=gaussian_batches(max_rows=60), seed=seeds, chunk=st.sampled_from([3, 7, 2048]))
def test_weights(x, seed, chunk):
    rng = np.random.default_rng(seed)
    w = rng.uniform(0.0, 3.0, x.shape[0])
    w[rng.random(x.shape[0]) < 0.2] = 0.0
    w[rng.random(x.shape[0]) < 0.2] = 1.0
    m = lmdx.Moments(x.shape[-1], chunk_rows=chunk).update(x, weights=w)
    assert_moments_match(m, x, w, input_dtype=x.dtype)


@given(x=gaussian_batches(max_rows=60), seed=seeds)
def test_mask_and_weights_multiply(x, seed):
    rng = np.random.default_rng(seed)
    mask = rng.random(x.shape[0]) < 0.5
    w = rng.uniform(0.0, 2.0, x.shape[0])
    m = lmdx.Moments(x.shape[-1], chunk_rows=4).update(x, mask=mask, weights=w)
    assert_moments_match(m, x, w * mask, input_dtype=x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_leading_dimensions_with_mask(rng, dtype):
    # (batch, heads, tokens, d) rows with a (batch, heads, tokens) mask.
    x = rng.standard_normal((2, 3, 5, 4)).astype(dtype)
    mask = rng.random((2, 3, 5)) < 0.5
    m = lmdx.Moments(4, chunk_rows=7).update(x, mask=torch.from_numpy(mask))
    assert_moments_match(m, x[mask], input_dtype=dtype)


def test_all_rows_masked_out(rng):
    x = rng.standard_normal((6, 3))
    m = lmdx.Moments(3).update(x, mask=np.zeros(6, dtype=bool))
    assert m.count == 0.0
    assert np.array_equal(m.gram(), np.zeros((3, 3)))
    with pytest.raises(ValueError, match="no rows have been added"):
        m.mean()


# --------------------------------------------------------------------------- combining


@given(x=gaussian_batches(max_rows=100), cuts=st.lists(st.integers(0, 100), max_size=4))
def test_merge_of_disjoint_shards_equals_one_pass(x, cuts):
    d = x.shape[-1]
    shards = np.split(x, sorted(c % (len(x) + 1) for c in cuts))
    total = lmdx.Moments(d, chunk_rows=6)
    for i, shard in enumerate(shards):
        part = lmdx.Moments(d, chunk_rows=6).update(shard)
        if i % 2:
            before = total
            total += part
            assert total is before
        else:
            assert total.merge(part) is total
    assert_moments_match(total, x, input_dtype=x.dtype)
    one_pass = lmdx.Moments(d, chunk_rows=6).update(x)
    assert total.count == one_pass.count
    if x.dtype == np.float64:
        _, _, _, s_scale, g_scale = reference(x)
        assert np.all(np.abs(total.sum - one_pass.sum) <= 2 * F64_RTOL * s_scale + 1e-300)
        assert np.all(np.abs(total.gram() - one_pass.gram()) <= 2 * F64_RTOL * g_scale + 1e-300)


def test_merge_adds_statistics_exactly(rng):
    # Merging adds count, sum and Gram element-wise, nothing else.
    a = lmdx.Moments(4).update(rng.standard_normal((9, 4)))
    b = lmdx.Moments(4).update(rng.standard_normal((5, 4)), weights=rng.uniform(0, 2, 5))
    expected = (a.count + b.count, a.sum + b.sum, a.gram() + b.gram())
    a.merge(b)
    assert a.count == expected[0]
    assert np.array_equal(a.sum, expected[1])
    assert np.array_equal(a.gram(), expected[2])


@given(x=gaussian_batches(max_rows=80), batch=st.integers(1, 5))
def test_many_small_updates_match_reference(x, batch):
    m = lmdx.Moments(x.shape[-1], chunk_rows=3)
    for start in range(0, len(x), batch):
        m.update(x[start : start + batch])
    assert_moments_match(m, x, input_dtype=x.dtype)


# --------------------------------------------------------------------------- threads


@given(
    x=gaussian_batches(max_rows=150),
    seed=seeds,
    chunk=st.integers(1, 9),
    use=st.sampled_from(["none", "mask", "weights", "both"]),
)
def test_one_and_two_threads_bit_identical(x, seed, chunk, use):
    rng = np.random.default_rng(seed)
    kwargs = {}
    if use in ("mask", "both"):
        kwargs["mask"] = rng.random(x.shape[0]) < 0.7
    if use in ("weights", "both"):
        kwargs["weights"] = rng.uniform(0.0, 2.0, x.shape[0])
    results = []
    for threads in (1, 2):
        m = lmdx.Moments(x.shape[-1], chunk_rows=chunk)
        m.update(x, n_threads=threads, **kwargs).update(x[: len(x) // 2], n_threads=threads)
        results.append(m)
    assert_same_state(*results)


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_and_two_threads_bit_identical_default_chunks(rng, dtype):
    x = rng.standard_normal((2 * lmdx.moments.DEFAULT_CHUNK_ROWS + 77, 24)).astype(dtype)
    mask = rng.random(len(x)) < 0.9
    one = lmdx.Moments(24).update(x, mask=mask, n_threads=1)
    two = lmdx.Moments(24).update(x, mask=mask, n_threads=2)
    assert_same_state(one, two)
    assert_moments_match(one, x[mask], input_dtype=dtype)


@pytest.mark.parametrize("d", [513, 700])
@pytest.mark.parametrize("weighted", [False, True])
def test_threads_share_one_block_by_tiles(rng, d, weighted):
    """One block of rows (one collection batch): the threads share its packing and its
    Gram tiles; bit-identical to one thread, and within the float32 bound of the float64
    reference."""
    x = rng.standard_normal((300, d)).astype(np.float32)
    x[:, :5] += 3.0  # a shifted block, as in real activations
    w = rng.integers(0, 2, 300).astype(np.float64) if weighted else None
    w = None if w is None else np.where(np.arange(300) % 7 == 0, 0.25, w)
    one = lmdx.Moments(d).update(x, weights=w, n_threads=1)
    for threads in (2, 3):
        many = lmdx.Moments(d).update(x, weights=w, n_threads=threads)
        assert np.array_equal(one.gram(), many.gram())
        assert np.array_equal(one.sum, many.sum) and one.count == many.count
    assert_moments_match(one, x, w, input_dtype=np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_column_panels_of_full_blocks(rng, dtype):
    """Full 512-row blocks split the Gram's columns into panels (256 KiB of packed rows:
    128 float32 or 64 float64 columns) that are not multiples of the register strips: the
    float64 reference, and the same bits for 1 and 2 threads."""
    d = 333
    x = (rng.standard_normal((2 * lmdx.moments.DEFAULT_CHUNK_ROWS + 41, d)) + 1.5).astype(dtype)
    one = lmdx.Moments(d).update(x, n_threads=1)
    two = lmdx.Moments(d).update(x, n_threads=2)
    assert_same_state(one, two)
    assert_moments_match(one, x, input_dtype=dtype)


@settings(max_examples=40, deadline=None)
@given(
    d=st.integers(1, 160),
    rows=st.integers(1, 300),
    chunk=st.sampled_from([1, 5, 63, 64, 65, 200, 512]),
    dtype=st.sampled_from(DTYPES),
    use=st.sampled_from(["none", "mask", "weights"]),
    seed=seeds,
)
def test_tiles_at_every_boundary(d, rows, chunk, dtype, use, seed):
    """Dimensions across several register tiles and strips (partial last strip, diagonal
    tiles), blocks longer and shorter than the 64-row float32 flush: the float64
    reference, and the same bits for 1, 2 and 3 threads."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((rows, d)) + rng.choice([0.0, 2.0], d)).astype(dtype)
    w = None
    if use == "mask":
        w = (rng.random(rows) < 0.6).astype(np.float64)
    elif use == "weights":
        w = np.where(rng.random(rows) < 0.2, 0.0, rng.uniform(0.0, 3.0, rows))
    states = [
        lmdx.Moments(d, chunk_rows=chunk).update(x, weights=w, n_threads=t) for t in (1, 2, 3)
    ]
    assert_same_state(states[0], states[1])
    assert_same_state(states[0], states[2])
    assert_moments_match(states[0], x, w, input_dtype=dtype)


def test_concurrent_python_threads(rng):
    # The GIL is released during updates: several Python threads update one shared
    # accumulator (serialized by its mutex) and their own accumulators (sharing the
    # scratch pool). Small integers make every sum exact, so results are compared exactly.
    d = 16
    batches = [
        rng.integers(-8, 9, (1500, d)).astype(np.float32 if i % 2 else np.float64) for i in range(6)
    ]
    shared = lmdx.Moments(d, chunk_rows=100)
    own = [lmdx.Moments(d, chunk_rows=100) for _ in batches]

    def work(i: int) -> None:
        shared.update(batches[i], n_threads=1)
        own[i].update(batches[i], n_threads=2)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(batches))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    everything = np.concatenate(batches).astype(np.float64)
    assert shared.count == len(everything)
    assert np.array_equal(shared.gram(), everything.T @ everything)
    assert np.array_equal(shared.sum, everything.sum(axis=0))
    for m, b in zip(own, batches, strict=False):
        b64 = b.astype(np.float64)
        assert np.array_equal(m.gram(), b64.T @ b64)


# --------------------------------------------------------------------------- state


@given(x=gaussian_batches(max_rows=50), seed=seeds, extra_rows=st.integers(0, 20))
def test_from_state_round_trip(x, seed, extra_rows):
    d = x.shape[-1]
    m = lmdx.Moments(d, chunk_rows=5).update(x)
    restored = lmdx.Moments.from_state(m.count, m.sum, m.gram(), chunk_rows=5)
    assert restored.chunk_rows == 5 and restored.dim == d
    assert_same_state(m, restored)
    more = np.random.default_rng(seed).standard_normal((extra_rows, d)).astype(x.dtype)
    m.update(more)
    restored.update(more)
    assert_same_state(m, restored)


def test_copy_is_independent(rng):
    m = lmdx.Moments(3).update(rng.standard_normal((4, 3)))
    c = m.copy()
    assert_same_state(m, c)
    state = (m.count, m.sum, m.gram())
    c.update(rng.standard_normal((2, 3)))
    assert c.count == 6.0
    assert m.count == state[0] and np.array_equal(m.sum, state[1])
    assert np.array_equal(m.gram(), state[2])


def test_returned_arrays_are_copies(rng):
    m = lmdx.Moments(3).update(rng.standard_normal((4, 3)))
    g, s = m.gram(), m.sum
    g[:] = 0.0
    s[:] = 0.0
    assert np.any(m.gram() != 0.0) and np.any(m.sum != 0.0)


@given(
    x=gaussian_batches(max_rows=60, dtypes=(np.float64,), min_rows=2), ddof=st.sampled_from([0, 1])
)
def test_mean_and_covariance_match_numpy(x, ddof):
    n = len(x)
    m = lmdx.Moments(x.shape[-1]).update(x)
    _, _, _, s_scale, g_scale = reference(x)
    assert np.all(np.abs(m.mean() - x.mean(axis=0)) <= 1e-12 * s_scale / n)
    ref = np.atleast_2d(np.cov(x, rowvar=False, ddof=ddof))
    # The one-pass formula (G - s sᵀ/n) cancels; its error scale is
    # (Σ|x||x|ᵀ + |s||s|ᵀ/n) / (n - ddof).
    scale = (g_scale + np.outer(s_scale, s_scale) / n) / (n - ddof)
    assert np.all(np.abs(m.covariance(ddof) - ref) <= 1e-11 * scale)


def test_weighted_covariance_matches_numpy(rng):
    x = rng.standard_normal((40, 5)) + 2.0
    w = rng.uniform(0.1, 3.0, 40)
    m = lmdx.Moments(5, chunk_rows=7).update(x, weights=w)
    np.testing.assert_allclose(m.mean(), np.average(x, axis=0, weights=w), rtol=1e-12)
    np.testing.assert_allclose(
        m.covariance(), np.cov(x, rowvar=False, aweights=w, ddof=0), rtol=1e-10, atol=1e-12
    )


# --------------------------------------------------------------------------- errors


def test_update_errors_name_the_argument():
    m = lmdx.Moments(4)
    with pytest.raises(ValueError, match=r"x: expected shape \(\.\.\., 4\), got \(2, 5\)"):
        m.update(np.ones((2, 5)))
    with pytest.raises(ValueError, match=r"x: contains NaN at row 1, column 2"):
        m.update(np.array([[1.0, 2, 3, 4], [1, 2, np.nan, 4]]))
    with pytest.raises(ValueError, match=r"x: contains Inf at row 0, column 0"):
        m.update(np.array([[np.inf, 2, 3, 4]], dtype=np.float32))
    with pytest.raises(ValueError, match=r"mask: expected 0/1 or boolean values"):
        m.update(np.ones((2, 4)), mask=np.array([0.5, 1.0]))
    with pytest.raises(ValueError, match=r"mask: expected shape \(2,\)"):
        m.update(np.ones((2, 4)), mask=np.array([1, 1, 1]))
    with pytest.raises(ValueError, match=r"weights: must be >= 0, got -1(\.0*)? at row 1"):
        m.update(np.ones((2, 4)), weights=np.array([1.0, -1.0]))
    with pytest.raises(ValueError, match=r"weights: contains NaN at index 1"):
        m.update(np.ones((2, 4)), weights=np.array([1.0, np.nan]))
    with pytest.raises(ValueError, match=r"n_threads: must be >= 1"):
        m.update(np.ones((2, 4)), n_threads=0)
    # Nothing was added by the failed calls.
    assert m.count == 0.0 and np.array_equal(m.gram(), np.zeros((4, 4)))


def test_constructor_and_state_errors():
    with pytest.raises(ValueError, match=r"dim: must be >= 1, got 0"):
        lmdx.Moments(0)
    with pytest.raises(ValueError, match=r"chunk_rows: must be >= 1, got 0"):
        lmdx.Moments(3, chunk_rows=0)
    with pytest.raises(ValueError, match=r"gram: expected shape \(3, 3\) to match sum"):
        lmdx.Moments.from_state(1.0, np.ones(3), np.ones((2, 2)))
    with pytest.raises(ValueError, match=r"count: must be finite and >= 0"):
        lmdx.Moments.from_state(-1.0, np.ones(3), np.eye(3))
    with pytest.raises(ValueError, match=r"gram: contains NaN"):
        lmdx.Moments.from_state(1.0, np.ones(2), np.array([[1.0, np.nan], [np.nan, 1.0]]))


def test_merge_errors():
    m = lmdx.Moments(4)
    with pytest.raises(ValueError, match=r"other: dimension 3 does not match .* 4"):
        m.merge(lmdx.Moments(3))
    with pytest.raises(ValueError, match=r"cannot merge an accumulator into itself"):
        m.merge(m)
    with pytest.raises(TypeError, match=r"other: expected lmdx.Moments, got ndarray"):
        m.merge(np.ones(4))


def test_mean_and_covariance_errors(rng):
    with pytest.raises(ValueError, match=r"no rows have been added"):
        lmdx.Moments(3).covariance()
    one_row = lmdx.Moments(3).update(rng.standard_normal((1, 3)))
    with pytest.raises(ValueError, match=r"covariance: need more than 1 rows"):
        one_row.covariance(ddof=1)
