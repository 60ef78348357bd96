"""TIES, DARE and DARE-TIES against float64 NumPy references written here.

Task vectors τ_i = θ_i − θ_base (float64), coefficients c_i (default 1), λ = ``scaling``:

* TIES (Yadav et al., 2023; mergekit's ``ties``): per tensor and model keep the
  ``int(density × numel)`` entries of largest |τ_i| (ties at the threshold: lowest flat
  index first; here found with a stable sort, not the partition lmdx uses), elect per
  entry the sign of Σ c_i τ̂_i (+ at 0), average the c_i τ̂_i that are non-zero with that
  sign dividing by the sum of their c_i (0 where none agrees): θ_base + λ × that.
* DARE (Yu et al., 2024): keep each entry of τ_i with probability ``density`` and divide
  the kept ones by ``density``, then task arithmetic θ_base + λ Σ c_i τ̃_i. The drops of
  model i's tensor ``name`` are the documented draws: PCG64 seeded by
  ``SeedSequence([seed, i, *SHA-256(name) as 8 little-endian uint32])``, kept where
  ``random() < density`` -- re-derived here from that description. Their statistics
  (fraction kept, rescale) are also checked without it.
* DARE-TIES: DARE's drop and rescale, then TIES's election and mean.
"""

from __future__ import annotations

import copy

import hf_models as H
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
from lmdx import MergeError, load_merged, merge_models, save_merged
from lmdx.merge import stream_merge
from lmdx.merge.builtin.task_vectors import dare_keep, top_k_magnitude
from lmdx.merge.method import MergeInputs
from lmdx.merge.registry import merge_options, method_named
from lmdx.merge.source import StateDictSource
from task_vectors import ref_merge, ref_top_k, task_tensors

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _options(method, k, **kwargs):
    return merge_options(k, method, kwargs)


def task_vector_tensor(name, base, thetas, options):
    """Tensor ``name`` merged by ``options.method``'s arithmetic (its ``tensor``)."""
    method = method_named(options.method)
    source = StateDictSource({name: torch.as_tensor(base)}, "base")
    inputs = MergeInputs(method, options, [], [], base=source)
    return method.tensor(name, thetas, inputs)


# --------------------------------------------------------------------------- one tensor


@given(
    tau=hnp.arrays(
        np.float64,
        hnp.array_shapes(min_dims=0, max_dims=3, max_side=9),
        elements=st.integers(-4, 4).map(float),  # few values: many ties at the threshold
    ),
    density=st.floats(0.01, 1.0),
)
def test_top_k_keeps_the_largest_magnitudes_lowest_index_first_at_ties(tau, density):
    got = top_k_magnitude(tau, density)
    assert got.shape == tau.shape
    np.testing.assert_array_equal(got, ref_top_k(tau, density))
    assert np.count_nonzero(got) <= int(density * tau.size)


def test_top_k_counts_int_density_times_numel_as_mergekit():
    tau = np.arange(1.0, 101.0)
    assert np.count_nonzero(top_k_magnitude(tau, 0.29)) == int(0.29 * 100) == 28
    np.testing.assert_array_equal(top_k_magnitude(tau, 0.29)[-28:], tau[-28:])
    assert not top_k_magnitude(np.arange(1.0, 4.0), 0.2).any()  # int(0.6) = 0: nothing kept
    assert top_k_magnitude(tau, 1.0) is tau


@given(
    data=task_tensors(max_dims=3, max_side=7, weights=[0.0, 0.5, 1.0, 2.0, 3.0]),
    method=st.sampled_from(["ties", "dare", "dare_ties", "task_arithmetic"]),
    density=st.sampled_from([0.1, 0.3, 0.5, 0.77, 1.0]),
    scaling=st.sampled_from([0.3, 1.0, -0.5]),
    seed=st.integers(0, 2**64),
)
def test_one_tensor_equals_the_reference(data, method, density, scaling, seed):
    base, thetas, coef = data
    kwargs = {"coefficients": coef, "scaling": scaling}
    if method != "task_arithmetic":
        kwargs["density"] = density
    if method in ("dare", "dare_ties"):
        kwargs["seed"] = seed
    options = _options(method, len(thetas), **kwargs)
    got = task_vector_tensor("layer.weight", base, thetas, options)
    d = density if method != "task_arithmetic" else 1.0
    expected = ref_merge(method, "layer.weight", base, thetas, coef, d, scaling, seed)
    np.testing.assert_allclose(got, expected, rtol=1e-13, atol=1e-13)
    # torch tensors in, the same bits out
    as_torch = task_vector_tensor(
        "layer.weight", torch.from_numpy(base), [torch.from_numpy(t) for t in thetas], options
    )
    np.testing.assert_array_equal(as_torch, got)


