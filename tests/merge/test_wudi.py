"""WUDI against its normal equations in float64 (tests/data_free_refs.py).

Per layer with task matrices ``τ_i`` (``[out, in]``) and coefficients ``c_i``, lmdx's
merged update minimises ``Σ c_i ‖(τ − τ_i) τ_iᵀ‖²/‖τ_i‖² + ρ m ‖τ − Σ c_i τ_i‖²`` with
``m = Σ c_i / in`` (the ridge toward task arithmetic, relative to the system's mean
diagonal); the reference solves ``τ (S + ρ m I) = Σ c_i τ_i G_i/n_i + ρ m Σ c_i τ_i`` with
``numpy.linalg.solve``. At ``ρ = 0`` the exact minimiser: the reference where the system is
positive definite, and where it is singular (more inputs than K × outputs) the optimality
conditions and the average kept in the directions no task vector reaches.
"""

from __future__ import annotations

import hf_models as H
import numpy as np
import pytest
from data_free_refs import ref_swudi, ref_wudi
from hypothesis import given, settings
from hypothesis import strategies as st
from lmdx import MergeError, merge_models
from lmdx.merge.builtin.wudi import spectral_wudi, wudi_solve
from lmdx.merge.surrogate import surrogate_gram
from transformers.pytorch_utils import Conv1D

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@st.composite
def _layer(draw):
    out = draw(st.integers(1, 8))
    inp = draw(st.integers(1, 8))
    k = draw(st.integers(2, 4))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.sampled_from([1e-3, 1.0, 50.0]))
    taus = [scale * rng.standard_normal((out, inp)) for _ in range(k)]
    coef = draw(st.sampled_from([None, (1.0, 0.5, 2.0, 3.0)]))
    return taus, [1.0] * k if coef is None else list(coef[:k])


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@given(layer=_layer(), ridge=st.sampled_from([1e-3, 0.1, 1.0, 10.0]))
@settings(deadline=None)
def test_ridged_solve_equals_the_normal_equations(layer, ridge):
    taus, coef = layer
    ref = ref_wudi(taus, coef, ridge)
    got, info = wudi_solve("w", taus, coef, ridge=ridge, precision="float64")
    assert _rel(got, ref) <= 1e-6
    assert info["precision"] in ("float64", "identical")
    auto, _ = wudi_solve("w", taus, coef, ridge=ridge)
    assert _rel(auto, ref) <= 1e-6


@given(layer=_layer())
@settings(deadline=None)
def test_exact_solve_where_the_system_is_positive_definite(layer):
    taus, coef = layer
    s = sum(c * t.T @ t / np.sum(t * t) for c, t in zip(coef, taus, strict=True))
    eig = np.linalg.eigvalsh(s)
    if eig.min() <= 1e-6 * eig.max():  # the singular case: next test
        return
    got, _ = wudi_solve("w", taus, coef, ridge=0.0, precision="float64")
    assert _rel(got, ref_wudi(taus, coef, 0.0)) <= 1e-6


def test_exact_solve_where_the_system_is_singular():
    rng = np.random.default_rng(5)
    taus = [rng.standard_normal((2, 9)) for _ in range(3)]  # rank ≤ 6 of 9 inputs
    coef = [1.0, 2.0, 1.0]
    got, info = wudi_solve("w", taus, coef, ridge=0.0, precision="float64")
    grams = [c * t.T @ t / np.sum(t * t) for c, t in zip(coef, taus, strict=True)]
    # the interference's gradient vanishes: Σ c_i (τ − τ_i) G_i/n_i = 0
    gradient = sum((got - t) @ g for t, g in zip(taus, grams, strict=True))
    assert (
        np.abs(gradient).max()
        <= 1e-10 * np.abs(sum(t @ g for t, g in zip(taus, grams, strict=True))).max()
    )
    # directions no task vector reaches keep the coefficient-weighted average
    w, v = np.linalg.eigh(sum(grams))
    null = v[:, w < 1e-10 * w.max()]
    assert null.shape[1] == 3
    average = sum(c * t for c, t in zip(coef, taus, strict=True)) / sum(coef)
    np.testing.assert_allclose(got @ null, average @ null, atol=1e-10)
    assert info["unseen_directions"] == 3


