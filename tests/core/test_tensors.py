"""Torch tensors and unusual arrays at the API boundary (lmdx/_tensors.py) and the raw
bindings' refusal of anything that is not a C-contiguous float32/float64 array."""

from __future__ import annotations

import lmdx
import numpy as np
import pytest
import scipy.linalg
import torch
from hypothesis import given
from hypothesis import strategies as st
from lmdx import _tensors as T
from lmdx._core import core

seeds = st.integers(0, 2**32 - 1)
TORCH_FLOATS = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


def as64(t) -> np.ndarray:
    """The float64 values a tensor/array holds (the widened reference input)."""
    if isinstance(t, torch.Tensor):
        return t.detach().to(torch.float64).numpy()
    return np.asarray(t, dtype=np.float64)


def gram_reference(x) -> np.ndarray:
    x = as64(x).reshape(-1, np.shape(x)[-1])
    return x.T @ x


def assert_gram_close(m: lmdx.Moments, x, *, exact_f64: bool) -> None:
    ref = gram_reference(x)
    x64 = as64(x).reshape(-1, np.shape(x)[-1])
    assert m.count == x64.shape[0]
    np.testing.assert_allclose(m.sum, x64.sum(axis=0), rtol=1e-12, atol=1e-12)
    if exact_f64:
        np.testing.assert_allclose(m.gram(), ref, rtol=1e-12, atol=1e-12 * np.abs(ref).max())
    else:  # float32 chunk products, DESIGN.md bound
        assert np.linalg.norm(m.gram() - ref) <= 1e-6 * np.linalg.norm(ref)


def snapshot(x):
    return x.detach().clone() if isinstance(x, torch.Tensor) else np.array(x, copy=True)


def unchanged(x, before) -> bool:
    if isinstance(x, torch.Tensor):
        return torch.equal(x, before) and x.dtype == before.dtype
    return np.array_equal(x, before) and x.dtype == before.dtype


# --------------------------------------------------------------------------- Moments


@given(
    dtype=st.sampled_from(TORCH_FLOATS),
    layout=st.sampled_from(["contiguous", "transposed", "sliced", "expanded"]),
    rows=st.integers(1, 40),
    d=st.integers(1, 8),
    seed=seeds,
    grad=st.booleans(),
)
def test_moments_torch_inputs(dtype, layout, rows, d, seed, grad):
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(rows, 2 * d, generator=gen, dtype=torch.float64).to(dtype)
    if layout == "contiguous":
        x = base[:, :d].contiguous()
    elif layout == "transposed":
        x = base[:, :d].t().contiguous().t()  # column-major view
    elif layout == "sliced":
        x = base[:, ::2]  # every other column
    else:
        x = base[:1, :d].expand(rows, d)  # stride 0 rows
    if grad and dtype.is_floating_point:
        x = x.detach().requires_grad_(True)
    before = snapshot(x)
    m = lmdx.Moments(d, chunk_rows=9).update(x)
    assert unchanged(x, before)
    if grad:
        assert x.grad is None
    assert_gram_close(m, x, exact_f64=dtype == torch.float64)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_moments_half_precision_values_are_widened_exactly(rng, dtype):
    # Multiples of 1/4 up to 8: every product and partial sum is exact in float32, so the
    # Gram of widened half-precision input must equal the float64 Gram bit for bit.
    x = torch.from_numpy(rng.integers(-32, 33, (40, 5)) / 4.0).to(dtype)
    m = lmdx.Moments(5, chunk_rows=16).update(x)
    np.testing.assert_array_equal(m.gram(), gram_reference(x))
    np.testing.assert_array_equal(m.sum, as64(x).sum(axis=0))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, "numpy float16"])
