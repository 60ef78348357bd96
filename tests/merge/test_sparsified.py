"""Model Breadcrumbs (breadcrumbs, breadcrumbs_ties) and DELLA (della, della_linear)
against float64 references written in tests/data_free_refs.py.

* Breadcrumbs: per tensor and model, ``kept = int(density × n)`` entries stay, the
  ``top = min(int(gamma × n), n − kept)`` largest |τ| go and the smallest rest; equal
  magnitudes ordered lowest index first (a stable sort in the reference, partitions in
  lmdx); then task arithmetic or TIES's election and mean.
* DELLA: per row, the rank of each |τ| (counted in the reference), keep probability
  ``density − ε + 2ε rank/(n − 1)``, the documented PCG64 draws, kept entries divided by
  their probability; then TIES's election and mean (della) or task arithmetic.
"""

from __future__ import annotations

import hf_models as H
import numpy as np
import pytest
import torch
from data_free_refs import ref_magprune, ref_outlier_trim, ref_sparsified_merge
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from lmdx import MergeError, merge_models
from lmdx.merge.builtin.breadcrumbs import outlier_trim
from lmdx.merge.builtin.della import magprune
from lmdx.merge.method import MergeInputs
from lmdx.merge.registry import merge_options, method_named
from lmdx.merge.source import StateDictSource
from task_vectors import task_tensors

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DEFAULTS = {
    "breadcrumbs": {"scaling": 0.3, "density": 0.9, "gamma": 0.01},
    "breadcrumbs_ties": {"scaling": 1.0, "density": 0.9, "gamma": 0.01},
    "della": {"scaling": 1.0, "density": 0.5, "epsilon": 0.15, "seed": 0},
    "della_linear": {"scaling": 0.3, "density": 0.5, "epsilon": 0.15, "seed": 0},
}


def _tensor(method, name, base, thetas, **kwargs):
    options = merge_options(len(thetas), method, kwargs)
    source = StateDictSource({name: torch.as_tensor(base)}, "base")
    inputs = MergeInputs(method_named(method), options, [], [], base=source)
    return inputs.method.tensor(name, thetas, inputs)


@given(
    tau=hnp.arrays(
        np.float64,
        hnp.array_shapes(min_dims=0, max_dims=3, max_side=9),
        elements=st.integers(-4, 4).map(float),  # few values: ties at both thresholds
    ),
    density=st.floats(0.01, 1.0),
    gamma=st.floats(0.0, 0.99),
)
def test_outlier_trim_equals_the_reference(tau, density, gamma):
    got = outlier_trim(tau, density, gamma)
    np.testing.assert_array_equal(got, ref_outlier_trim(tau, density, gamma))
    assert np.count_nonzero(got) <= int(density * tau.size) or density * tau.size >= tau.size


def test_outlier_trim_counts_as_mergekit():
    tau = np.arange(1.0, 101.0)
    got = outlier_trim(tau, 0.9, 0.01)  # the top 1 and the bottom 9 dropped
    np.testing.assert_array_equal(np.flatnonzero(got), np.arange(9, 99))
    got = outlier_trim(tau, 0.5, 0.8)  # gamma beyond 1 − density: the top 50 dropped
    np.testing.assert_array_equal(np.flatnonzero(got), np.arange(0, 50))
    assert outlier_trim(tau, 1.0, 0.3) is tau  # density 1 keeps everything


@given(
    tau=hnp.arrays(
        np.float64,
        hnp.array_shapes(min_dims=0, max_dims=3, max_side=7),
        elements=st.integers(-3, 3).map(float) | st.floats(-5, 5),
    ),
    density=st.sampled_from([0.3, 0.5, 0.8]),
    epsilon=st.sampled_from([0.0, 0.1, 0.2]),
    seed=st.integers(0, 2**32),
)
def test_magprune_equals_the_reference(tau, density, epsilon, seed):
    got = magprune("enc.w", 2, tau, density, epsilon, seed)
    expected = ref_magprune("enc.w", 2, tau, density, epsilon, seed)
    np.testing.assert_allclose(got, expected, rtol=1e-14, atol=0)