def test_a_large_ridge_is_task_arithmetic_and_the_solution_lowers_the_interference():
    rng = np.random.default_rng(2)
    taus = [rng.standard_normal((6, 5)) for _ in range(3)]
    coef = [1.0, 1.0, 1.0]
    total = sum(taus)
    far, _ = wudi_solve("w", taus, coef, ridge=1e9, precision="float64")
    assert _rel(far, total) <= 1e-7

    def interference(tau):
        return sum(np.sum(((tau - t) @ t.T) ** 2) / np.sum(t * t) for t in taus)

    values = [interference(wudi_solve("w", taus, coef, ridge=r)[0]) for r in (0.0, 0.1, 10.0)]
    assert values[0] < values[1] < values[2] < interference(total)


@given(layer=_layer())
def test_surrogate_gram_is_the_paper_weighting(layer):
    tau = layer[0][0]
    gram, count = surrogate_gram(tau)
    np.testing.assert_allclose(gram, tau.T @ tau, rtol=1e-12, atol=0)
    np.testing.assert_allclose(count, np.sum(tau * tau), rtol=1e-12)
    np.testing.assert_allclose(np.trace(gram / count), 1.0, rtol=1e-12)
    zero, n = surrogate_gram(np.zeros((3, 4)))
    assert n == 1.0 and not zero.any()


@given(
    layer=_layer(),
    flow_time=st.sampled_from([0.1, 3.0, 100.0, 1300.0]),
    top_fraction=st.sampled_from([None, 0.3, 0.65, 1.0]),
)
@settings(deadline=None, max_examples=60)
def test_spectral_solve_is_the_gradient_flow(layer, flow_time, top_fraction):
    """SWUDI's closed form equals the flow dτ/ds = −(τC − D) from task arithmetic, computed
    by SciPy's matrix exponential (shapes with more inputs than K × outputs, and fewer)."""
    taus, coef = layer
    got, info = spectral_wudi(taus, coef, flow_time=flow_time, top_fraction=top_fraction)
    ref = ref_swudi(taus, coef, flow_time, top_fraction)
    assert _rel(got, ref) < 1e-8
    assert info["solver"] == "spectral" and info["flow_time"] == flow_time