@pytest.mark.parametrize("use", ["none", "mask", "weights"])
def test_moments_16_bit_rows_need_no_widened_copy_and_match_it(rng, dtype, use, widen_bf16):
    # 16-bit rows go to the kernel as they are and are widened while packing: the result
    # must be bit-identical to updating with the float32 copy, at 1 and 2 threads, across
    # several register tiles and blocks. (bfloat16 rows on the bf16 dot-product kernel:
    # tests/core/test_gram_bf16.py.)
    x32 = (rng.standard_normal((700, 150)) * 3 + 1).astype(np.float32)
    if dtype == "numpy float16":
        x = x32.astype(np.float16)
        wide = x.astype(np.float32)
    else:
        x = torch.from_numpy(x32).to(dtype)
        wide = x.float().numpy()
    kwargs = {}
    if use == "mask":
        kwargs["mask"] = rng.random(700) < 0.6
    elif use == "weights":
        kwargs["weights"] = rng.uniform(0.0, 2.0, 700)
    for threads in (1, 2):
        narrow = lmdx.Moments(150, chunk_rows=256).update(x, n_threads=threads, **kwargs)
        widened = lmdx.Moments(150, chunk_rows=256).update(wide, n_threads=threads, **kwargs)
        assert np.array_equal(narrow.gram(), widened.gram())
        assert np.array_equal(narrow.sum, widened.sum) and narrow.count == widened.count


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_moments_16_bit_non_finite_names_row_and_column(dtype, bad):
    x = torch.ones(6, 4, dtype=dtype)
    x[3, 2] = bad
    with pytest.raises(ValueError, match=r"x: contains (NaN|Inf) at row 3, column 2"):
        lmdx.Moments(4).update(x)


@pytest.mark.parametrize("dtype", [np.float16, np.int8, np.int32, np.int64, np.uint8, np.bool_])
def test_moments_numpy_narrow_and_integer_arrays(rng, dtype):
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        x = rng.integers(max(info.min, -100), min(info.max, 100), (25, 4), endpoint=True).astype(
            dtype
        )
    else:
        x = (rng.standard_normal((25, 4)) * 5).astype(dtype)
    before = x.copy()
    m = lmdx.Moments(4, chunk_rows=6).update(x)
    assert np.array_equal(x, before) and x.dtype == before.dtype
    # Integers become float64; float16 becomes float32 (float32 chunk bound).
    assert_gram_close(m, x, exact_f64=dtype != np.float16)


def test_moments_mask_and_weights_as_tensors(rng):
    x = torch.from_numpy(rng.standard_normal((2, 6, 3)))
    mask = torch.from_numpy(rng.random((2, 6)) < 0.5)
    w = torch.from_numpy(rng.uniform(0, 2, (2, 6))).requires_grad_(True)
    mask0, w0 = mask.clone(), w.detach().clone()
    m = lmdx.Moments(3).update(x, mask=mask.t().contiguous().t(), weights=w)
    assert torch.equal(mask, mask0) and torch.equal(w.detach(), w0)
    keep = (mask.numpy() * w.detach().numpy()).reshape(-1)
    x64 = x.numpy().reshape(-1, 3)
    np.testing.assert_allclose(m.gram(), (x64 * keep[:, None]).T @ x64, rtol=1e-12, atol=1e-14)
    assert m.count == pytest.approx(keep.sum(), rel=1e-14)


def test_fortran_ordered_numpy_rows(rng):
    x = np.asfortranarray(rng.standard_normal((30, 5)))
    m = lmdx.Moments(5).update(x)
    assert_gram_close(m, x, exact_f64=True)


def test_complex_tensors_are_rejected():
    with pytest.raises(ValueError, match=r"^x: complex tensors are not supported"):
        lmdx.Moments(2).update(torch.ones(3, 2, dtype=torch.complex64))
    with pytest.raises(
        ValueError, match=r"^tensors\[0\]: expected numbers, got an array of dtype complex128"
    ):
        lmdx.weighted_average([np.ones(3, dtype=complex)])


# --------------------------------------------------------------------------- spd_solve / regmean


@pytest.mark.parametrize("dtype", TORCH_FLOATS)
def test_spd_solve_torch_inputs(rng, dtype):
    x = rng.standard_normal((20, 6))
    a = torch.from_numpy(x.T @ x / 20).to(dtype)
    b = torch.from_numpy(rng.standard_normal((3, 6))).to(dtype).t()  # non-contiguous (6, 3)
    a.requires_grad_(True)
    a0, b0 = snapshot(a), snapshot(b)
    res = lmdx.spd_solve(a.t(), b)  # a.t(): a transposed (symmetric) view
    assert unchanged(a, a0) and unchanged(b, b0)
    ref = scipy.linalg.solve(as64(a), as64(b))
    np.testing.assert_allclose(res.x, ref, rtol=1e-10, atol=1e-12)
    assert isinstance(res.x, np.ndarray) and res.x.dtype == np.float64


