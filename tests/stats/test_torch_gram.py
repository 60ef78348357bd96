"""The torch collector path (lmdx.stats.torch_gram): Grams accumulated by torch on the
model's own device, as ``lmdx stats --device cuda`` does. Run here on the CPU
(``backend="torch"``), where it must agree with the native core within float32 rounding
and with float64 references computed in this file and in tests/hf_models.py.
"""

from __future__ import annotations

import copy

import hf_families as F
import hf_models as H
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from lmdx.merge import merge_models
from lmdx.stats import add_statistics
from lmdx.stats.torch_gram import BLOCK_ROWS, TorchGram

pytestmark = pytest.mark.usefixtures("one_torch_thread")

F32_RTOL = 1e-6  # the float32 path's bound (DESIGN.md)


def rel(a, b) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


@given(
    rows=st.integers(0, 2 * BLOCK_ROWS + 77),
    d=st.integers(1, 40),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64]),
    masked=st.booleans(),
    float64=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    shift=st.sampled_from([0.0, 3.0, -20.0]),
)
def test_torch_gram_matches_a_float64_reference(rows, d, dtype, masked, float64, seed, shift):
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(shift + rng.standard_normal((rows, d))).to(dtype)
    keep = torch.from_numpy(rng.random(rows) < 0.6) if masked else None
    acc = TorchGram(d, "cpu", float64=float64)
    acc.update(x.reshape(rows, 1, d), keep)  # any leading shape: one row per index
    x64 = x.double().numpy()
    if keep is not None:
        x64 = x64[keep.numpy()]
    assert acc.count == x64.shape[0]
    np.testing.assert_allclose(acc.sum, x64.sum(axis=0), rtol=1e-12, atol=1e-12)
    gram = acc.gram()
    assert np.array_equal(gram, gram.T)
    assert rel(gram, x64.T @ x64) <= (1e-12 if float64 else F32_RTOL)
    m = acc.moments("group")
    assert m.count == acc.count and np.array_equal(m.gram(), gram)


def test_non_finite_input_is_refused_naming_the_group():
    acc = TorchGram(3, "cpu")
    x = torch.ones(5, 3)
    x[2, 1] = float("nan")
    acc.update(x)
    with pytest.raises(ValueError, match=r"^input group 'q': its input held NaN or Inf"):
        acc.moments("input group 'q'")


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("arch", H.ARCHS)
def test_torch_backend_agrees_with_the_core_and_the_reference(arch, dtype):
    _, models, batches = H.cached_family(arch, dtype)
    model, data = models[1], list(batches[1])
    core = H.collect(model, data)
    on_torch = H.collect(model, data, backend="torch")
    ref = H.reference_grams(model, data, False)
    assert on_torch.accumulation == "torch-float32"
    assert on_torch.extra["collected_on"] == "cpu" and on_torch.extra["block_rows"] == BLOCK_ROWS
    assert core.accumulation == "mixed" and "collected_on" not in core.extra
    assert on_torch.modules == core.modules and on_torch.groups == core.groups
    rtol = 1e-12 if dtype == "float64" else F32_RTOL
    for name, r in ref.items():
        assert on_torch.count(name) == core.count(name) == r["count"], name
        assert H.rel_err(on_torch.sum(name), r["sum"]) <= 1e-12, name
        assert H.rel_err(on_torch.gram(name), r["gram"]) <= rtol, name
        assert H.rel_err(on_torch.gram(name), core.gram(name)) <= 2 * rtol, name


@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_torch_backend_on_a_bfloat16_model_and_with_float64_accumulation(arch):
    _, models, batches = H.cached_family(arch, "float32")
    half = copy.deepcopy(models[0]).to(torch.bfloat16)
    data = list(batches[0])
    ref = H.reference_grams(half, data, False)
    stats = H.collect(half, data, backend="torch")
    exact = H.collect(half, data, backend="torch", accumulation="float64")
    assert exact.accumulation == "float64" and "block_rows" not in exact.extra
    for name, r in ref.items():
        assert stats.count(name) == r["count"], name
        assert H.rel_err(stats.gram(name), r["gram"]) <= F32_RTOL, name
        assert H.rel_err(exact.gram(name), r["gram"]) <= 1e-12, name


def test_torch_backend_collects_mixture_of_experts_like_the_core():
    family = F.FAMILIES["Mixtral"]
    model = H.finetuned(F.build(family), 1)
    data = F.batches(family, 11)
    core = H.collect(model, data)
    on_torch = H.collect(model, data, backend="torch")
    experts = [m for m in core.modules if ".experts." in m]
    assert experts and on_torch.modules == core.modules
    for name in core.modules:
        assert on_torch.count(name) == core.count(name), name
        assert H.rel_err(on_torch.gram(name), core.gram(name)) <= 2 * F32_RTOL, name


def test_torch_and_core_statistics_join_with_the_coarser_label_and_merge():
    _, models, batches = H.cached_family("bert")
    data = list(batches[0])
    half = len(data) // 2
    on_torch = H.collect(models[0], data[:half], backend="torch")
    core = H.collect(models[0], data[half:])
    exact = H.collect(models[0], data[half:], accumulation="float64")
    assert add_statistics([on_torch, core]).accumulation == "torch-float32"
    assert add_statistics([exact, on_torch]).accumulation == "torch-float32"
    assert add_statistics([exact, core]).accumulation == "mixed"
    whole = H.collect(models[0], data)
    joined = add_statistics([on_torch, core])
    for name in whole.modules:
        assert H.rel_err(joined.gram(name), whole.gram(name)) <= 2 * F32_RTOL, name
    other = H.collect(models[1], list(batches[1]), backend="torch")
    result = merge_models(
        [models[0], models[1]],
        "regmean",
        stats=[joined, other],
        heads=H.HEADS["bert"],
        progress=False,
        n_threads=1,
    )
    reference = merge_models(
        [models[0], models[1]],
        "regmean",
        stats=[whole, H.collect(models[1], list(batches[1]))],
        heads=H.HEADS["bert"],
        progress=False,
        n_threads=1,
    )
    for name, t in result.state_dict.items():
        if t.is_floating_point():
            assert H.rel_err(t, reference.state_dict[name]) <= 1e-4, name


def test_a_device_the_model_cannot_run_on_is_one_error_and_the_model_stays():
    _, models, batches = H.cached_family("bert")
    model = copy.deepcopy(models[0])
    before = H.snapshot(model)
    # no such device here: no CUDA in this torch build, or no 65th GPU
    with pytest.raises(ValueError, match=r"^device cuda:64: cannot run the model there"):
        H.collect(model, list(batches[0]), device="cuda:64")
    assert H.same_state(model, before)
    assert next(model.parameters()).device.type == "cpu"


def test_backend_lmdx_needs_the_cpu_and_unknown_backends_are_refused():
    _, models, batches = H.cached_family("bert")
    with pytest.raises(ValueError, match=r"^backend: expected 'lmdx' or 'torch', got 'jax'"):
        H.collect(models[0], list(batches[0]), backend="jax")
    stats = H.collect(models[0], list(batches[0]), device="cpu", backend="lmdx")
    assert stats.accumulation == "mixed"
