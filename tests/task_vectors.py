"""Float64 NumPy references of the task-vector merges (task arithmetic, TIES, DARE,
DARE-TIES) of one tensor, written from the papers' and mergekit's conventions as
lmdx documents them, independent of lmdx. Shared by merge/test_ties_dare.py and
cli/test_cli_merge.py.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp


def ref_top_k(tau, density):
    """Keep the ``int(density × n)`` largest |τ|; equal magnitudes by lowest flat index."""
    flat = np.asarray(tau, np.float64).reshape(-1)
    k = int(density * flat.size)
    order = np.argsort(-np.abs(flat), kind="stable")
    out = np.zeros_like(flat)
    out[order[:k]] = flat[order[:k]]
    return out.reshape(np.shape(tau))


def ref_elect_mean(taus, coefficients):
    """TIES's sign election (sign of Σ c_i τ_i, + at 0) and mean of the agreeing c_i τ_i
    over the sum of their c_i (0 where none agrees)."""
    stacked = np.stack([np.asarray(t, np.float64) for t in taus])
    c = np.asarray(coefficients, np.float64).reshape(-1, *[1] * (stacked.ndim - 1))
    weighted = c * stacked
    elected = np.where(weighted.sum(axis=0) >= 0, 1.0, -1.0)
    agree = np.sign(weighted) == elected
    divisor = (np.broadcast_to(c, weighted.shape) * agree).sum(axis=0)
    return (weighted * agree).sum(axis=0) / np.where(divisor == 0, 1.0, divisor)


def ref_mask(name, i, shape, density, seed):
    """DARE's kept entries as documented: PCG64 from SeedSequence([seed, i, *SHA-256
    words of the name]), kept where random() < density."""
    words = np.frombuffer(hashlib.sha256(name.encode()).digest(), dtype="<u4").tolist()
    gen = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, i, *words])))
    return gen.random(shape) < density


def ref_merge(method, name, theta0, thetas, coefficients, density, scaling, seed=0):
    """θ_base + λ × (merged task vector) of tensor ``name``, float64: ``method`` is
    task_arithmetic, ties, dare or dare_ties; ``theta0`` the base's values, ``thetas`` the
    models'."""
    c = [1.0] * len(thetas) if coefficients is None else list(coefficients)
    taus = [np.asarray(t, np.float64) - theta0 for t in thetas]
    if method == "ties":
        taus = [ref_top_k(t, density) for t in taus]
    if method in ("dare", "dare_ties") and density < 1:
        taus = [
            np.where(ref_mask(name, i, t.shape, density, seed), t / density, 0.0)
            for i, t in enumerate(taus)
        ]
    if method in ("ties", "dare_ties"):
        delta = ref_elect_mean(taus, c)
    else:
        delta = sum(ci * t for ci, t in zip(c, taus, strict=True))
    return theta0 + scaling * delta


@st.composite
def task_tensors(
    draw: st.DrawFn, max_dims: int, max_side: int, weights: Sequence[float]
) -> tuple[np.ndarray, list[np.ndarray], list[float] | None]:
    """A base tensor, K = 2..4 fine-tunes of it and coefficients (None, or K drawn from
    ``weights`` with a positive sum) for the task-vector methods' references. The models
    differ from the base by small integers × 0.25: sign sums that are exactly 0, equal
    magnitudes, zero task entries."""
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=max_dims, max_side=max_side))
    k = draw(st.integers(2, 4))
    ints = hnp.arrays(np.float64, shape, elements=st.integers(-3, 3).map(float))
    base = draw(hnp.arrays(np.float64, shape, elements=st.floats(-2, 2, width=32)))
    thetas = [np.asarray(base + draw(ints) * 0.25) for _ in range(k)]
    coef = draw(
        st.none()
        | st.lists(st.sampled_from(list(weights)), min_size=k, max_size=k).filter(
            lambda c: sum(c) > 0
        )
    )
    return base, thetas, coef