@pytest.mark.parametrize("dtype", TORCH_FLOATS)
def test_regmean_torch_weights_and_grams(rng, dtype):
    d_in, d_out = 6, 5
    xs = [rng.standard_normal((30, d_in)) for _ in range(2)]
    grams = [torch.from_numpy(x.T @ x) for x in xs]
    # nn.Linear weights with requires_grad, one of them a non-contiguous view.
    w0 = torch.from_numpy(rng.standard_normal((d_out, d_in))).to(dtype).requires_grad_(True)
    w1_store = torch.from_numpy(rng.standard_normal((d_in, d_out))).to(dtype)
    w1 = w1_store.t()
    before = [snapshot(w0), snapshot(w1), *[snapshot(g) for g in grams]]
    res = lmdx.regmean_merge_layer(grams, [w0, w1], [30, 30], alpha=0.9)
    assert all(unchanged(t, b) for t, b in zip([w0, w1, *grams], before, strict=False))
    lhs, rhs = 0.0, 0.0
    for g, w in zip(grams, [w0, w1], strict=False):
        gt = 0.9 * as64(g) / 30 + 0.1 * np.diag(np.diag(as64(g) / 30))
        lhs = lhs + gt
        rhs = rhs + gt @ as64(w).T
    ref = scipy.linalg.solve(lhs, rhs, assume_a="pos").T
    np.testing.assert_allclose(res.weight, ref, rtol=1e-9, atol=1e-10)
    # Hugging Face Conv1D stores [in, out]: pass the transposed views.
    conv = lmdx.regmean_merge_layer(grams, [w0.t(), w1_store], [30, 30], alpha=0.9, layout="conv1d")
    np.testing.assert_allclose(conv.weight, ref.T, rtol=1e-9, atol=1e-10)


def test_regmean_integer_counts_and_lists(rng):
    x = rng.standard_normal((12, 3))
    g = (x.T @ x).tolist()  # nested lists
    w = rng.integers(-5, 5, (2, 3))  # integer weights become float64
    res = lmdx.regmean_merge_layer([g, g], [w, w], np.array([12, 12]))
    np.testing.assert_allclose(res.weight, w.astype(np.float64), rtol=1e-12, atol=1e-12)


# --------------------------------------------------------------------------- averages


@pytest.mark.parametrize("dtype", TORCH_FLOATS)
def test_averages_of_torch_tensors(rng, dtype):
    base = [torch.from_numpy(rng.standard_normal((7, 4))).to(dtype) for _ in range(3)]
    tensors = [base[0].requires_grad_(True), base[1].t().contiguous().t(), base[2][:, ::1]]
    fishers = [torch.from_numpy(rng.exponential(1.0, (4, 7))).to(dtype).t() for _ in range(3)]
    before = [snapshot(t) for t in tensors + fishers]
    got = lmdx.weighted_average(tensors, [1.0, 2.0, 0.5])
    fisher = lmdx.fisher_average(tensors, fishers, eps=1e-3)
    assert all(unchanged(t, b) for t, b in zip(tensors + fishers, before, strict=False))
    p = np.array([as64(t) for t in tensors])
    c = np.array([1.0, 2.0, 0.5])[:, None, None]
    np.testing.assert_allclose(got, (c * p).sum(0) / c.sum(), rtol=1e-14, atol=1e-15)
    f = np.array([as64(t) for t in fishers]) + 1e-3
    np.testing.assert_allclose(fisher, (f * p).sum(0) / f.sum(0), rtol=1e-13, atol=1e-15)
    assert got.shape == fisher.shape == (7, 4)


def test_averages_of_mixed_numpy_dtypes(rng):
    xs = [
        rng.standard_normal(9).astype(np.float16),
        rng.integers(-3, 3, 9),
        rng.standard_normal(9).astype(np.float32)[::-1],  # negative stride
        rng.standard_normal(18)[::2],  # strided
    ]
    before = [x.copy() for x in xs]
    got = lmdx.weighted_average(xs)
    assert all(np.array_equal(a, b) for a, b in zip(xs, before, strict=False))
    np.testing.assert_allclose(got, np.mean([as64(x) for x in xs], axis=0), rtol=1e-14, atol=1e-15)


# --------------------------------------------------------------------------- raw bindings


def raw_update(m, x, weights=None, bfloat16=False):
    m.update(x=x, weights=weights, n_threads=1, bfloat16=bfloat16)


def raw_spd_solve(a, b):
    return core.spd_solve(
        a=a, b=b, alpha=1.0, ridge=0.0, allow_regularization=True, name="s", n_threads=1
    )


