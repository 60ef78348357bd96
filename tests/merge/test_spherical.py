"""SLERP, the Karcher mean and Model Stock against float64 references written in
tests/data_free_refs.py.

* SLERP (mergekit's): ``sin((1−t)Ω)/sin Ω · a + sin(tΩ)/sin Ω · b`` with Ω the angle of
  the unit vectors (the reference takes it by arctan2), linear where |cos Ω| > 0.9995.
* Karcher: the merged tensor's direction has zero Riemannian gradient of
  ``Σ w_i d(u, u_i)²`` (checked with the reference's own gradient), its norm is the
  weighted mean norm, and two models at weights (1 − t, t) give the slerp of their unit
  vectors.
* Model Stock: ``t = K cos θ / (1 + (K − 1) cos θ)`` from the mean pairwise cosine of the
  task vectors, ``t θ̄ + (1 − t) θ_0``.
"""

from __future__ import annotations

import hf_models as H
import numpy as np
import pytest
from data_free_refs import karcher_gradient, ref_model_stock, ref_slerp
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from lmdx import MergeError, merge_models
from lmdx.merge.builtin.model_stock import model_stock_ratio
from lmdx.merge.builtin.slerp import karcher_mean, slerp

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@st.composite
def _vectors(draw, k):
    n = draw(st.integers(1, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    spread = draw(st.sampled_from([0.02, 0.3, 1.0]))
    centre = rng.standard_normal(n)
    return [centre + spread * rng.standard_normal(n) for _ in range(k)]


@given(pair=_vectors(2), t=st.floats(0.0, 1.0))
def test_slerp_equals_the_reference(pair, t):
    a, b = pair
    np.testing.assert_allclose(slerp(t, a, b), ref_slerp(t, a, b), rtol=1e-9, atol=1e-12)


def test_slerp_ends_and_parallel_vectors():
    a, b = np.array([1.0, 0.0]), np.array([0.0, 2.0])
    np.testing.assert_allclose(slerp(0.0, a, b), a, atol=1e-15)
    np.testing.assert_allclose(slerp(1.0, a, b), b, atol=1e-15)
    # halfway along the quarter circle between a and b: sin(π/4)/sin(π/2) each
    np.testing.assert_allclose(slerp(0.5, a, b), (a + b) / np.sqrt(2), rtol=1e-14)
    np.testing.assert_array_equal(slerp(0.25, a, 3 * a), 0.75 * a + 0.25 * 3 * a)  # linear


@given(vectors=st.integers(2, 4).flatmap(_vectors), data=st.data())
@settings(deadline=None)
def test_karcher_mean_is_the_weighted_riemannian_mean(vectors, data):
    weights = data.draw(st.lists(st.floats(0.1, 3.0), min_size=len(vectors), max_size=len(vectors)))
    w = [x / sum(weights) for x in weights]
    units = [v / np.linalg.norm(v) for v in vectors]
    centre = sum(units)
    assume(np.linalg.norm(centre) > 0.5 * len(vectors))  # within a hemisphere: one mean
    got = karcher_mean("x", vectors, w)
    scale = sum(wi * np.linalg.norm(v) for wi, v in zip(w, vectors, strict=True))
    np.testing.assert_allclose(np.linalg.norm(got), scale, rtol=1e-12)
    u = got / np.linalg.norm(got)
    assert np.linalg.norm(karcher_gradient(u, vectors, w)) <= 1e-10


@given(pair=_vectors(2), t=st.floats(0.05, 0.95))
def test_karcher_of_two_is_the_slerp_of_their_directions(pair, t):
    a, b = pair
    ua, ub = a / np.linalg.norm(a), b / np.linalg.norm(b)
    assume(ua @ ub > -0.9)
    got = karcher_mean("x", [a, b], [1 - t, t])
    direction = ref_slerp(t, ua, ub) if abs(ua @ ub) <= 0.9995 else None
    if direction is not None:
        np.testing.assert_allclose(got / np.linalg.norm(got), direction, rtol=1e-8, atol=1e-10)


def test_karcher_that_cannot_converge_is_an_error_naming_the_tensor():
    vectors = [np.array([1.0, 0.0, 0.0]), np.array([0.0, 1.0, 0.0]), np.array([0.0, 0.0, 1.0])]
    vectors = [v + 0.1 * np.arange(3) for v in vectors]
    with pytest.raises(MergeError, match=r"tensor 'enc\.w': the Karcher mean did not converge"):
        karcher_mean("enc.w", vectors, [1 / 3] * 3, max_iter=1, tol=1e-15)


@given(data=st.integers(2, 4).flatmap(_vectors))
def test_model_stock_ratio_equals_the_reference(data):
    theta0 = np.zeros_like(data[0])
    cos = []
    for i in range(len(data)):
        for j in range(i + 1, len(data)):
            cos.append(data[i] @ data[j] / np.linalg.norm(data[i]) / np.linalg.norm(data[j]))
    assume(1 + (len(data) - 1) * np.mean(cos) > 1e-3)
    expected = ref_model_stock(theta0, data)
    t = model_stock_ratio("x", data)
    np.testing.assert_allclose(t * np.mean(data, axis=0), expected, rtol=1e-10, atol=1e-12)


def test_model_stock_ratio_ends():
    v = np.array([1.0, 2.0, 3.0])
    assert model_stock_ratio("x", [v, v, v]) == pytest.approx(1.0)  # identical: their average
    assert model_stock_ratio("x", [v, np.array([3.0, 0.0, -1.0])]) == 0.0  # orthogonal: base
    with pytest.raises(MergeError, match=r"tensor 'x': the task vectors' mean pairwise cosine"):
        model_stock_ratio("x", [v, -v])


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_models_equal_the_reference(arch):
    base, models, _ = H.cached_family(arch, "float64")
    heads = H.HEADS[arch]
    theta0 = H.state_arrays(base)
    states = [H.state_arrays(m) for m in models]
    coefficients = (1.0, 2.0, 0.5)
    stock = merge_models(
        models, "model_stock", base=base, heads=heads, coefficients=coefficients, progress=False
    )
    pair = merge_models(models[:2], "slerp", heads=heads, t=0.3, progress=False)
    mean = merge_models(models, "karcher", heads=heads, coefficients=coefficients, progress=False)
    w = [c / sum(coefficients) for c in coefficients]
    for name, got in stock.state_dict.items():
        if not got.is_floating_point():
            continue
        thetas = [s[name] for s in states]
        expected = ref_model_stock(theta0[name], thetas, coefficients)
        assert H.rel_err(got, expected) <= 1e-12, name
        assert H.rel_err(pair.state_dict[name], ref_slerp(0.3, *thetas[:2])) <= 1e-12, name
        merged = mean.state_dict[name].numpy().ravel()
        flat = [t.ravel() for t in thetas]
        norm = sum(wi * np.linalg.norm(t) for wi, t in zip(w, flat, strict=True))
        assert np.linalg.norm(merged) == pytest.approx(norm, rel=1e-12, abs=1e-300), name
        if norm > 0:
            gradient = karcher_gradient(merged / np.linalg.norm(merged), flat, w)
            assert np.linalg.norm(gradient) <= 1e-10, name


def test_slerp_and_model_stock_errors():
    _, models, _ = H.cached_family("bert")
    heads = H.HEADS["bert"]
    with pytest.raises(MergeError, match=r"models: slerp interpolates two models, got 3"):
        merge_models(models, "slerp", heads=heads, progress=False)
    with pytest.raises(MergeError, match=r"coefficients: slerp weighs its two models by t"):
        merge_models(models[:2], "slerp", heads=heads, coefficients=(1, 2), progress=False)
    with pytest.raises(MergeError, match=r"t: must be in \[0, 1\], got 1.5"):
        merge_models(models[:2], "slerp", heads=heads, t=1.5, progress=False)
    with pytest.raises(MergeError, match=r"base: method model_stock needs the pre-trained"):
        merge_models(models, "model_stock", heads=heads, progress=False)
