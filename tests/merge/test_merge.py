"""lmdx.merge on tiny Hugging Face models against float64 NumPy references written here.

RegMean (Jin et al., 2023): with the Grams computed by this suite's own hooks
(tests/hf_models.py), Ĝ_i = G_i/n_i, G̃_i = α Ĝ_i + (1−α) diag(Ĝ_i) and

    W_Mᵀ = (Σ c_i G̃_i)⁻¹ Σ c_i G̃_i W_iᵀ        (Conv1D weights are [in, out]: no transpose)

solved with np.linalg.solve; every other parameter is the coefficient-weighted average,
task heads stay per model.

The end-to-end accuracy check runs on float64 models: their activations, and so the
Grams, are exact, and the merge must match to 1e-8 relative. On float32 models the core
accumulates float32 products in chunks (documented: within 1e-6 of float64, checked in
stats/test_collect.py); a RegMean solve with α = 1 amplifies that by cond(Σ G̃) (1e4–1e6 for
these tiny models), so there the merge is checked against the formula on the
statistics' own Grams, and against the independent Grams for α < 1 only.
"""

from __future__ import annotations

import copy
import json
import os
import re

import hf_models as H
import numpy as np
import pytest
import torch
import transformers
from hf_models import reference_average, reference_regmean
from hypothesis import given, settings
from hypothesis import strategies as st
from lmdx import MergeError, ModelMismatchError, merge_models, save_merged
from lmdx.files.hf import load_model
from lmdx.stats.collect import collect_regmean_stats
from lmdx.stats.fisher import collect_fisher

ALPHAS = (1.0, 0.9, 0.1)
COEFFICIENTS = (None, (0.5, 2.0, 1.25))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# --------------------------------------------------------------------------- references


def regmean_modules(model, arch):
    """Linear modules RegMean must solve: all of them except the task head."""
    return {
        n: lay
        for n, (_, lay) in H.linear_modules(model).items()
        if not H.is_head(f"{n}.weight", arch)
    }


def check_regmean(result, models, ref_grams, arch, alpha, coefficients, rtol):
    """Every body tensor of ``result`` against the float64 reference."""
    states = [H.state_arrays(m) for m in models]
    solved = regmean_modules(models[0], arch)
    assert set(result.report["layers"]) == set(solved)
    body = [n for n in states[0] if not H.is_head(n, arch)]
    assert set(result.state_dict) == set(body)
    for name in body:
        got = result.state_dict[name]
        assert got.dtype == models[0].state_dict()[name].dtype, name
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in solved:
            expected = reference_regmean(
                [r[module]["gram"] for r in ref_grams],
                [r[module]["count"] for r in ref_grams],
                [s[name] for s in states],
                alpha,
                coefficients,
                solved[module],
            )
        else:
            expected = reference_average([s[name] for s in states], coefficients)
        assert H.rel_err(got, expected) <= rtol, (name, H.rel_err(got, expected))
    for i, model in enumerate(models):  # each model keeps its own head, untouched
        heads = {n: t for n, t in model.state_dict().items() if H.is_head(n, arch)}
        assert heads and set(result.heads[i]) == set(heads)
        assert all(torch.equal(result.heads[i][n], t) for n, t in heads.items())


def _merge(models, method="regmean", arch="bert", **kwargs):
    # One thread: these layers are 16-32 wide, too small to gain from a second one
    # (test_regmean_float32_models runs the default thread count).
    kwargs.setdefault("n_threads", 1)
    return merge_models(models, method, heads=H.HEADS[arch], progress=False, **kwargs)


def _stats(models, batches, **kwargs):
    return [
        collect_regmean_stats(m, b, progress=False, **kwargs)
        for m, b in zip(models, batches, strict=True)
    ]


_CACHE = {}


def prepared(arch, dtype, include_padding):
    """Models, lmdx statistics and reference Grams, computed once per module."""
    key = (arch, dtype, include_padding)
    if key not in _CACHE:
        _, models, batches = H.cached_family(arch, dtype)
        stats = _stats(models, batches, include_padding=include_padding)
        refs = [
            H.reference_grams(m, list(b), include_padding)
            for m, b in zip(models, batches, strict=True)
        ]
        _CACHE[key] = (models, stats, refs)
    return _CACHE[key]


# --------------------------------------------------------------------------- RegMean