def raw_regmean(grams, weights):
    return core.regmean_merge_layer(
        grams=grams,
        weights=weights,
        counts=[1.0] * len(grams),
        alpha=1.0,
        coefficients=None,
        layout="linear",
        precision="float64",
        noise_floor=0.0,
        ridge=0.0,
        allow_regularization=True,
        name="blk.1",
        n_threads=1,
    )


def test_raw_moments_rejects_non_contiguous_and_wrong_dtype(rng):
    x = rng.standard_normal((5, 3))
    m = core.Moments(dim=3, chunk_rows=7)
    with pytest.raises(
        ValueError, match=r"^x: expected a C-contiguous float32 or float64 array.*not C-contiguous"
    ):
        raw_update(m, np.asfortranarray(x))
    with pytest.raises(
        ValueError, match=r"^x: expected a C-contiguous float32 or float64 array.*int64"
    ):
        raw_update(m, x.astype(np.int64))
    with pytest.raises(ValueError, match=r"^x: expected .*float64.*uint16"):
        raw_update(m, x.astype(np.uint16))
    with pytest.raises(ValueError, match=r"^x: bfloat16 rows are passed as a uint16 view"):
        raw_update(m, x, bfloat16=True)
    with pytest.raises(ValueError, match=r"^x: expected a C-contiguous 2-d array"):
        raw_update(m, np.asfortranarray(x.astype(np.float16)))
    with pytest.raises(ValueError, match=r"^x: expected .*2 dimension"):
        raw_update(m, x.reshape(5, 3, 1))
    with pytest.raises(ValueError, match=r"^weights: expected a float64 array, got a float32"):
        raw_update(m, x, np.ones(5, np.float32))
    with pytest.raises(ValueError, match=r"^weights: expected 5 values \(one per row of x\)"):
        raw_update(m, x, np.ones(4))
    with pytest.raises(ValueError, match=r"^sum: expected a float64 array"):
        core.Moments.from_state(count=1.0, sum=np.ones(3, np.float32), gram=np.eye(3), chunk_rows=7)
    with pytest.raises(ValueError, match=r"^gram: expected a C-contiguous .*not C-contiguous"):
        core.Moments.from_state(
            count=1.0, sum=np.ones(3), gram=np.asfortranarray(np.ones((3, 3))), chunk_rows=7
        )
    assert m.count == 0.0 and not np.any(m.gram())


def test_raw_spd_solve_rejects_non_contiguous_and_wrong_dtype():
    a = np.eye(3)
    with pytest.raises(ValueError, match=r"^a: expected a float64 array, got a float32"):
        raw_spd_solve(a.astype(np.float32), np.ones(3))
    with pytest.raises(ValueError, match=r"^b: expected a C-contiguous .*not C-contiguous"):
        raw_spd_solve(a, np.ones((3, 4))[:, ::2])
    with pytest.raises(ValueError, match=r"^a: expected a C-contiguous .*not C-contiguous"):
        raw_spd_solve(np.asfortranarray(np.ones((3, 3)) + np.eye(3)), np.ones(3))


def test_raw_regmean_rejects_non_contiguous_and_wrong_dtype():
    g = np.eye(3)
    w = np.ones((2, 3))
    with pytest.raises(
        ValueError, match=r"^blk\.1: weights\[1\]: expected a C-contiguous .*not C-contiguous"
    ):
        raw_regmean([g, g], [w, np.asfortranarray(np.ones((2, 3)))])
    with pytest.raises(
        ValueError,
        match=r"^blk\.1: weights\[0\]: expected a C-contiguous float32 or float64.*int64",
    ):
        raw_regmean([g, g], [w.astype(np.int64), w])
    with pytest.raises(
        ValueError, match=r"^blk\.1: grams\[1\]: expected a float64 array, got a float32"
    ):
        raw_regmean([g, g.astype(np.float32)], [w, w])