def test_sign_election_uses_the_coefficients_and_ties_elect_plus():
    base = np.zeros(4)
    thetas = [np.array([1.0, 1.0, 2.0, 0.0]), np.array([-3.0, -1.0, -2.0, 0.0])]
    ties = _options("ties", 2, density=1.0, scaling=1.0)
    # Σ τ: -2 (elect −), 0 (elect +), 0 (elect +), 0 (no model agrees: 0)
    np.testing.assert_array_equal(task_vector_tensor("w", base, thetas, ties), [-3, 1, 2, 0])
    weighted = _options("ties", 2, density=1.0, scaling=2.0, coefficients=[4.0, 1.0])
    # Σ c τ: 1 (+: model 0 alone, c τ / c = 1), 3 (+), 6 (+), 0 -> × λ = 2
    np.testing.assert_array_equal(task_vector_tensor("w", base, thetas, weighted), [2, 2, 4, 0])
    zero = _options("ties", 2, density=1.0, scaling=1.0, coefficients=[0.0, 1.0])
    # a model with c = 0 never agrees (its c τ is 0)
    np.testing.assert_array_equal(task_vector_tensor("w", base, thetas, zero), [-3, -1, -2, 0])


def test_dare_keeps_density_of_the_entries_rescaled():
    base = np.linspace(-1.0, 1.0, 200_000).reshape(400, 500)
    tau = np.cos(np.arange(base.size)).reshape(base.shape) + 2.0  # no zeros
    for density in (0.1, 0.5, 0.9):
        # model 1 equals the base: the merge shows model 0's dropped task vector alone
        got = task_vector_tensor(
            "enc.w",
            base,
            [base + tau, base],
            _options("dare", 2, density=density, scaling=1.0, seed=3),
        )
        kept = got != base
        fraction = kept.mean()
        sigma = np.sqrt(density * (1 - density) / base.size)
        assert abs(fraction - density) < 5 * sigma, (density, fraction)
        np.testing.assert_allclose((got - base)[kept], tau[kept] / density, rtol=1e-12)
        # rows and columns are all dropped alike (no structure in the draws)
        assert abs(kept.mean(axis=0) - density).max() < 6 * np.sqrt(density / 400)
    a = dare_keep("enc.w", 0, (1000,), 0.5, 3)
    assert not np.array_equal(a, dare_keep("enc.w", 1, (1000,), 0.5, 3))  # per model
    assert not np.array_equal(a, dare_keep("enc.v", 0, (1000,), 0.5, 3))  # per tensor
    assert not np.array_equal(a, dare_keep("enc.w", 0, (1000,), 0.5, 4))  # per seed
    np.testing.assert_array_equal(a, dare_keep("enc.w", 0, (1000,), 0.5, 3))


def test_non_finite_task_vectors_are_named_not_dropped():
    base = np.zeros(8)
    bad = np.ones(8)
    bad[5] = np.nan
    for method in ("ties", "dare", "dare_ties"):
        options = _options(method, 2, density=0.5)
        with pytest.raises(MergeError, match=r"tensor 'x\.w': the task vector of model 1"):
            task_vector_tensor("x.w", base, [np.ones(8), bad], options)


# --------------------------------------------------------------------------- models

METHODS = ("ties", "dare", "dare_ties")
CASES = [
    ("ties", {"density": 0.3}),
    ("ties", {"density": 0.2, "scaling": 0.8, "coefficients": (0.5, 2.0, 1.25)}),
    ("dare", {"density": 0.4, "seed": 11}),
    ("dare", {"density": 0.7, "scaling": 0.5, "coefficients": (1.0, 0.0, 2.0), "seed": 0}),
    ("dare_ties", {"density": 0.5, "seed": 5, "coefficients": (0.5, 2.0, 1.25)}),
]
DEFAULTS = {
    "ties": {"density": 0.2, "scaling": 1.0},
    "dare": {"density": 0.5, "scaling": 0.3, "seed": 0},
    "dare_ties": {"density": 0.5, "scaling": 1.0, "seed": 0},
}