def test_spectral_solve_matches_gradient_descent_and_tends_to_the_minimiser():
    """Plain gradient descent on the interference with a small step lands where the flow
    is at t = steps × step; a long flow reaches the exact minimiser (the system positive
    definite) and lowers the interference below task arithmetic's all the way."""
    rng = np.random.default_rng(3)
    taus = [rng.standard_normal((6, 5)) for _ in range(3)]
    coef = [1.0, 0.5, 2.0]
    c = sum(ci * t.T @ t / np.sum(t * t) for ci, t in zip(coef, taus, strict=True))
    d = sum(ci * t @ (t.T @ t) / np.sum(t * t) for ci, t in zip(coef, taus, strict=True))
    tau = sum(ci * t for ci, t in zip(coef, taus, strict=True))
    step, steps = 1e-3, 5000
    for _ in range(steps):
        tau = tau - step * (tau @ c - d)
    flow, _ = spectral_wudi(taus, coef, flow_time=step * steps)
    assert _rel(flow, tau) < 1e-3

    def interference(t):
        return sum(
            ci * np.sum(((t - ti) @ ti.T) ** 2) / np.sum(ti * ti)
            for ci, ti in zip(coef, taus, strict=True)
        )

    exact, _ = wudi_solve("w", taus, coef, ridge=0.0, precision="float64")
    assert _rel(spectral_wudi(taus, coef, flow_time=1e7)[0], exact) < 1e-8
    values = [interference(spectral_wudi(taus, coef, flow_time=t)[0]) for t in (1e-3, 1, 100)]
    start = interference(sum(ci * t for ci, t in zip(coef, taus, strict=True)))
    assert start > values[0] > values[1] > values[2] >= interference(exact) * (1 - 1e-9)


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
@pytest.mark.parametrize(
    ("options", "coefficients"),
    [
        ({}, None),
        ({"flow_time": 50.0, "top_fraction": 0.5}, (1.0, 0.0, 2.0)),
        ({"solver": "ridge", "ridge": 0.1, "precision": "float64"}, None),
        ({"solver": "ridge", "ridge": 1.0, "precision": "float64"}, (1.0, 0.0, 2.0)),
    ],
)
def test_models_equal_the_reference(arch, options, coefficients):
    base, models, _ = H.cached_family(arch, "float64")
    result = merge_models(
        models,
        "wudi",
        base=base,
        heads=H.HEADS[arch],
        coefficients=coefficients,
        progress=False,
        **options,
    )
    ridge = options.get("ridge")
    c = [1.0] * 3 if coefficients is None else list(coefficients)
    theta0 = H.state_arrays(base)
    states = [H.state_arrays(m) for m in models]
    conv1d = {f"{n}.weight" for n, m in models[0].named_modules() if isinstance(m, Conv1D)}
    solved = 0
    for name, got in result.state_dict.items():
        t0 = theta0[name]
        thetas = [s[name] for s in states]
        if not np.issubdtype(t0.dtype, np.floating):
            continue
        if t0.ndim == 2:
            turn = (lambda x: x.T) if name in conv1d else (lambda x: x)
            taus = [turn(t - t0) for ci, t in zip(c, thetas, strict=True) if ci > 0]
            used = [ci for ci in c if ci > 0]
            if ridge is None:
                flow = options.get("flow_time", 1300.0)
                update = ref_swudi(taus, used, flow, options.get("top_fraction"))
            else:
                update = ref_wudi(taus, used, ridge)
            expected = t0 + turn(update)
            solved += 1
        else:
            expected = sum(ci * t for ci, t in zip(c, thetas, strict=True)) / sum(c)
        assert H.rel_err(got, expected) <= 1e-9, name
    layers = result.report["layers"]
    assert len(layers) == solved
    if ridge is None:
        assert all(v["solver"] == "spectral" for v in layers.values())
        assert result.report["solver"] == "spectral"
    else:
        assert all(v["precision"] == "float64" for v in layers.values())
        assert result.report["ridge"] == ridge


def test_wudi_options_are_checked():
    base, models, _ = H.cached_family("bert")
    kw = {"base": base, "heads": H.HEADS["bert"], "progress": False}
    with pytest.raises(MergeError, match=r"ridge: must be a number >= 0, got -1"):
        merge_models(models, "wudi", solver="ridge", ridge=-1.0, **kw)
    with pytest.raises(MergeError, match=r"ridge is an option of solver ridge, not of spectral"):
        merge_models(models, "wudi", ridge=0.5, **kw)
    with pytest.raises(MergeError, match=r"flow_time is an option of solver spectral, not of"):
        merge_models(models, "wudi", solver="ridge", flow_time=10.0, **kw)
    with pytest.raises(MergeError, match=r"flow_time: must be a number > 0"):
        merge_models(models, "wudi", flow_time=0.0, **kw)
    with pytest.raises(MergeError, match=r"top_fraction: must be in \(0, 1\]"):
        merge_models(models, "wudi", top_fraction=1.5, **kw)
    with pytest.raises(
        MergeError, match=r"precision: must be one of auto, float32, float32-rhs, float64"
    ):
        merge_models(models, "wudi", solver="ridge", precision="float16", **kw)
    with pytest.raises(MergeError, match=r"base: method wudi needs the pre-trained model"):
        merge_models(models, "wudi", heads=H.HEADS["bert"], progress=False)
