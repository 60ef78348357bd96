"""ISO-C's and ISO-CTS's default path (float64 Gram eigendecompositions, ``precision:
auto``) against the independent float64 references of tests/data_free_refs.py (SciPy's
``gesvd`` SVDs, ``scipy.linalg.polar``), within the bound lmdx states
(``FAST_PATH_BOUND``, relative Frobenius), on hypothesis-drawn task matrices (the spectra
of tests/task_matrix_draws.py); ``precision: float64`` is the code as it was before the
fast path (copied here), bit for bit; and at BERT-base's shapes with realistic 2 % deltas
the fast path answers, within its bound.

Where its a-posteriori estimate does not assure the bound the fast path falls back to the
float64 SVDs, so the bound is checked against every result wherever the definition is
well posed (relative gaps at the cuts, kept singular values and the concatenated vectors'
conditions bounded: the definition then moves by well under the bound when the inputs
move by rounding).
"""

from __future__ import annotations

import numpy as np
import pytest
from data_free_refs import ref_iso_c, ref_iso_cts, ref_iso_cts_split
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from lmdx import merge_state_dicts
from lmdx.merge.builtin.isotropic import (
    FAST_PATH_BOUND,
    iso_c_merge,
    iso_c_merge_fast,
    iso_cts_merge,
    iso_cts_merge_fast,
)
from lmdx.merge.builtin.task_matrices import polar
from task_matrix_draws import realistic_deltas, task_matrix_draws

_FRACTIONS = st.sampled_from([0.0, 0.5, 0.8, 1.0])
#: The well-posedness margins: relative gaps and kept values at least this of the largest
#: singular value, concatenated vectors of condition at most its inverse.
_MARGIN = 1e-4


def _today_iso_c(taus):
    """``iso_c_merge`` as it was before the fast path (issue 49), verbatim."""
    total = np.sum(taus, axis=0)
    u, s, vt = np.linalg.svd(total, full_matrices=False)
    return (float(s.mean()) * u) @ vt


