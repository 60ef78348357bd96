"""bfloat16 rows on both Gram kernels: the bf16 dot product (AVX512_BF16) and widening.

A product of two bfloat16 values is exact in float32, so the dot-product kernel owes the
same bound as the float32 path: within 1e-6 (relative, Frobenius) of a float64 Gram of
the same bfloat16 values, computed here with NumPy. Sums and counts do not depend on the
kernel (float64 from the exact values). Each test runs on every path this CPU has; the
dot-product cases are skipped, saying so, on a CPU without AVX512_BF16.
"""

from __future__ import annotations

import lmdx
import lmdx._core as dispatch
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

F32_GRAM_RTOL = 1e-6  # DESIGN.md: the float32 path's bound, owed by the bf16 kernel too

needs_dot = pytest.mark.skipif(
    not dispatch.core.bf16_dot_available(), reason="this CPU has no AVX512_BF16"
)


@pytest.fixture(params=["dot", "widen"])
def path(request):
    """Each test once per bfloat16 Gram path (the dot-product kernel where the CPU has it)."""
    if request.param == "dot":
        if not dispatch.core.bf16_dot_available():
            pytest.skip("this CPU has no AVX512_BF16: the bf16 dot-product kernel cannot run")
        assert dispatch.bf16_dot(), "the dot-product kernel is available but not chosen"
    else:
        request.getfixturevalue("widen_bf16")
        assert not dispatch.bf16_dot()
    return request.param


def bf16_rows(rng, rows: int, d: int, shift: float = 0.0, scale: float = 1.0) -> torch.Tensor:
    return torch.from_numpy(shift + scale * rng.standard_normal((rows, d))).to(torch.bfloat16)


def reference(x: torch.Tensor, w: np.ndarray | None = None):
    """float64 count, sum and Gram of the bfloat16 values of x (rows, d)."""
    x64 = x.double().numpy()
    w = np.ones(x64.shape[0]) if w is None else w
    return float(w.sum()), x64.T @ w, (x64 * w[:, None]).T @ x64


def rel_error(gram: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(gram - ref) / max(np.linalg.norm(ref), 1e-300))


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # path: one per test
@given(
    rows=st.integers(0, 1300),
    d=st.integers(1, 130),
    chunk=st.sampled_from([1, 7, 64, 333, 512, 600]),
    masked=st.booleans(),
    threads=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**32 - 1),
    shift=st.sampled_from([0.0, 0.5, 4.0, -20.0]),
    scale=st.sampled_from([1e-3, 1.0, 50.0]),
)
def test_bf16_gram_within_the_float32_bound_of_a_float64_reference(
    path, rows, d, chunk, masked, threads, seed, shift, scale
):
    # Rows not a multiple of the block, odd kept rows (a half-filled pair), features across
    # register tiles and strips, padding left out by a mask.
    rng = np.random.default_rng(seed)
    x = bf16_rows(rng, rows, d, shift, scale)
    mask = (rng.random(rows) < 0.7) if masked else None
    w = None if mask is None else mask.astype(np.float64)
    m = lmdx.Moments(d, chunk_rows=chunk).update(x, mask=mask, n_threads=threads)
    n, s, g = reference(x, w)
    assert m.count == n
    np.testing.assert_allclose(m.sum, s, rtol=1e-12, atol=1e-300)
    assert rel_error(m.gram(), g) <= F32_GRAM_RTOL
    assert np.array_equal(m.gram(), m.gram().T)


@needs_dot
@pytest.mark.parametrize("d", [5, 48, 49, 150])
def test_dot_and_widen_agree_and_only_the_gram_arithmetic_differs(rng, widen_bf16, d):
    x = bf16_rows(rng, 1001, d, shift=1.0, scale=3.0)
    mask = rng.random(1001) < 0.6
    raw = x.view(torch.int16).numpy().view(np.uint16)
    dot = dispatch.core.Moments(dim=d, chunk_rows=512)
    wide = dispatch.core.Moments(dim=d, chunk_rows=512)
    w = mask.astype(np.float64)
    dot.update(x=raw, weights=w, n_threads=2, bfloat16=True, bf16_dot=True)
    wide.update(x=raw, weights=w, n_threads=2, bfloat16=True, bf16_dot=False)
    assert dot.count == wide.count and np.array_equal(dot.sum, wide.sum)
    _, _, g = reference(x, w)
    assert rel_error(dot.gram(), g) <= F32_GRAM_RTOL
    assert rel_error(wide.gram(), g) <= F32_GRAM_RTOL
    assert not np.array_equal(dot.gram(), wide.gram())  # two kernels really ran


@needs_dot
def test_dot_kernel_is_independent_of_the_thread_count(rng):
    x = bf16_rows(rng, 2049, 200, shift=0.5)
    mask = rng.random(2049) < 0.8
    one = lmdx.Moments(200).update(x, mask=mask, n_threads=1)
    two = lmdx.Moments(200).update(x, mask=mask, n_threads=2)
    assert np.array_equal(one.gram(), two.gram()) and np.array_equal(one.sum, two.sum)


@needs_dot
def test_rows_weighted_other_than_0_or_1_take_the_widening_kernel(rng, widen_bf16):
    # sqrt(w) would round in bfloat16: such rows are widened, bit for bit as without the
    # dot-product kernel.
    x = bf16_rows(rng, 300, 40)
    raw = x.view(torch.int16).numpy().view(np.uint16)
    w = rng.uniform(0.0, 2.0, 300)
    out = []
    for dot in (True, False):
        m = dispatch.core.Moments(dim=40, chunk_rows=512)
        m.update(x=raw, weights=w, n_threads=1, bfloat16=True, bf16_dot=dot)
        out.append(m.gram())
    assert np.array_equal(out[0], out[1])


def test_the_dot_kernel_takes_bfloat16_rows_on_a_core_that_has_it(rng):
    x = rng.standard_normal((4, 3)).astype(np.float32)
    core = dispatch.core.Moments(dim=3, chunk_rows=512)
    with pytest.raises(ValueError, match=r"^bf16_dot: the bf16 dot-product kernel takes bfloat16"):
        core.update(x=x, weights=None, n_threads=1, bfloat16=False, bf16_dot=True)
    raw = torch.ones(4, 3, dtype=torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    baseline = dispatch.load("baseline").Moments(dim=3, chunk_rows=512)
    with pytest.raises(ValueError, match=r"^bf16_dot: this core has no bf16 dot-product kernel"):
        baseline.update(x=raw, weights=None, n_threads=1, bfloat16=True, bf16_dot=True)
    assert baseline.count == 0.0  # nothing was added


def test_gram_paths_name_the_kernel_per_dtype(path):
    paths = lmdx.config()["gram_paths"]
    assert set(paths) == {"float32", "float64", "bfloat16", "float16"}
    expected = "avx512bf16 dot product" if path == "dot" else "widened to float32"
    assert paths["bfloat16"] == expected
    assert paths["float16"] == "widened to float32"