def test_raw_averages_reject_non_contiguous_and_wrong_dtype():
    x = np.ones((3, 4))
    with pytest.raises(
        ValueError, match=r"^tensors\[1\]: expected a C-contiguous .*not C-contiguous"
    ):
        core.weighted_average(tensors=[x, np.asfortranarray(x)], coefficients=None, n_threads=1)
    with pytest.raises(
        ValueError, match=r"^tensors\[0\]: expected a C-contiguous float32 or float64.*int32"
    ):
        core.weighted_average(tensors=[x.astype(np.int32)], coefficients=None, n_threads=1)
    with pytest.raises(ValueError, match=r"^fishers\[0\]: expected a C-contiguous .*float16"):
        core.fisher_average(
            params=[x], fishers=[x.astype(np.float16)], coefficients=None, eps=0.0, n_threads=1
        )
    with pytest.raises(
        ValueError, match=r"^params\[0\]: expected a C-contiguous .*not C-contiguous"
    ):
        core.fisher_average(
            params=[x.T], fishers=[x.T.copy()], coefficients=None, eps=0.0, n_threads=1
        )


# --------------------------------------------------------------------------- dtypes without torch

NARROW = ["float32", "float16", "bfloat16"]


def _values(seed: int, n: int) -> np.ndarray:
    """float64 values across the 16-bit types' ranges, with exact ties and the edges."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(n) * np.exp(rng.uniform(-30, 30, n))
    normal16 = (rng.standard_normal(n) * 100).astype(np.float32).view(np.uint32)
    # halfway between neighbouring bfloat16 / float16 values (round-to-even ties) ...
    ties = np.concatenate(
        [
            (x.astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)) | np.uint32(0x8000),
            (normal16 & np.uint32(0xFFFFE000)) | np.uint32(0x1000),
        ]
    )
    ties64 = ties.view(np.float32).astype(np.float64)
    edges = [0.0, -0.0, 65504.0, 65520.0, 3.3895313892515355e38, 3.4e38, 1e-45, 6e-8]
    # ... and values a float64 -> float32 rounding moves onto such a tie (torch rounds
    # through float32: a direct float64 -> 16-bit rounding differs there)
    return np.concatenate([x, ties64, ties64 * (1 + 2.0**-40), edges, [np.inf, -np.inf]])


@given(seed=seeds, n=st.integers(1, 300), dtype=st.sampled_from(NARROW))
def test_cast_float_rounds_like_torch(seed, n, dtype):
    """float64 -> float32/float16/bfloat16 bit for bit as torch's Tensor.to (which rounds
    through float32), overflow to infinity included."""
    x = _values(seed, n)
    got = T.cast_float(x, dtype)
    ref = torch.from_numpy(x).to(getattr(torch, dtype))
    assert T.dtype_name(got) == dtype
    assert np.array_equal(T.as_numpy(ref).view(got.dtype), got, equal_nan=True)
    assert torch.equal(T.to_torch(got), ref)


@given(seed=seeds, n=st.integers(1, 300), src=st.sampled_from(NARROW), dst=st.sampled_from(NARROW))
def test_cast_float_between_narrow_types_like_torch(seed, n, src, dst):
    x = torch.from_numpy(_values(seed, n)).to(getattr(torch, src))
    got = T.cast_float(T.as_numpy(x), dst)
    assert torch.equal(T.to_torch(got), x.to(getattr(torch, dst)))


@pytest.mark.parametrize("dtype", [*TORCH_FLOATS, torch.int64, torch.bool, torch.uint8])
def test_numpy_torch_round_trip_keeps_dtype_and_bits(rng, dtype):
    t = torch.from_numpy(rng.standard_normal((3, 5)) * 100).to(dtype)
    arr = T.as_numpy(t)
    assert T.dtype_name(arr) == T.dtype_name(t)
    back = T.to_torch(arr)
    assert back.dtype == t.dtype and torch.equal(back, t)
    frozen = arr.copy()
    frozen.flags.writeable = False  # as from Ray's object store: copied, not refused
    assert torch.equal(T.to_torch(frozen), t)


def test_bfloat16_arrays_reach_the_kernels_widened_exactly(rng):
    t = torch.from_numpy(rng.standard_normal((4, 6))).to(torch.bfloat16)
    arr = T.as_numpy(t)
    assert arr.dtype == T.bfloat16_dtype() and T.is_bfloat16(arr.dtype)
    widened = T.as_tensor_array(arr, "x")
    assert widened.dtype == np.float32 and np.array_equal(widened, t.float().numpy())
    m_np, m_torch = lmdx.Moments(6), lmdx.Moments(6)
    m_np.update(arr)
    m_torch.update(t)
    assert np.array_equal(m_np.gram(), m_torch.gram())
    avg = lmdx.weighted_average([arr, arr * 2])  # NumPy bfloat16 arithmetic
    np.testing.assert_allclose(avg, 1.5 * t.double().numpy(), rtol=1e-2)