def _today_iso_cts(taus, common_fraction):
    """``iso_cts_merge`` as it was before the fast path (issue 49), verbatim."""
    k = len(taus)
    r = min(taus[0].shape)
    common = int(r * common_fraction)
    per_task = min(round((r - common) / k), r // k)
    common = r - k * per_task
    u, s, vt = np.linalg.svd(np.sum(taus, axis=0), full_matrices=False)
    u_c, s_c, vt_c = u[:, :common], s[:common], vt[:common]
    us, ss, vts = [], [], []
    if per_task > 0:
        for tau in taus:
            specific = tau - u_c @ (u_c.T @ tau)
            u_t, s_t, vt_t = np.linalg.svd(specific, full_matrices=False)
            us.append(u_t[:, :per_task])
            ss.append(s_t[:per_task])
            vts.append(vt_t[:per_task])
    mean = float(np.concatenate([*ss, s_c]).mean())
    u_all = polar(np.concatenate([*us, u_c], axis=1))
    vt_all = polar(np.concatenate([*vts, vt_c], axis=0))
    return (mean * u_all) @ vt_all


def _cut_well_posed(s, k):
    """Keeping the top ``k`` of the singular values ``s`` (descending) is stable."""
    if k == 0 or k == len(s):
        return k == 0 or s[-1] > _MARGIN * s[0]
    return s[k - 1] > _MARGIN * s[0] and s[k - 1] - s[k] > _MARGIN * s[0]


def _conditioned(a):
    sv = np.linalg.svd(a, compute_uv=False)
    return sv.size > 0 and sv.min() > _MARGIN * sv.max()


def _iso_c_well_posed(taus):
    total = np.sum(taus, axis=0)
    return total.size > 0 and np.any(total) and _conditioned(total)


def _iso_cts_well_posed(taus, fraction):
    m, n = taus[0].shape
    if m == 0 or n == 0:
        return False
    common, per_task = ref_iso_cts_split(min(m, n), len(taus), fraction)
    u, s, vt = np.linalg.svd(np.sum(taus, axis=0), full_matrices=False)
    if common and (s[0] == 0.0 or not _cut_well_posed(s, common)):
        return False
    us, vts = [u[:, :common]], [vt[:common]]
    for tau in taus if per_task else ():
        specific = tau - u[:, :common] @ (u[:, :common].T @ tau)
        u_t, s_t, vt_t = np.linalg.svd(specific, full_matrices=False)
        if s_t[0] <= _MARGIN * s[0] or not _cut_well_posed(s_t, per_task):
            return False
        us.append(u_t[:, :per_task])
        vts.append(vt_t[:per_task])
    return _conditioned(np.hstack(us)) and _conditioned(np.vstack(vts))


def _relative(got, ref):
    return np.linalg.norm(got - ref) / max(np.linalg.norm(ref), 1e-300)


@given(taus=task_matrix_draws())
@settings(deadline=None, max_examples=300)
def test_iso_c_default_is_within_its_bound_of_the_float64_definition(taus):
    got = iso_c_merge(taus)
    assert got.shape == taus[0].shape
    assert np.isfinite(got).all()
    assume(_iso_c_well_posed(taus))
    assert _relative(got, ref_iso_c(taus)) <= FAST_PATH_BOUND


@given(taus=task_matrix_draws())
@settings(deadline=None, max_examples=300)
def test_iso_c_fast_path_when_it_answers_is_within_its_bound(taus):
    got = iso_c_merge_fast(taus)
    assume(got is not None and _iso_c_well_posed(taus))
    assert _relative(got, ref_iso_c(taus)) <= FAST_PATH_BOUND


@given(taus=task_matrix_draws(), fraction=_FRACTIONS)
@settings(deadline=None, max_examples=300)
def test_iso_cts_default_is_within_its_bound_of_the_float64_definition(taus, fraction):
    got = iso_cts_merge(taus, fraction)
    assert got.shape == taus[0].shape
    assume(_iso_cts_well_posed(taus, fraction))
    assert np.isfinite(got).all()
    assert _relative(got, ref_iso_cts(taus, fraction)) <= FAST_PATH_BOUND


@given(taus=task_matrix_draws(), fraction=_FRACTIONS)
@settings(deadline=None, max_examples=300)
def test_iso_cts_fast_path_when_it_answers_is_within_its_bound(taus, fraction):
    got = iso_cts_merge_fast(taus, fraction)
    assume(got is not None and _iso_cts_well_posed(taus, fraction))
    assert _relative(got, ref_iso_cts(taus, fraction)) <= FAST_PATH_BOUND


@given(taus=task_matrix_draws(), fraction=_FRACTIONS)
@settings(deadline=None, max_examples=150)
def test_float64_is_todays_result_bit_for_bit(taus, fraction):
    assert np.array_equal(iso_c_merge(taus, "float64"), _today_iso_c(taus), equal_nan=True)
    got = iso_cts_merge(taus, fraction, "float64")
    assert np.array_equal(got, _today_iso_cts(taus, fraction), equal_nan=True)


def test_ill_posed_factorizations_fall_back_to_the_svds():
    """A rank-deficient sum (ISO-C's polar factor not unique), duplicated tasks and equal
    singular values at ISO-CTS's cut: the fast paths decline, the default is today's."""
    rng = np.random.default_rng(3)
    tau = rng.standard_normal((30, 20))
    low = rng.standard_normal((30, 2)) @ rng.standard_normal((2, 20))
    flat = np.linalg.qr(rng.standard_normal((30, 20)))[0]
    for taus in ([low], [tau, -tau]):
        assert iso_c_merge_fast(taus) is None
        assert np.array_equal(iso_c_merge(taus), _today_iso_c(taus))
    for taus, fraction in (([tau, tau.copy()], 0.5), ([flat, flat.copy()], 0.5), ([low], 0.8)):
        assert iso_cts_merge_fast(taus, fraction) is None
        assert np.array_equal(iso_cts_merge(taus, fraction), _today_iso_cts(taus, fraction))


def test_empty_task_matrices_give_an_empty_update():
    """As before, minus NumPy's warning about the mean of no singular values."""
    for shape in ((0, 5), (5, 0), (0, 0)):
        empty = [np.zeros(shape), np.zeros(shape)]
        for precision in ("auto", "float64"):
            assert iso_c_merge(empty, precision).shape == shape
            assert iso_cts_merge(empty, 0.8, precision).shape == shape


@pytest.mark.parametrize("shape", [(768, 768), (3072, 768), (768, 3072)])
def test_bert_base_shapes_with_realistic_deltas_take_the_fast_path_within_its_bound(shape):
    """K = 3, task matrices 2 % of a base weight (slowly decaying spectra)."""
    taus = realistic_deltas(shape)
    fast = iso_c_merge_fast(taus)
    assert fast is not None
    assert _relative(fast, ref_iso_c(taus)) <= FAST_PATH_BOUND
    fast = iso_cts_merge_fast(taus, 0.8)
    assert fast is not None
    assert _relative(fast, ref_iso_cts(taus, 0.8)) <= FAST_PATH_BOUND


@pytest.mark.parametrize("precision", ["auto", "float64"])
@pytest.mark.parametrize("method", ["iso_c", "iso_cts"])
def test_the_option_reaches_the_method(method, precision):
    """``precision`` through the front door: float64 is today's merge, auto within the
    bound of it."""
    import torch

    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 32, dtype=torch.float64, generator=gen)
    models = {"base": {"w": w}}
    for i in range(3):
        models[i] = {"w": w + 0.02 * torch.randn(w.shape, dtype=torch.float64, generator=gen)}
    options = {"precision": precision}
    merged = merge_state_dicts(models, method, parameters=options, base="base")["w"]
    taus = [(models[i]["w"] - w).numpy() for i in range(3)]
    today = _today_iso_c(taus) if method == "iso_c" else _today_iso_cts(taus, 0.8)
    expected = w.numpy() + today
    got = merged.double().numpy()
    if precision == "float64":
        np.testing.assert_array_equal(got, expected)
    else:
        assert _relative(got - w.numpy(), today) <= FAST_PATH_BOUND