def _merge(models, method, arch, **kwargs):
    return merge_models(models, method, heads=H.HEADS[arch], progress=False, **kwargs)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize(("method", "options"), CASES)
@pytest.mark.parametrize("arch", H.ARCHS)
def test_models_equal_the_reference(arch, method, options, dtype):
    base, models, _ = H.cached_family(arch, dtype)
    before = [H.snapshot(m) for m in (base, *models)]
    result = _merge(models, method, arch, base=base, **options)
    states = [H.state_arrays(m) for m in models]
    theta0 = H.state_arrays(base)
    body = [n for n in states[0] if not H.is_head(n, arch)]
    assert set(result.state_dict) == set(body)
    settings = {**DEFAULTS[method], **options}
    rtol = 1e-12 if dtype == "float64" else 1e-6
    for name in body:
        got = result.state_dict[name]
        source = models[0].state_dict()[name]
        assert got.dtype == source.dtype, name
        if not source.is_floating_point():  # buffers such as position ids: copied
            assert torch.equal(got, source), name
            continue
        expected = ref_merge(
            method,
            name,
            theta0[name],
            [s[name] for s in states],
            settings.get("coefficients"),
            settings["density"],
            settings["scaling"],
            settings.get("seed", 0),
        )
        assert H.rel_err(got, expected) <= rtol, (name, H.rel_err(got, expected))
    for i, model in enumerate(models):  # every model keeps its own head, untouched
        head = {n: t for n, t in model.state_dict().items() if H.is_head(n, arch)}
        assert set(result.heads[i]) == set(head)
        assert all(torch.equal(result.heads[i][n], t) for n, t in head.items())
    assert all(H.same_state(m, b) for m, b in zip((base, *models), before, strict=True))
    report = result.report
    assert {k: report[k] for k in DEFAULTS[method]} == {k: settings[k] for k in DEFAULTS[method]}


@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_dare_density_1_is_task_arithmetic_bit_for_bit(arch):
    base, models, _ = H.cached_family(arch)
    for coefficients, scaling in ((None, None), ((0.5, 2.0, 1.25), 0.7)):
        kw = {"base": base, "coefficients": coefficients, "scaling": scaling}
        ta = _merge(models, "task_arithmetic", arch, **kw)
        dare = _merge(models, "dare", arch, density=1.0, seed=9, **kw)
        assert ta.state_dict.keys() == dare.state_dict.keys()
        assert all(torch.equal(ta.state_dict[n], dare.state_dict[n]) for n in ta.state_dict)
        # and DARE-TIES at density 1 is TIES keeping everything
        ties = _merge(models, "ties", arch, density=1.0, **kw)
        dare_ties = _merge(models, "dare_ties", arch, density=1.0, **kw)
        assert all(torch.equal(ties.state_dict[n], dare_ties.state_dict[n]) for n in ta.state_dict)


@pytest.mark.parametrize("method", ["dare", "dare_ties"])
def test_same_seed_same_bits_other_seed_other_bits(method):
    base, models, _ = H.cached_family("bert")
    runs = [_merge(models, method, "bert", base=base, seed=s) for s in (7, 7, 8)]
    same = runs[0].state_dict, runs[1].state_dict
    assert all(torch.equal(same[0][n], same[1][n]) for n in same[0])
    other = runs[2].state_dict
    name = "bert.encoder.layer.0.attention.self.query.weight"
    assert not torch.equal(same[0][name], other[name])
    # a tensor's drops do not depend on the other tensors or the order of the steps
    states = [{name: m.state_dict()[name]} for m in (base, *models)]
    alone = merge_models(states[1:], method, base=states[0], seed=7, progress=False)
    assert torch.equal(alone.state_dict[name], same[0][name])


