"""TSV-M's default path (float64 Gram eigendecompositions, ``precision: auto``) against an
independent float64 reference written here (NumPy's thin SVD, top k, polar factors by
SVD), within the bound lmdx states (``FAST_PATH_BOUND``, relative Frobenius), on
hypothesis-drawn small task matrices: full-rank, rank-deficient, duplicated, zero,
near-equal singular values at the cut. ``precision: float64`` is today's code, bit for bit
(the code as it was before the fast path, copied here), and the fast path holds its bound
at BERT-base's 768 x 768 with realistic 2 % deltas.

Where the fast path's a-posteriori estimate does not assure the bound it falls back to the
float64 SVDs, so the bound is checked against every result, fast or not, wherever the
definition is well posed (a relative gap after the k-th singular value, and the
concatenated vectors of full column or row rank).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from lmdx import merge_state_dicts
from lmdx.merge.builtin.task_matrices import polar
from lmdx.merge.builtin.tsv import FAST_PATH_BOUND, tsv_merge, tsv_merge_fast
from task_matrix_draws import realistic_deltas, task_matrix_draws


def _ref_polar(a):
    u, _, vt = np.linalg.svd(a, full_matrices=False)
    return u @ vt


def _ref_tsv(taus, fraction):
    """TSV-M from its definition: each task's top-k thin-SVD triplets, triplets at most
    ε max(out, in) σ_max left out, U and Vᵀ replaced by their polar factors."""
    m, n = taus[0].shape
    k = max(1, int(min(m, n) * (1 / len(taus) if fraction is None else fraction)))
    parts = [np.linalg.svd(t, full_matrices=False) for t in taus]
    u = np.hstack([p[0][:, :k] for p in parts])
    s = np.concatenate([p[1][:k] for p in parts])
    vt = np.vstack([p[2][:k] for p in parts])
    keep = s > np.finfo(np.float64).eps * max(m, n) * s.max(initial=0.0)
    if not keep.any():
        return np.zeros((m, n))
    return _ref_polar(u[:, keep]) @ np.diag(s[keep]) @ _ref_polar(vt[keep])


def _today(taus, rank_fraction):
    """``tsv_merge`` as it was before the fast path (lmdx 0.x, issue 49), verbatim."""
    m, n = taus[0].shape
    r = min(m, n)
    fraction = 1.0 / len(taus) if rank_fraction is None else rank_fraction
    k = max(1, int(r * fraction))
    us, ss, vts = [], [], []
    for tau in taus:
        u, s, vt = np.linalg.svd(tau, full_matrices=False)
        us.append(u[:, :k])
        ss.append(s[:k])
        vts.append(vt[:k])
    s_all = np.concatenate(ss)
    floor = np.finfo(np.float64).eps * max(m, n) * float(s_all.max(initial=0.0))
    keep = s_all > floor
    if not keep.any():
        return np.zeros((m, n))
    u_all = np.concatenate(us, axis=1)[:, keep]
    vt_all = np.concatenate(vts, axis=0)[keep]
    return (polar(u_all) * s_all[keep]) @ polar(vt_all)


def _well_posed(taus, fraction):
    """The definition is stable to well within the bound: a relative gap of 1e-8 after
    each task's k-th singular value, kept singular values above 1e-8 of the largest,
    concatenated vectors of condition at most 1e6 (the SVDs' own error then at most
    about 2e-8)."""
    m, n = taus[0].shape
    k = max(1, int(min(m, n) * (1 / len(taus) if fraction is None else fraction)))
    parts = [np.linalg.svd(t, full_matrices=False) for t in taus]
    top = max(float(p[1][0]) for p in parts)
    if top == 0.0:
        return True
    us, vts = [], []
    for u, s, vt in parts:
        if s[0] == 0.0:
            continue
        if s[k - 1] < 1e-8 * top or (k < len(s) and s[k - 1] - s[k] < 1e-8 * top):
            return False
        us.append(u[:, :k])
        vts.append(vt[:k])
    for a in (np.hstack(us), np.vstack(vts)):
        sv = np.linalg.svd(a, compute_uv=False)
        if sv.min() < 1e-6 * sv.max():
            return False
    return True


def _relative(got, ref):
    return np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-300)


_FRACTIONS = st.sampled_from([None, 0.1, 0.25, 0.5, 1.0])


@given(taus=task_matrix_draws(), fraction=_FRACTIONS)
@settings(deadline=None, max_examples=300)
def test_the_default_is_within_its_bound_of_the_float64_definition(taus, fraction):
    got = tsv_merge(taus, fraction)
    assert got.shape == taus[0].shape
    assert np.isfinite(got).all()
    assume(_well_posed(taus, fraction))
    assert _relative(got, _ref_tsv(taus, fraction)) <= FAST_PATH_BOUND


@given(taus=task_matrix_draws(), fraction=_FRACTIONS)
@settings(deadline=None, max_examples=300)
def test_the_fast_path_when_it_answers_is_within_its_bound(taus, fraction):
    """Where the fast path does not fall back, wherever the definition is well posed."""
    got = tsv_merge_fast(taus, fraction)
    assume(got is not None and _well_posed(taus, fraction))
    assert _relative(got, _ref_tsv(taus, fraction)) <= FAST_PATH_BOUND


@given(taus=task_matrix_draws(), fraction=_FRACTIONS)
@settings(deadline=None, max_examples=150)
def test_float64_is_todays_result_bit_for_bit(taus, fraction):
    got = tsv_merge(taus, fraction, "float64")
    assert np.array_equal(got, _today(taus, fraction))


def test_ill_posed_factorizations_fall_back_to_the_svds():
    """Duplicated tasks (U's Gram singular), a rank-deficient task (k above its rank) and
    equal singular values at the cut: the fast path declines, the default is today's."""
    rng = np.random.default_rng(3)
    tau = rng.standard_normal((30, 20))
    low = rng.standard_normal((30, 2)) @ rng.standard_normal((2, 20))
    flat = np.linalg.qr(rng.standard_normal((30, 20)))[0]
    for taus, fraction in (([tau, tau.copy()], None), ([tau, low], 0.5), ([flat], 0.5)):
        assert tsv_merge_fast(taus, fraction) is None
        assert np.array_equal(tsv_merge(taus, fraction), _today(taus, fraction))


def test_zero_and_empty_task_matrices_behave_as_before():
    rng = np.random.default_rng(4)
    tau = rng.standard_normal((12, 9))
    zero = np.zeros_like(tau)
    assert np.array_equal(tsv_merge([zero, zero], None), np.zeros((12, 9)))
    with_zero = tsv_merge([tau, zero], 1.0)
    np.testing.assert_allclose(with_zero, tsv_merge([tau], 1.0), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(with_zero, tau, rtol=1e-10, atol=1e-12)
    for shape in ((0, 5), (5, 0), (0, 0)):
        empty = [np.zeros(shape), np.zeros(shape)]
        assert np.array_equal(tsv_merge(empty, None), _today(empty, None))


def test_bert_base_shapes_with_realistic_deltas_take_the_fast_path_within_its_bound():
    """768 x 768, K = 3, task matrices 2 % of a base weight (slowly decaying spectra)."""
    taus = realistic_deltas((768, 768))
    fast = tsv_merge_fast(taus, None)
    assert fast is not None
    assert _relative(fast, _ref_tsv(taus, None)) <= FAST_PATH_BOUND


@pytest.mark.parametrize("precision", ["auto", "float64"])
def test_the_option_reaches_the_method(precision):
    """``precision`` through the front door: float64 is today's merge, auto within the
    bound of it."""
    import torch

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, dtype=torch.float64, generator=gen)
    models = {"base": {"w": w}}
    for i in range(3):
        models[i] = {"w": w + 0.02 * torch.randn(w.shape, dtype=torch.float64, generator=gen)}
    options = {"precision": precision}
    merged = merge_state_dicts(models, "tsv_m", parameters=options, base="base")["w"]
    taus = [(models[i]["w"] - w).numpy() for i in range(3)]
    expected = w.numpy() + _today(taus, None)
    got = merged.double().numpy()
    if precision == "float64":
        np.testing.assert_array_equal(got, expected)
    else:
        assert _relative(got - w.numpy(), expected - w.numpy()) <= FAST_PATH_BOUND
