"""Moments per split (lmdx.lmd.SplitMoments) against NumPy means and covariances."""

from __future__ import annotations

import subprocess
import sys

import lmdx
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from lmd_reference import SPLITS, decomposition, latent_data, three_splits

seeds = st.integers(0, 2**32 - 1)


@given(batches=st.integers(2, 12), seed=seeds, f32=st.booleans())
def test_streaming_equals_one_batch(batches, seed, f32):
    rng = np.random.default_rng(seed)
    data = three_splits(rng, [120, 40, 40], [3, 2, 2], mean_shift=5.0)
    if f32:
        data = {s: [a.astype(np.float32) for a in v] for s, v in data.items()}
    names = ["a", "b", "c"]
    one = decomposition(names, data)
    many = decomposition(names, data, batches=batches, rng=rng)
    tol = 1e-5 if f32 else 1e-11
    for s in SPLITS:
        assert many.splits[s].count == one.splits[s].count
        np.testing.assert_allclose(many.splits[s].mean(), one.splits[s].mean(), rtol=tol)
        c1 = one.splits[s].covariance()
        np.testing.assert_allclose(many.splits[s].covariance(), c1, atol=tol * np.abs(c1).max())
    r_one, r_many = one.fit(ridge=1e-3), many.fit(ridge=1e-3)
    for s in SPLITS:
        np.testing.assert_allclose(
            r_many.r2_target_by_basis(s), r_one.r2_target_by_basis(s), atol=tol * 10
        )


def test_split_moments_merge_and_reference_moments(rng):
    x = latent_data(rng, 90, [3, 2], mean_shift=50.0)
    whole = lmdx.lmd.SplitMoments(["a", "b"], [3, 2]).add(x)
    left = lmdx.lmd.SplitMoments(["a", "b"], [3, 2]).add([a[:40] for a in x])
    right = lmdx.lmd.SplitMoments(["a", "b"], [3, 2]).add([a[40:] for a in x])
    assert not np.allclose(left.shift, right.shift)
    left.merge(right)
    joined = np.concatenate(x, axis=1)
    for m in (whole, left):
        assert m.count == 90
        np.testing.assert_allclose(m.mean(), joined.mean(0), rtol=1e-12)
        np.testing.assert_allclose(m.covariance(), np.cov(joined.T, bias=True), rtol=1e-10)
        np.testing.assert_allclose(m.covariance(1), np.cov(joined.T), rtol=1e-10)
    assert whole.offsets == (0, 3) and whole.layout.block("b") == slice(3, 5)


def test_float32_with_large_mean_keeps_covariance_accurate(rng):
    """Without the per-split shift the float32 Gram would cancel: mean 1e3, spread 1."""
    x = (rng.standard_normal((5000, 6)) + 1e3).astype(np.float32)
    m = lmdx.lmd.SplitMoments(["a", "b"], [4, 2])
    for lo in range(0, 5000, 1000):
        m.add([x[lo : lo + 1000, :4], x[lo : lo + 1000, 4:]])
    ref = np.cov(x.astype(np.float64).T, bias=True)
    np.testing.assert_allclose(m.covariance(), ref, atol=1e-5 * np.abs(ref).max())
    np.testing.assert_allclose(m.mean(), x.astype(np.float64).mean(0), rtol=0, atol=1e-6)


def test_torch_and_mapping_inputs(rng):
    x = latent_data(rng, 50, [3, 2])
    ref = lmdx.lmd.SplitMoments(["a", "b"], [3, 2]).add(x)
    t = torch.tensor(x[0], requires_grad=True)
    via_torch = lmdx.lmd.SplitMoments(["a", "b"], [3, 2]).add({"b": x[1], "a": t})
    np.testing.assert_allclose(via_torch.covariance(), ref.covariance(), rtol=1e-12)


# Measured in a fresh interpreter: in the test process, memory freed by earlier tests (or a
# garbage collection during the call) can hide or fake a 128 MB allocation in VmRSS.
_ALLOCATION_PROBE = """
import numpy as np
import lmdx

def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))

dims = [2000, 2000]
before = rss()
m = lmdx.lmd.SplitMoments(["a", "b"], dims, split="validation")
empty = rss() - before
no_shift = m.count == 0 and m.shift is None
try:
    m.mean()
except ValueError as e:
    message = str(e)
m.add([np.random.default_rng(0).standard_normal((3, d)) for d in dims])
print(empty, rss() - before, m.count, no_shift, message, sep="\\n")
"""


def test_a_split_allocates_its_d_by_d_accumulator_only_when_it_gets_rows():
    """A Decomposition has three splits; one without rows must not hold 8·D² bytes (at
    D = 9,216 that was 0.63 GiB per empty split)."""
    size = 8 * 4000**2  # 8·D² = 128 MB
    out = subprocess.run(
        [sys.executable, "-c", _ALLOCATION_PROBE], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    empty, filled, count, no_shift, message = out
    assert int(empty) < size / 4 and no_shift == "True"
    assert "split 'validation': has 0 rows" in message
    assert int(filled) > size / 2 and count == "3"
    with pytest.raises(ValueError, match="chunk_rows"):
        lmdx.lmd.SplitMoments(["a"], [3], chunk_rows=0)