def test_tied_weights_stay_tied():
    import transformers

    cfg = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=H.VOCAB)
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(cfg).eval()
    models = [H.finetuned(base, seed) for seed in (1, 2)]
    for method in METHODS:
        result = merge_models(models, method, base=base, density=0.5, progress=False)
        sd = result.state_dict
        assert sd["lm_head.weight"] is sd["transformer.wte.weight"]
        assert result.report["tied"] == {"lm_head.weight": "transformer.wte.weight"}


def test_merged_model_reloads_and_predicts_like_the_reference(tmp_path):
    base, models, batches = H.cached_family("bert")
    result = _merge(models, "ties", "bert", base=base, density=0.3)
    folder = save_merged(result, tmp_path / "ties", models[0], progress=False)
    merged = load_merged(folder, task=1, progress=False)
    assert type(merged) is type(models[1])
    # model 1 with the reference merge of its body, assembled here
    by_hand = copy.deepcopy(models[1])
    states = [H.state_arrays(m) for m in models]
    theta0 = H.state_arrays(base)
    with torch.no_grad():
        for name, t in by_hand.state_dict().items():
            if H.is_head(name, "bert") or not t.is_floating_point():
                continue
            ref = ref_merge("ties", name, theta0[name], [s[name] for s in states], None, 0.3, 1.0)
            t.copy_(torch.from_numpy(ref))
    batch = batches[1][0]
    with torch.no_grad():
        got = merged(**batch).logits
        expected = by_hand(**batch).logits
    assert got.shape == (batch["input_ids"].shape[0], H.NUM_LABELS)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------- streaming


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("ties-dare")
    base, models, _ = H.cached_family("bert")
    paths = []
    for i, m in enumerate(models):
        m.save_pretrained(root / f"m{i}", max_shard_size=6000)
        paths.append(root / f"m{i}")
    base.save_pretrained(root / "base")
    return {"models": paths, "base": root / "base"}


def test_plan_counts_the_k_task_vectors(folders, tmp_path):
    for method in ("task_arithmetic", *METHODS):
        plan = stream_merge(
            folders["models"],
            tmp_path / "never",
            method,
            base=folders["base"],
            heads=H.HEADS["bert"],
            dry_run=True,
            progress=False,
        ).plan
        kinds = {s.kind for s in plan.steps}
        assert kinds == {method, "copy"} or kinds == {method}, kinds
        assert f" {method}" in plan.describe()
        k = len(folders["models"])
        for step in plan.steps:
            if step.kind != method:
                continue
            n = int(np.prod(plan_shape(plan, step.tensors[0])))
            held = k if method in ("ties", "dare_ties") else 1  # task vectors held at once
            assert step.memory >= 8 * n * (held + 2) + (k + 1) * 4 * n, step


def plan_shape(plan, name):
    return next(o.shape for o in plan.outputs if o.source == name)


def test_errors_are_one_line(folders):
    models, base = folders["models"], folders["base"]
    cases = [
        ({"method": "ties"}, "^base: method ties needs the pre-trained model"),
        ({"method": "ties", "base": base, "density": 0.0}, r"density: must be in \(0, 1\]"),
        ({"method": "dare", "base": base, "density": 1.5}, r"density: must be in \(0, 1\]"),
        ({"method": "dare", "base": base, "density": float("nan")}, "density: must be in"),
        ({"method": "dare", "base": base, "seed": -1}, "seed: must be a whole number >= 0"),
        ({"method": "dare", "base": base, "seed": 1.5}, "seed: must be a whole number"),
        ({"method": "dare", "base": base, "seed": True}, "seed: must be a whole number"),
        ({"method": "ties", "base": base, "seed": 1}, "seed: only used by dare, dare_ties"),
        ({"method": "average", "density": 0.5}, "density: only used by ties, dare, dare_ties"),
        ({"method": "average", "scaling": 0.5}, "scaling: only used by task_arithmetic"),
        (
            {"method": "ties", "base": base, "scaling": float("inf")},
            "scaling: input should be a finite number",
        ),
        (
            {"method": "average", "base": base},
            r"base: used by LoRA adapters .* and by task_arithmetic, ties, dare, dare_ties, "
            r"breadcrumbs, .*, wudi, not by average",
        ),
    ]
    for kwargs, match in cases:
        with pytest.raises(MergeError, match=match) as info:
            merge_models(models, progress=False, **kwargs)
        assert "\n" not in str(info.value)
