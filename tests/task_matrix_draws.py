"""A hypothesis strategy of K task matrices of one shape with the spectra that stress the
Gram-eigendecomposition fast paths (TSV-M's, ISO-C's, ISO-CTS's), and BERT-base-like
fine-tune deltas (``realistic_deltas``): Gaussian, low-rank,
duplicated, nearly duplicated, zero, scaled, flat (equal singular values) and with a tiny
relative gap somewhere in the spectrum. Shared by merge/test_tsv_fast.py and
merge/test_iso_fast.py.
"""

from __future__ import annotations

import numpy as np
from hypothesis import strategies as st


@st.composite
def task_matrix_draws(draw):
    """K task matrices of one shape: Gaussian, low-rank, duplicated, zero, scaled, or
    with a repeated singular value."""
    out = draw(st.integers(1, 40))
    inp = draw(st.integers(1, 40))
    k = draw(st.integers(1, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.sampled_from([1e-6, 0.02, 1.0, 30.0]))
    taus = []
    for _ in range(k):
        kinds = ["full", "full", "low_rank", "duplicate", "near", "zero", "flat", "gapped"]
        kind = draw(st.sampled_from(kinds))
        if kind == "low_rank":
            rank = draw(st.integers(1, max(1, min(out, inp))))
            tau = rng.standard_normal((out, rank)) @ rng.standard_normal((rank, inp))
        elif kind == "duplicate" and taus:
            tau = taus[draw(st.integers(0, len(taus) - 1))] * draw(st.sampled_from([1.0, -2.0]))
        elif kind == "near" and taus:  # almost a duplicate: U's Gram ill-conditioned
            noise = draw(st.sampled_from([1e-3, 1e-5, 1e-7]))
            tau = taus[-1] / scale + noise * rng.standard_normal((out, inp))
        elif kind == "gapped":  # a tiny relative gap somewhere in the spectrum
            r = min(out, inp)
            q1 = np.linalg.qr(rng.standard_normal((out, r)))[0]
            q2 = np.linalg.qr(rng.standard_normal((inp, r)))[0]
            s = np.sort(rng.uniform(0.5, 1.0, r))[::-1]
            at = draw(st.integers(0, r - 1))
            s[at:] -= np.linspace(0.0, 1e-3, r - at)  # keep the order
            s[at] = s[at - 1] - draw(st.sampled_from([1e-4, 1e-8, 1e-11])) if at else s[at]
            tau = (q1 * s) @ q2.T
        elif kind == "zero":
            tau = np.zeros((out, inp))
        elif kind == "flat":  # equal singular values: an orthonormal block times a constant
            q = np.linalg.qr(rng.standard_normal((max(out, inp), min(out, inp))))[0]
            tau = q if out >= inp else q.T
        else:
            tau = rng.standard_normal((out, inp))
        taus.append(scale * tau)
    return taus


def realistic_deltas(shape, k=3, seed=5):
    """K task matrices 2 % of a base weight's mean magnitude, seeded Gaussians (slowly
    decaying spectra, as real fine-tune deltas have)."""
    rng = np.random.default_rng(seed)
    base = 0.04 * rng.standard_normal(shape)
    return [0.02 * np.abs(base).mean() * rng.standard_normal(shape) for _ in range(k)]