@pytest.mark.parametrize("include_padding", [False, True], ids=["pad-excluded", "pad-included"])
@pytest.mark.parametrize("arch", H.ARCHS)
def test_regmean_equals_the_paper_formula_float64_models(arch, include_padding):
    models, stats, refs = prepared(arch, "float64", include_padding)
    for alpha in ALPHAS:
        for coefficients in COEFFICIENTS:
            result = _merge(models, arch=arch, stats=stats, alpha=alpha, coefficients=coefficients)
            check_regmean(result, models, refs, arch, alpha, coefficients, rtol=1e-8)


@pytest.mark.parametrize("arch", H.ARCHS)
def test_regmean_float32_models(arch):
    models, stats, refs = prepared(arch, "float32", False)
    for alpha in ALPHAS:
        for coefficients in COEFFICIENTS:
            result = _merge(
                models,
                arch=arch,
                stats=stats,
                alpha=alpha,
                coefficients=coefficients,
                n_threads=None,
            )
            # the statistics' own float64 Grams: only the final float32 rounding differs
            own = [{m: {"gram": s.gram(m), "count": s.count(m)} for m in s.modules} for s in stats]
            check_regmean(result, models, own, arch, alpha, coefficients, rtol=1e-6)
            if alpha < 1.0:  # the independent Grams (see the module docstring for α = 1)
                check_regmean(result, models, refs, arch, alpha, coefficients, rtol=1e-6)


@pytest.mark.parametrize("arch", H.ARCHS)
def test_regmean_float32_models_float64_products(arch):
    """accumulation="float64": the Grams of float32 activations are exact, so even α = 1
    on these ill-conditioned tiny layers matches the independent reference."""
    _, models, batches = H.cached_family(arch, "float32")
    stats = _stats(models, batches, accumulation="float64")
    refs = [H.reference_grams(m, list(b), False) for m, b in zip(models, batches, strict=True)]
    for alpha in ALPHAS:
        result = _merge(models, arch=arch, stats=stats, alpha=alpha, coefficients=[1.0, 2.0, 0.5])
        check_regmean(result, models, refs, arch, alpha, [1.0, 2.0, 0.5], rtol=1e-6)


@settings(max_examples=8)
@given(
    alpha=st.floats(0.0, 1.0),
    coefficients=st.lists(st.floats(0.05, 4.0), min_size=3, max_size=3) | st.none(),
)
def test_regmean_drawn_alpha_and_coefficients(alpha, coefficients):
    models, stats, refs = prepared("llama", "float64", False)
    result = _merge(models, arch="llama", stats=stats, alpha=alpha, coefficients=coefficients)
    check_regmean(result, models, refs, "llama", alpha, coefficients, rtol=1e-8)


@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_shared_input_grams_give_the_same_merge(arch):
    _, models, batches = H.cached_family(arch, "float64")
    shared = _stats(models, batches, share_inputs=True)
    separate = _stats(models, batches, share_inputs=False)
    for alpha in (1.0, 0.5):
        a = _merge(models, arch=arch, stats=shared, alpha=alpha, coefficients=[1.0, 3.0, 0.5])
        b = _merge(models, arch=arch, stats=separate, alpha=alpha, coefficients=[1.0, 3.0, 0.5])
        for name, t in a.state_dict.items():
            assert H.rel_err(t, b.state_dict[name].numpy()) <= 1e-12, name
    layers = a.report["layers"]
    followers = {n: v["shared_with"] for n, v in layers.items() if v["shared_with"]}
    if arch == "bert":
        expect = {
            f"{lead}{x}": f"{lead}query"
            for lead in (
                "bert.encoder.layer.0.attention.self.",
                "bert.encoder.layer.1.attention.self.",
            )
            for x in ("key", "value")
        }
    else:
        expect = {
            f"model.layers.{i}.{a}": f"model.layers.{i}.{lead}"
            for i in range(2)
            for lead, follow in (
                ("self_attn.q_proj", ("self_attn.k_proj", "self_attn.v_proj")),
                ("mlp.gate_proj", ("mlp.up_proj",)),
            )
            for a in follow
        }
    assert followers == expect
    assert not any(v["shared_with"] for v in b.report["layers"].values())


