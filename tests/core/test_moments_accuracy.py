"""The float32 path's accuracy bound at the scale the design promises (N = 10^6 rows),
and the bf16 dot-product kernel's.

float32 rows are multiplied in float32, each product summed over at most 64 rows and then
added into float64; the Gram must stay within 1e-6 (relative, Frobenius) of a float64
accumulation of the same float32 values, also for data with a large common offset
(all-positive activations), where float32 sums lose the most.
"""

from __future__ import annotations

import lmdx
import lmdx._core as dispatch
import numpy as np
import pytest
import torch

N_ROWS = 1_000_000
DIM = 24


@pytest.mark.parametrize("offset", [0.0, 4.0])
def test_float32_gram_within_1e6_of_float64_at_one_million_rows(offset: float) -> None:
    rng = np.random.default_rng(2024)
    x = rng.standard_normal((N_ROWS, DIM), dtype=np.float32) + np.float32(offset)
    acc = lmdx.Moments(DIM)
    for block in np.array_split(x, 7):  # several updates, several chunks each
        acc.update(block)

    x64 = x.astype(np.float64)
    reference = x64.T @ x64
    rel = np.linalg.norm(acc.gram() - reference) / np.linalg.norm(reference)
    assert rel <= 1e-6, rel
    np.testing.assert_allclose(acc.sum, x64.sum(axis=0), rtol=1e-12, atol=1e-9)
    assert acc.count == N_ROWS


@pytest.mark.skipif(not dispatch.bf16_dot(), reason="this CPU has no AVX512_BF16")
@pytest.mark.parametrize("offset", [0.0, 4.0])
def test_bf16_dot_gram_within_1e6_of_float64_at_one_million_rows(offset: float) -> None:
    # The bf16 dot-product kernel: exact products, float32 sums of 64 rows added up in
    # float32 over a block of 512 rows, blocks added in float64.
    rng = np.random.default_rng(2025)
    x = torch.from_numpy(rng.standard_normal((N_ROWS, DIM)) + offset).to(torch.bfloat16)
    acc = lmdx.Moments(DIM)
    for block in torch.tensor_split(x, 7):
        acc.update(block)

    x64 = x.double().numpy()
    reference = x64.T @ x64
    rel = np.linalg.norm(acc.gram() - reference) / np.linalg.norm(reference)
    assert rel <= 1e-6, rel
    np.testing.assert_allclose(acc.sum, x64.sum(axis=0), rtol=1e-12, atol=1e-9)


def test_default_chunk_rows_is_what_the_bound_was_tested_with() -> None:
    assert lmdx.Moments(3).chunk_rows == lmdx.moments.DEFAULT_CHUNK_ROWS