def test_magprune_keeps_large_entries_more_often_and_the_expected_value():
    rng = np.random.default_rng(0)
    tau = rng.standard_normal((400, 500))
    got = magprune("enc.w", 0, tau, 0.5, 0.2, 7)
    kept = got != 0
    assert abs(kept.mean() - 0.5) < 0.01
    order = np.argsort(np.abs(tau), axis=1)
    smallest = np.take_along_axis(kept, order[:, :50], axis=1).mean()
    largest = np.take_along_axis(kept, order[:, -50:], axis=1).mean()
    low = 0.3 + 0.4 * np.arange(50).mean() / 499  # mean keep probability of ranks 0..49
    high = 0.3 + 0.4 * np.arange(450, 500).mean() / 499
    sigma = np.sqrt(0.25 / 20_000)
    assert abs(smallest - low) < 5 * sigma and abs(largest - high) < 5 * sigma
    runs = np.mean([magprune("enc.w", 0, tau, 0.5, 0.2, s) for s in range(200)], axis=0)
    assert np.abs(runs - tau).mean() < 0.1 * np.abs(tau).mean()  # unbiased


@given(
    data=task_tensors(max_dims=2, max_side=6, weights=[0.0, 0.5, 1.0, 2.0]),
    method=st.sampled_from(list(DEFAULTS)),
    density=st.sampled_from([0.3, 0.5, 0.7]),
    knob=st.sampled_from([0.0, 0.1, 0.2]),
    scaling=st.sampled_from([0.3, 1.0]),
    seed=st.integers(0, 2**32),
)
def test_one_tensor_equals_the_reference(data, method, density, knob, scaling, seed):
    base, thetas, coef = data
    options = {"scaling": scaling, "density": density}
    if method.startswith("breadcrumbs"):
        options["gamma"] = knob
    else:
        options.update(epsilon=knob, seed=seed)
    got = _tensor(method, "layer.weight", base, thetas, coefficients=coef, **options)
    expected = ref_sparsified_merge(method, "layer.weight", base, thetas, coef, options)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("method", list(DEFAULTS))
@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_models_equal_the_reference(arch, method):
    base, models, _ = H.cached_family(arch, "float64")
    coefficients = (1.0, 0.5, 2.0)
    result = merge_models(
        models,
        method,
        base=base,
        heads=H.HEADS[arch],
        coefficients=coefficients,
        progress=False,
    )
    theta0 = H.state_arrays(base)
    states = [H.state_arrays(m) for m in models]
    for name, got in result.state_dict.items():
        if not got.is_floating_point():
            continue
        thetas = [s[name] for s in states]
        expected = ref_sparsified_merge(
            method, name, theta0[name], thetas, coefficients, DEFAULTS[method]
        )
        assert H.rel_err(got, expected) <= 1e-12, name
    assert {k: result.report[k] for k in DEFAULTS[method]} == DEFAULTS[method]


def test_della_options_are_checked_together():
    base, models, _ = H.cached_family("bert")
    kw = {"base": base, "heads": H.HEADS["bert"], "progress": False}
    with pytest.raises(MergeError, match=r"method della: density ± epsilon must lie in \(0, 1\]"):
        merge_models(models, "della", density=0.9, epsilon=0.2, **kw)
    # each alone is fine; together with a smaller epsilon, density 0.9 is too
    merge_models(models, "della", density=0.9, epsilon=0.05, **kw)
    with pytest.raises(MergeError, match=r"gamma: must be in \[0, 1\)"):
        merge_models(models, "breadcrumbs", gamma=1.0, **kw)
    with pytest.raises(MergeError, match=r"epsilon: only used by della, della_linear, not ties"):
        merge_models(models, "ties", epsilon=0.1, **kw)