def test_regmean_exclude_pattern_averages_those_modules():
    models, stats, refs = prepared("gpt2", "float64", False)
    result = _merge(models, arch="gpt2", stats=stats, alpha=0.9, exclude=["*.mlp.*"])
    states = [H.state_arrays(m) for m in models]
    assert not any(".mlp." in n for n in result.report["layers"])
    for name in ("transformer.h.0.mlp.c_fc.weight", "transformer.h.1.mlp.c_proj.weight"):
        expected = reference_average([s[name] for s in states], None)
        assert H.rel_err(result.state_dict[name], expected) <= 1e-12
    name = "transformer.h.0.attn.c_attn"
    expected = reference_regmean(
        [r[name]["gram"] for r in refs],
        [r[name]["count"] for r in refs],
        [s[f"{name}.weight"] for s in states],
        0.9,
        None,
        "conv1d",
    )
    assert H.rel_err(result.state_dict[f"{name}.weight"], expected) <= 1e-8


# --------------------------------------------------------------------------- other methods


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("arch", H.ARCHS)
def test_average_and_task_arithmetic(arch, dtype):
    base, models, _ = H.cached_family(arch, dtype)
    states = [H.state_arrays(m) for m in models]
    theta0 = H.state_arrays(base)
    rtol = 1e-12 if dtype == "float64" else 1e-6
    for coefficients in COEFFICIENTS:
        avg = _merge(models, "average", arch=arch, coefficients=coefficients)
        c = np.ones(3) if coefficients is None else np.asarray(coefficients)
        for scaling in (0.3, 1.0):
            ta = _merge(
                models,
                "task_arithmetic",
                arch=arch,
                base=base,
                scaling=scaling,
                coefficients=coefficients,
            )
            for name, got in ta.state_dict.items():
                delta = sum(ci * (s[name] - theta0[name]) for ci, s in zip(c, states, strict=True))
                expected = theta0[name] + scaling * delta
                assert got.dtype == models[0].state_dict()[name].dtype
                assert H.rel_err(got, expected) <= rtol, name
            assert ta.report["scaling"] == scaling
        for name, got in avg.state_dict.items():
            expected = reference_average([s[name] for s in states], coefficients)
            assert H.rel_err(got, expected) <= rtol, name
        assert set(avg.state_dict) == {n for n in states[0] if not H.is_head(n, arch)}


@pytest.mark.parametrize("coefficients", COEFFICIENTS)
def test_float32_average_is_the_float64_average_cast(coefficients):
    """The float32 tensors' average (one pass of the core into float32) is the float64
    average cast, bit for bit, and a NaN in any model, even one with coefficient 0, is
    named by tensor and model."""
    import lmdx

    _, models, _ = H.cached_family("bert", "float32")
    states = [m.state_dict() for m in models]
    avg = _merge(models, "average", arch="bert", coefficients=coefficients).state_dict
    for name, got in avg.items():
        want = lmdx.weighted_average([s[name] for s in states], coefficients).astype(np.float32)
        assert got.dtype == torch.float32 and np.array_equal(got.numpy(), want), name
    name = "bert.encoder.layer.0.output.LayerNorm.bias"
    bad = [copy.deepcopy(m) for m in models]
    with torch.no_grad():
        dict(bad[2].named_parameters())[name][1] = float("nan")
    with pytest.raises(MergeError, match=rf"^tensor '{re.escape(name)}' of model2 holds NaN"):
        _merge(bad, "average", arch="bert", coefficients=(1.0, 1.0, 0.0))


@pytest.mark.parametrize("include", [None, ["*.layer.1.*"]], ids=["all", "layer-1"])
def test_fisher_merge_equals_reference(include):
    arch = "bert"
    _, models, _ = H.cached_family(arch, "float64")
    data = [H.random_batches(arch, 30 + i, n_sequences=8, batch_size=4) for i in range(3)]
    stats = [
        collect_fisher(m, d, include=include, progress=False)
        for m, d in zip(models, data, strict=True)
    ]
    refs = [H.reference_fisher(m, d, gold=False) for m, d in zip(models, data, strict=True)]
    states = [H.state_arrays(m) for m in models]
    # ε = 1e-8 is the default; with ε = 1e-12 the Fisher values (1e-12..1e-6 here) dominate
    for coefficients, eps in ((None, None), ((0.5, 2.0, 1.0), 1e-12)):
        kwargs = {} if eps is None else {"fisher_eps": eps}
        eps = 1e-8 if eps is None else eps
        result = _merge(
            models, "fisher", arch=arch, stats=stats, coefficients=coefficients, **kwargs
        )
        c = np.ones(3) if coefficients is None else np.asarray(coefficients)
        for name, got in result.state_dict.items():
            if include is None or ".layer.1." in name:
                w = [ci * (f[name] / n + eps) for ci, (f, n) in zip(c, refs, strict=True)]
                expected = sum(wi * s[name] for wi, s in zip(w, states, strict=True)) / sum(w)
            else:
                expected = reference_average([s[name] for s in states], coefficients)
            assert H.rel_err(got, expected) <= 1e-6, name
    # the Fisher weighting matters: with small ε it is far from the plain average
    name = "bert.encoder.layer.1.output.dense.weight"
    plain = reference_average([s[name] for s in states], coefficients)
    assert H.rel_err(result.state_dict[name], plain) > 1e-3


