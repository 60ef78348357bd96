"""The merge's pooled matrices (core/workspace.hpp, PooledMatrix): a layer's merge gives the
same bits whether the pool is empty or holds another layer's values, and
lmdx.release_memory() gives the memory back."""

from __future__ import annotations

import lmdx
import numpy as np
import pytest
from lmdx._core import core

K, D, N = 3, 1024, 3000  # every system matrix 8 MB, over the 4 MB the pool starts at


def layer(seed: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """K Grams of correlated inputs and K float32 weights 2 % apart (D x D)."""
    rng = np.random.default_rng(seed)
    mix = np.eye(D) + 0.05 * rng.standard_normal((D, D))
    grams = []
    for _ in range(K):
        x = rng.standard_normal((N, D)) @ mix
        grams.append(x.T @ x)
    w0 = rng.standard_normal((D, D))
    weights = [(w0 + 0.02 * rng.standard_normal((D, D))).astype(np.float32) for _ in range(K)]
    return grams, weights


@pytest.mark.parametrize("precision", ["auto", "float32", "float32-rhs", "float64"])
def test_a_merge_does_not_depend_on_what_the_pool_holds(precision):
    """A layer merged with the pool empty, and again after a merge of other values of the
    same shapes left its matrices there (so the second merge works in memory holding them):
    the same bits and the same report; then lmdx.release_memory() empties the pool."""
    grams, weights = layer(1)
    other_grams, other_weights = layer(2)

    def merge(g, w):
        return lmdx.regmean_merge_layer(
            g, w, [float(N)] * K, alpha=0.9, precision=precision, n_threads=2
        )

    lmdx.release_memory()
    assert core.scratch_bytes() == 0
    cold = merge(grams, weights)
    assert core.scratch_bytes() >= 4 * D * D  # the layer's matrices, kept for the next
    merge(other_grams, other_weights)
    warm = merge(grams, weights)
    assert np.array_equal(cold.weight, warm.weight)
    assert cold.info.precision == warm.info.precision
    assert cold.info.output_error_estimate == warm.info.output_error_estimate
    if precision != "auto":
        assert cold.info.precision == precision
    lmdx.release_memory()
    assert core.scratch_bytes() == 0


def test_a_merge_gives_the_pooled_matrices_back_when_it_ends():
    """lmdx.merge_models on models with a 1024-input layer: a layer merged alone leaves its
    matrices in the pool; the whole merge, which solves the same layer, leaves it empty."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)

    def model():
        return torch.nn.Sequential(
            torch.nn.Linear(D, D), torch.nn.Tanh(), torch.nn.Linear(D, 8)
        ).requires_grad_(False)

    base, models = model(), []
    for _ in range(K):
        m = model()
        m.load_state_dict(base.state_dict())
        for p in m.parameters():
            p.add_(0.02 * p.std() * torch.randn_like(p))
        models.append(m)
    mix = torch.eye(D) + 0.05 * torch.randn(D, D)
    stats = [
        lmdx.collect_regmean_stats(m, [{"input": torch.randn(N, D) @ mix}], progress=False)
        for m in models
    ]
    lmdx.release_memory()
    weights = [m[0].weight.numpy() for m in models]
    lmdx.regmean_merge_layer(
        [s.gram("0") for s in stats], weights, [s.count("0") for s in stats], alpha=0.9
    )
    assert core.scratch_bytes() >= 4 * D * D
    result = lmdx.merge_models(models, stats=stats, alpha=0.9, progress=False)
    assert result.report["layers"]["0"]["precision"] == "float32"
    assert core.scratch_bytes() == 0