# --------------------------------------------------------------------------- bad inputs


def test_models_of_different_architectures_are_refused():
    _, bert, _ = H.cached_family("bert")
    _, llama, _ = H.cached_family("llama")
    with pytest.raises(
        MergeError, match=re.escape("model1 has no tensor 'bert.embeddings.word_embeddings.weight'")
    ):
        merge_models([bert[0], llama[0]], "average", progress=False)
    wider = H.build_base("bert", intermediate_size=32)
    with pytest.raises(
        MergeError,
        match=re.escape(
            "tensor 'bert.encoder.layer.0.intermediate.dense.weight': shape (24, 16) in model0 "
            "but (32, 16) in model1"
        ),
    ):
        merge_models([bert[0], wider], "average", progress=False)


def test_differing_heads_need_heads_patterns():
    _, models, _ = H.cached_family("bert")
    five = H.build_base("bert", num_labels=5)
    body = {n: t for n, t in models[0].state_dict().items() if not n.startswith("classifier")}
    five.load_state_dict(body, strict=False)
    with pytest.raises(
        MergeError,
        match=r"tensor 'classifier\.weight'.*exclude differing task heads with "
        r"heads=\['classifier\.\*'\]\)$",
    ):
        merge_models([models[0], five], "average", progress=False)
    result = merge_models([models[0], five], "average", heads=["classifier.*"], progress=False)
    assert result.heads[1]["classifier.weight"].shape == (5, 16)


def first_difference(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return next(n for n in sorted(sa) if not torch.equal(sa[n], sb[n]))


def test_statistics_of_another_model_are_refused():
    models, stats, _ = prepared("bert", "float32", False)
    name = first_difference(models[0], models[1])
    with pytest.raises(
        ModelMismatchError,
        match=rf"do not belong to model1: parameter '{re.escape(name)}' has different values",
    ):
        _merge(list(models), stats=[stats[0], stats[0], stats[2]])
    _, llama_stats, _ = prepared("llama", "float32", False)
    with pytest.raises(
        ModelMismatchError,
        match=re.escape(
            "architecture LlamaForSequenceClassification (statistics) vs "
            "BertForSequenceClassification (model)"
        ),
    ):
        _merge(list(models), stats=[stats[0], stats[1], llama_stats[2]])


def test_wrong_statistics_kind_count_or_padding_are_refused():
    models, stats, _ = prepared("bert", "float32", False)
    data = H.random_batches("bert", 1, n_sequences=2)
    fisher = [collect_fisher(m, data, progress=False) for m in models]
    with pytest.raises(MergeError, match=r"stats\[0\] .*kind 'fisher', expected 'regmean-gram'"):
        _merge(models, stats=fisher)
    with pytest.raises(MergeError, match=r"stats\[0\] .*kind 'regmean-gram', expected 'fisher'"):
        _merge(models, "fisher", stats=stats)
    with pytest.raises(MergeError, match=r"^stats: 2 statistics for 3 models$"):
        _merge(models, stats=stats[:2])
    with pytest.raises(
        MergeError,
        match=r"^stats: method regmean needs regmean-gram statistics, one per model \(or set "
        r"surrogate to true and give base: a surrogate Gram from its task vector\)$",
    ):
        _merge(models)
    with pytest.raises(
        MergeError,
        match=r"^stats: method average takes no statistics \(Gram statistics given with "
        r"cost only report what each task pays\)$",
    ):
        _merge(models, "average", stats=stats)
    _, padded, _ = prepared("bert", "float32", True)
    with pytest.raises(MergeError, match="mix padding policies"):
        _merge(models, stats=[stats[0], padded[1], stats[2]])


def test_bad_options_are_refused():
    models, stats, _ = prepared("bert", "float32", False)
    with pytest.raises(MergeError, match="coefficients: 2 values for 3 models"):
        _merge(models, stats=stats, coefficients=[1.0, 2.0])
    with pytest.raises(MergeError, match="coefficients: must be finite, >= 0"):
        _merge(models, stats=stats, coefficients=[1.0, -1.0, 1.0])
    with pytest.raises(MergeError, match="alpha: must be in"):
        _merge(models, stats=stats, alpha=1.5)
    with pytest.raises(MergeError, match="method: expected one of"):
        _merge(models, "median")
    with pytest.raises(MergeError, match="need at least 2 models"):
        _merge(models[:1], "average")
    with pytest.raises(MergeError, match=r"^base: method task_arithmetic needs the pre-trained"):
        _merge(models, "task_arithmetic")


def test_nan_in_a_model_is_an_error_naming_the_tensor():
    _, models, _ = H.cached_family("bert")
    bad = copy.deepcopy(models[1])
    with torch.no_grad():
        bad.bert.embeddings.LayerNorm.weight[3] = float("nan")
    with pytest.raises(ValueError, match=re.escape("'bert.embeddings.LayerNorm.weight'")):
        _merge([models[0], bad, models[2]], "average")


def test_load_model_needs_a_config(tmp_path):
    with pytest.raises(MergeError, match=r"no config\.json"):
        load_model(tmp_path)


# --------------------------------------------------------------------------- saving


@pytest.fixture(scope="module")
def merged_bert():
    models, stats, _ = prepared("bert", "float32", False)
    before = [H.snapshot(m) for m in models]
    result = _merge(models, stats=stats, alpha=0.9)
    return models, before, result


def _loaded_state(folder, cls, **kwargs):
    return cls.from_pretrained(str(folder), **kwargs).state_dict()


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_save_merged_round_trip(arch, tmp_path):
    models, stats, _ = prepared(arch, "float32", False)
    before = [H.snapshot(m) for m in models]
    config_before = models[0].config.to_dict()
    result = _merge(models, arch=arch, stats=stats, alpha=0.9)
    out = save_merged(result, tmp_path / "merged", models[0], record={"note": "test"})
    assert sorted(os.listdir(tmp_path)) == ["merged"]
    assert sorted(os.listdir(out)) == [
        "README.md",
        "config.json",
        "heads",
        "lmdx_merge.json",
        "model.safetensors",
    ]
    state = _loaded_state(out, type(models[0]))
    expected = result.model_state(0)
    assert set(state) == set(expected)
    assert all(torch.equal(state[n], t) for n, t in expected.items())
    from safetensors.torch import load_file

    for i, model in enumerate(models):  # every model's own head, from the inputs
        heads = load_file(str(out / "heads" / f"{i}.safetensors"))
        own = {n: t for n, t in model.state_dict().items() if H.is_head(n, arch)}
        assert set(heads) == set(own) and all(torch.equal(heads[n], t) for n, t in own.items())
    record = json.loads((out / "lmdx_merge.json").read_text())
    assert record["report"]["method"] == "regmean" and record["report"]["alpha"] == 0.9
    assert record["head_policy"] == "keep" and record["note"] == "test"
    # the inputs are as they were
    assert all(H.same_state(m, b) for m, b in zip(models, before, strict=True))
    assert models[0].config.to_dict() == config_before


def test_save_merged_sharded_and_bfloat16(merged_bert, tmp_path):
    models, _, result = merged_bert
    out = save_merged(result, tmp_path / "m", models[0], max_shard_size=8000, dtype="bfloat16")
    files = sorted(os.listdir(out))
    shards = [f for f in files if re.fullmatch(r"model-\d{5}-of-\d{5}\.safetensors", f)]
    assert len(shards) >= 2 and "model.safetensors.index.json" in files
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == set(result.model_state(0))
    from safetensors import safe_open

    for shard in shards:
        with safe_open(str(out / shard), framework="pt") as f:
            for key in f.keys():
                assert f.get_slice(key).get_dtype() == "BF16", key
    state = _loaded_state(out, type(models[0]), dtype=torch.bfloat16)
    for name, t in result.model_state(0).items():
        assert state[name].dtype == torch.bfloat16
        assert torch.equal(state[name], t.to(torch.bfloat16)), name


def test_save_merged_drop_heads_saves_the_backbone(merged_bert, tmp_path):
    models, before, result = merged_bert
    out = save_merged(result, tmp_path / "m", models[0], head_policy="drop")
    assert "heads" not in os.listdir(out)
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertModel"]
    state = transformers.AutoModel.from_pretrained(str(out)).state_dict()
    expected = {n.removeprefix("bert."): t for n, t in result.state_dict.items()}
    assert set(state) == set(expected)
    assert all(torch.equal(state[n], t) for n, t in expected.items())
    assert all(H.same_state(m, b) for m, b in zip(models, before, strict=True))


def test_save_merged_refuses_an_existing_directory(merged_bert, tmp_path):
    models, _, result = merged_bert
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    with pytest.raises(MergeError, match="already exists; choose a new directory"):
        save_merged(result, out, models[0])
    assert os.listdir(out) == ["mine.txt"] and (out / "mine.txt").read_text() == "keep me"
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_failed_save_leaves_nothing_behind(merged_bert, tmp_path):
    models, _, result = merged_bert
    _, llama, _ = H.cached_family("llama")
    out = tmp_path / "out"
    with pytest.raises(Exception) as info:  # the type is checked below
        save_merged(result, out, llama[0])
    assert not out.exists() and os.listdir(tmp_path) == []
    assert isinstance(info.value, MergeError), repr(info.value)[:300]
    assert re.search("do not fit the template|have no merged value", str(info.value))
    for kwargs, message in (
        ({"head_policy": "first"}, "^head_policy: must be keep or drop, got 'first'$"),
        ({"dtype": "int8"}, "^dtype: must be auto/float32/bfloat16/float16, got 'int8'$"),
        ({"max_shard_size": "big"}, "^max_shard_size: must be a size such as '2GB'"),
        ({"alpha": 0.9}, r"^unknown option 'alpha'; the options of writing a folder are \["),
    ):
        with pytest.raises(MergeError, match=message):
            save_merged(result, out, models[0], **kwargs)
        assert os.listdir(tmp_path) == []


def test_merge_from_model_folders(merged_bert, tmp_path):
    models, _, _ = merged_bert
    folders = []
    for i, m in enumerate(models):
        m.save_pretrained(str(tmp_path / f"m{i}"))
        folders.append(tmp_path / f"m{i}")
    states = [H.state_arrays(m) for m in models]
    result = merge_models(
        folders, "average", heads=H.HEADS["bert"], coefficients=[1, 2, 3], progress=False
    )
    assert result.report["models"] == [str(f) for f in folders]
    for name, got in result.state_dict.items():
        assert H.rel_err(got, reference_average([s[name] for s in states], [1, 2, 3])) <= 1e-6


def test_tied_weights_are_averaged_and_stay_tied():
    """GPT-2's lm_head shares wte's storage: RegMean must not solve it apart from wte."""
    cfg = transformers.GPT2Config(
        n_embd=16, n_layer=1, n_head=2, vocab_size=H.VOCAB, n_positions=32
    )
    torch.manual_seed(0)
    base = transformers.GPT2LMHeadModel(cfg).eval()
    models = [H.finetuned(base, seed) for seed in (1, 2)]
    assert all(m.lm_head.weight.data_ptr() == m.transformer.wte.weight.data_ptr() for m in models)
    ids = torch.randint(0, H.VOCAB, (4, 12))
    batches = [[{"input_ids": ids, "attention_mask": torch.ones_like(ids)}]] * 2
    stats = _stats(models, batches)
    result = merge_models(models, "regmean", stats=stats, progress=False, n_threads=1)
    wte = [m.transformer.wte.weight.detach().double().numpy() for m in models]
    ref = (wte[0] + wte[1]) / 2
    assert H.rel_err(result.state_dict["transformer.wte.weight"], ref) <= 1e-7
    assert torch.equal(
        result.state_dict["lm_head.weight"], result.state_dict["transformer.wte.weight"]
    )
    assert "lm_head" not in result.report["layers"]
    assert result.report["tied"] == {"lm_head.weight": "transformer.wte.weight"}
