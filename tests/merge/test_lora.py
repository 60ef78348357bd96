"""PEFT LoRA adapters as merge inputs: the adapted weights, statistics of base + adapter,
RegMean on the low-rank structure, and the merged update written back as a LoRA.

References are computed here in float64 NumPy: the RegMean formula with
``numpy.linalg.solve``, the adapted weights by PEFT's own ``merge_and_unload``, Grams by
this suite's forward hooks (hf_models.reference_grams), truncated SVDs with
``numpy.linalg.svd``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import hf_models as H
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from lmdx import (
    MergeError,
    ModelMismatchError,
    RegularizationWarning,
    merge_models,
    regmean_merge_layer,
    save_merged,
    stream_merge,
)
from lmdx.files.checkpoint import Checkpoint
from lmdx.files.peft import LoraAdapter
from lmdx.merge.builtin.regmean import low_rank_inputs, regmean_low_rank, solve_group_low_rank
from lmdx.merge.builtin.regmean_solve import solve_group
from lmdx.merge.config import load_merge_config, run_merge
from lmdx.merge.options import MergeOptions
from lmdx.merge.registry import merge_options
from lmdx.merge.source import AdapterSource
from lmdx.stats import Statistics
from lmdx.stats.packing import pack_upper
from safetensors.numpy import load_file

peft = pytest.importorskip("peft")

pytestmark = [
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
    pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers` to `True`:UserWarning"),
    pytest.mark.usefixtures("one_torch_thread"),
]

K = 3
TARGETS = {
    "bert": ["query", "value", "dense"],
    "gpt2": ["c_attn", "c_fc"],
    "llama": ["q_proj", "v_proj", "gate_proj", "embed_tokens"],
}
#: Each adapter's own settings: ranks, alphas, rsLoRA, patterns and biases differ.
SETTINGS = [
    {"r": 2, "lora_alpha": 4, "bias": "lora_only", "rank_pattern": {"value": 3}},
    {"r": 3, "lora_alpha": 2, "use_rslora": True},
    {"r": 4, "lora_alpha": 8, "alpha_pattern": {"dense": 2.5}},
]


def build_adapters(arch: str, root: Path, k: int = K, seed: int = 0) -> dict[str, Any]:
    """A float64 base (saved) and ``k`` PEFT LoRA adapters of it with nonzero factors
    (saved), each with its statistics collected on base + adapter (saved)."""
    from peft import LoraConfig, get_peft_model

    base = H.build_base(arch, seed).double()
    base.save_pretrained(root / "base")
    out: dict[str, Any] = {"base": base, "base_dir": root / "base", "adapters": [], "stats": []}
    out["peft"] = []
    for i in range(k):
        settings = dict(SETTINGS[i % len(SETTINGS)])
        if arch != "bert":
            settings.pop("rank_pattern", None)
            settings.pop("alpha_pattern", None)
        config = LoraConfig(
            target_modules=TARGETS[arch],
            task_type="SEQ_CLS",
            fan_in_fan_out=arch == "gpt2",
            **settings,
        )
        model = get_peft_model(copy.deepcopy(base), config)
        gen = torch.Generator().manual_seed(100 * seed + i)
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.add_(0.2 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        model.eval()
        model.save_pretrained(root / f"adapter{i}")
        stats = H.collect(model, H.random_batches(arch, 10 + i))
        stats.save(root / f"stats{i}.safetensors")
        out["adapters"].append(root / f"adapter{i}")
        out["stats"].append(root / f"stats{i}.safetensors")
        out["peft"].append(model)
    return out


@pytest.fixture(scope="module")
def families(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return {
        arch: build_adapters(arch, tmp_path_factory.mktemp(f"lora-{arch}"))
        for arch in ("bert", "gpt2", "llama")
    }


def _merged_by_peft(fam: dict[str, Any], i: int) -> dict[str, torch.Tensor]:
    """PEFT's own merge of adapter i into a copy of the base."""
    from peft import PeftModel

    model = PeftModel.from_pretrained(copy.deepcopy(fam["base"]), str(fam["adapters"][i]))
    return {n: t.detach().clone() for n, t in model.merge_and_unload().state_dict().items()}


def _sources(fam: dict[str, Any]) -> list[AdapterSource]:
    base = Checkpoint(fam["base_dir"], "base")
    return [
        AdapterSource(base, LoraAdapter.load(a), f"adapter{i}")
        for i, a in enumerate(fam["adapters"])
    ]


# --------------------------------------------------------------------------- the formula


def _regmean_reference(grams, counts, weights, alpha, coefficients, ridge):
    """W_Mᵀ = W̄ᵀ + (S̃ + λI)⁻¹ Σ c_i G̃_i (W_i − W̄)ᵀ, λ = ridge · mean diag S̃ (float64)."""
    coef = np.ones(len(grams)) if coefficients is None else np.asarray(coefficients, float)
    reduced = []
    for g, n in zip(grams, counts, strict=True):
        gh = g / n
        reduced.append(alpha * gh + (1 - alpha) * np.diag(np.diag(gh)))
    mean = sum(c * w for c, w in zip(coef, weights, strict=True)) / coef.sum()
    lhs = sum(c * g for c, g in zip(coef, reduced, strict=True))
    lhs = lhs + ridge * np.mean(np.diag(lhs)) * np.eye(lhs.shape[0])
    rhs = sum(c * g @ (w - mean).T for c, g, w in zip(coef, reduced, weights, strict=True))
    return mean + np.linalg.solve(lhs, rhs).T


@st.composite
def _layers(draw):
    d_in = draw(st.integers(2, 14))
    d_out = draw(st.integers(1, 12))
    k = draw(st.integers(2, 4))
    ranks = draw(st.lists(st.integers(0, 4), min_size=k, max_size=k))
    alpha = draw(st.sampled_from([0.0, 0.3, 0.9, 1.0]))
    coefficients = draw(
        st.none() | st.lists(st.sampled_from([0.0, 0.5, 1.0, 2.0]), min_size=k, max_size=k)
    )
    if coefficients is not None and sum(coefficients) == 0:
        coefficients[0] = 1.0
    ridge = draw(st.sampled_from([0.0, 1e-3]))
    packed = draw(st.booleans())
    seed = draw(st.integers(0, 2**31 - 1))
    return d_in, d_out, ranks, alpha, coefficients, ridge, packed, seed


@given(_layers())
def test_low_rank_regmean_equals_the_dense_formula(layer):
    d_in, d_out, ranks, alpha, coefficients, ridge, packed, seed = layer
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((d_out, d_in))
    grams, counts, factors, weights = [], [], [], []
    for r in ranks:
        x = rng.standard_normal((3 * d_in + 2, d_in)) * rng.uniform(0.3, 3.0, d_in)
        grams.append(x.T @ x)
        counts.append(float(x.shape[0]))
        b, a = rng.standard_normal((d_out, r)), rng.standard_normal((r, d_in)) * 0.1
        factors.append((b, a))
        weights.append(base + b @ a)
    given_grams = [pack_upper(g) if packed or i == 0 else g for i, g in enumerate(grams)]
    merged, (b_all, a_all), info = regmean_low_rank(
        given_grams, counts, base, factors, alpha=alpha, coefficients=coefficients, ridge=ridge
    )
    expected = _regmean_reference(grams, counts, weights, alpha, coefficients, ridge)
    scale = np.abs(expected).max()
    assert np.abs(merged - expected).max() <= 1e-10 * scale
    dense = regmean_merge_layer(
        grams, weights, counts, alpha=alpha, coefficients=coefficients, ridge=ridge,
        precision="float64",
    )  # fmt: skip
    assert np.abs(merged - dense.weight).max() <= 1e-10 * scale
    assert np.abs(base + b_all @ a_all - merged).max() <= 1e-12 * scale
    used = [r for r, c in zip(ranks, coefficients or [1.0] * len(ranks), strict=True) if c > 0]
    if info["precision"] == "identical":
        assert dense.info.precision == "identical"
        assert np.array_equal(merged, dense.weight)
    else:
        assert b_all.shape[1] == info["rank"] == sum(used)
        assert info["ridge"] == dense.info.ridge


def test_unseen_inputs_keep_the_average_as_in_the_dense_merge(rng):
    """A never-active input feature: the solver raises the ridge; the low-rank path gives
    what the dense merge gives (the average along that feature)."""
    d_in, d_out = 6, 5
    base = rng.standard_normal((d_out, d_in))
    grams, factors, weights = [], [], []
    for _ in range(3):
        x = rng.standard_normal((20, d_in))
        x[:, 2] = 0.0
        grams.append(x.T @ x)
        b, a = rng.standard_normal((d_out, 2)), rng.standard_normal((2, d_in))
        factors.append((b, a))
        weights.append(base + b @ a)
    counts = [20.0] * 3
    with pytest.warns(RegularizationWarning):
        dense = regmean_merge_layer(grams, weights, counts, precision="float64")
    with pytest.warns(RegularizationWarning):
        merged, _, info = regmean_low_rank(grams, counts, base, factors)
    assert info["ridge"] == dense.info.ridge > 0
    assert np.abs(merged - dense.weight).max() <= 1e-8 * np.abs(dense.weight).max()
    mean = sum(weights) / 3
    assert np.allclose(merged[:, 2], mean[:, 2], rtol=1e-6, atol=1e-8)


def test_identical_adapters_come_back_exactly(rng):
    base = rng.standard_normal((4, 5))
    b, a = rng.standard_normal((4, 2)), rng.standard_normal((2, 5))
    grams = [np.eye(5) * (i + 1) for i in range(3)]
    merged, factors, info = regmean_low_rank(grams, [1.0] * 3, base, [(b, a)] * 3)
    assert info["precision"] == "identical" and factors == (b, a)
    assert np.array_equal(merged, base + b @ a)


# --------------------------------------------------------------------------- adapters


@pytest.mark.parametrize("arch", ["bert", "gpt2", "llama"])
def test_adapted_weights_are_what_peft_merges(families, arch):
    """Every tensor of base + adapter as lmdx reads it equals PEFT's merge_and_unload
    (rank and alpha patterns, rsLoRA, trained biases, modules_to_save heads, Conv1D and
    embedding updates)."""
    fam = families[arch]
    for i, src in enumerate(_sources(fam)):
        peft_state = _merged_by_peft(fam, i)
        assert set(src.names()) <= set(peft_state)
        touched = set(src.adapter.targets) | set(src.adapter.overrides)
        assert touched, "the adapter changes nothing"
        for name in src.names():
            ours = np.asarray(torch.as_tensor(src.read(name)).double().numpy())
            theirs = peft_state[name].double().numpy()
            assert np.abs(ours - theirs).max() <= 1e-12 * max(np.abs(theirs).max(), 1.0), name
            if name not in touched:
                assert src.digest(name) == src.base.digest(name)


@pytest.mark.parametrize("arch", ["bert", "gpt2", "llama"])
def test_statistics_of_base_plus_adapter(families, arch):
    """Module names are the base model's; the Grams are those of the adapted model; the
    identity records the base's tensors and the adapter."""
    fam = families[arch]
    stats = Statistics.load(fam["stats"][1])
    base_modules = {n for n in H.linear_modules(fam["base"])}
    assert set(stats.modules) <= base_modules
    assert not any("lora" in m or "base_layer" in m for m in stats.modules)
    merged = H.build_base(arch).double()
    merged.load_state_dict(_merged_by_peft(fam, 1))
    ref = H.reference_grams(merged, H.random_batches(arch, 11), include_padding=False)
    for module in stats.modules:
        g = ref[module]["gram"]
        assert stats.count(module) == ref[module]["count"]
        assert np.abs(stats.gram(module) - g).max() <= 1e-10 * np.abs(g).max(), module
    src = _sources(fam)[1]
    assert stats.model["adapter"]["sha256"] == src.adapter.identity()["sha256"]
    params = stats.model["parameters"]
    assert set(params) >= set(src.names())
    for name in src.names():
        assert params[name]["blake3"] == src.digest(name), name


def test_fisher_of_a_peft_model_is_refused(families):
    from lmdx import collect_fisher

    with pytest.raises(MergeError, match="PEFT LoRA model"):
        collect_fisher(families["bert"]["peft"][0], H.random_batches("bert", 1), progress=False)


# --------------------------------------------------------------------------- merging


def _options(**kwargs: Any) -> MergeOptions:
    return merge_options(K, "regmean", kwargs)


@pytest.mark.parametrize("arch", ["bert", "gpt2", "llama"])
def test_every_low_rank_layer_equals_the_dense_merge(families, tmp_path, arch):
    """The merged folder's RegMean layers, solved on the factors, equal the dense solve of
    the adapted weights (float64 products) to 1e-10; one layer also equals the formula
    on PEFT's merged weights and this suite's own Grams."""
    fam = families[arch]
    res = stream_merge(
        fam["adapters"], tmp_path / "out", "regmean", stats=fam["stats"], base=fam["base_dir"],
        alpha=0.9, heads=H.HEADS[arch], progress=False,
    )  # fmt: skip
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    sources = _sources(fam)
    stats = [Statistics.load(s) for s in fam["stats"]]
    options = _options(alpha=0.9, precision="float64", heads=H.HEADS[arch])
    labels = [s.label for s in sources]
    steps = [s for s in res.plan.steps if s.kind == "regmean"]
    assert steps
    low = 0
    for step in steps:
        factors = low_rank_inputs(step, sources)
        weights = [[src.read(w) for w in step.tensors] for src in sources]
        grams = [s.gram_stored(step.modules[0]) for s in stats]
        dense, _ = solve_group(step.modules, weights, grams, stats, labels, options)
        assert factors is not None, step.modules
        ours, _, layers = solve_group_low_rank(step, sources, factors, stats, labels, options)
        low += layers[step.modules[0]]["low_rank"] > 0
        for w in step.tensors:
            scale = np.abs(dense[w]).max()
            assert np.abs(ours[w] - dense[w]).max() <= 1e-10 * scale, w
            assert np.array_equal(written[w], ours[w]), w
            assert (
                res.report["layers"][step.modules[0]]["low_rank"]
                == layers[step.modules[0]]["low_rank"]
            )
    assert low > 0
    # one adapted layer against the formula on PEFT's merged weights and this suite's Grams
    step = next(s for s in steps if any(w in sources[0].adapter.targets for w in s.tensors))
    module, w = step.modules[0], step.tensors[0]
    layout = step.layout
    grams, counts, weights = [], [], []
    for i in range(K):
        merged = H.build_base(arch).double()
        merged.load_state_dict(_merged_by_peft(fam, i))
        ref = H.reference_grams(merged, H.random_batches(arch, 10 + i), include_padding=False)
        grams.append(ref[module]["gram"])
        counts.append(ref[module]["count"])
        weight = merged.state_dict()[w].numpy()
        weights.append(weight if layout == "linear" else weight.T)
    expected = _regmean_reference(grams, counts, weights, 0.9, None, 0.0)
    got = written[w] if layout == "linear" else written[w].T
    assert np.abs(got - expected).max() <= 1e-8 * np.abs(expected).max()


@pytest.mark.parametrize("method", ["regmean", "average", "task_arithmetic"])
def test_adapters_merge_alike_in_memory_and_streaming(families, tmp_path, method):
    fam = families["bert"]
    kwargs: dict[str, Any] = {"heads": H.HEADS["bert"], "base": fam["base_dir"]}
    if method == "regmean":
        kwargs.update(stats=fam["stats"], alpha=0.9)
    stream_merge(fam["adapters"], tmp_path / "s", method, progress=False, **kwargs)
    kwargs["base"] = fam["base"]
    result = merge_models([str(a) for a in fam["adapters"]], method, progress=False, **kwargs)
    save_merged(result, tmp_path / "m", fam["base_dir"], progress=False)
    a, b = (
        load_file(str(tmp_path / "s" / "model.safetensors")),
        load_file(str(tmp_path / "m" / "model.safetensors")),
    )
    assert a.keys() == b.keys()
    for n in a:
        assert np.array_equal(a[n], b[n]), n
    record = json.loads((tmp_path / "s" / "lmdx_merge.json").read_text())
    entry = record["inputs"][str(fam["adapters"][0])]
    assert entry["base"] == str(fam["base_dir"].resolve())
    if method == "average":  # the average of the adapted weights, in float64
        sources = _sources(fam)
        for n in ("bert.encoder.layer.0.attention.self.query.weight", "classifier.weight"):
            mean = sum(np.asarray(torch.as_tensor(s.read(n)).numpy()) for s in sources) / K
            expected = sources[0].read(n) if n.startswith("classifier") else mean
            assert np.abs(a[n] - np.asarray(torch.as_tensor(expected).numpy())).max() <= 1e-12


def test_statistics_must_be_of_the_same_adapter(families, tmp_path):
    fam = families["bert"]
    swapped = [fam["stats"][1], fam["stats"][0], fam["stats"][2]]
    with pytest.raises(ModelMismatchError, match="LoRA adapters differ in"):
        stream_merge(
            fam["adapters"], tmp_path / "o", stats=swapped, base=fam["base_dir"], progress=False
        )
    base_stats = H.collect(fam["base"], H.random_batches("bert", 1))
    with pytest.raises(ModelMismatchError, match="has no adapter; this model is a base with"):
        stream_merge(
            fam["adapters"], tmp_path / "o", stats=[base_stats, *fam["stats"][1:]],
            base=fam["base_dir"], progress=False,
        )  # fmt: skip
    with pytest.raises(ModelMismatchError, match="LoRA adapter; this model has none"):
        merge_models(
            [fam["base"], *[str(a) for a in fam["adapters"][1:]]], stats=fam["stats"],
            base=fam["base"], progress=False,
        )  # fmt: skip
    assert not (tmp_path / "o").exists()


def test_adapter_inputs_are_checked(families, tmp_path):
    fam = families["bert"]
    with pytest.raises(MergeError, match=r"^models\[0\]: a LoRA adapter folder needs base"):
        stream_merge(fam["adapters"], tmp_path / "o", "average", progress=False)
    # an adapter of another architecture
    with pytest.raises(MergeError, match="the adapter is for another model"):
        stream_merge(
            [families["gpt2"]["adapters"][0], *fam["adapters"][1:]], tmp_path / "o", "average",
            base=fam["base_dir"], progress=False,
        )  # fmt: skip
    # a LoRA variant whose update is not scaling · B A, a rank the tensors contradict
    for key, value, message in (
        ("use_dora", True, "use_dora"),
        ("r", 7, "has rank .* but the configuration gives it r = 7"),
        ("init_lora_weights", "pissa", "changes the base model's weights"),
        ("peft_type", "IA3", "LoRA adapters .peft_type LORA. only"),
        ("brand_new_option", 1.5, "brand_new_option = 1.5 is a PEFT option lmdx does not know"),
    ):
        bad = tmp_path / f"bad-{key}"
        bad.mkdir()
        config = json.loads((fam["adapters"][0] / "adapter_config.json").read_text())
        config[key] = value
        (bad / "adapter_config.json").write_text(json.dumps(config))
        (bad / "adapter_model.safetensors").write_bytes(
            (fam["adapters"][0] / "adapter_model.safetensors").read_bytes()
        )
        with pytest.raises(MergeError, match=message):
            stream_merge(
                [bad, *fam["adapters"][1:]], tmp_path / "o", "average", base=fam["base_dir"],
                progress=False,
            )  # fmt: skip
    with pytest.raises(MergeError, match="a PEFT model in memory; give its adapter folder"):
        merge_models(fam["peft"], "average", progress=False)
    with pytest.raises(MergeError, match="base: used by LoRA adapters"):
        stream_merge(
            [fam["base_dir"]] * 2, tmp_path / "o", "average", base=fam["base_dir"], progress=False
        )
    with pytest.raises(MergeError, match=r"lora_rank: .*every model to be a LoRA adapter"):
        stream_merge(
            [fam["base_dir"], fam["adapters"][0]], tmp_path / "o", "average",
            base=fam["base_dir"], lora_rank=2, progress=False,
        )  # fmt: skip
    with pytest.raises(MergeError, match="ray_workers: not for LoRA adapter inputs"):
        stream_merge(
            fam["adapters"], tmp_path / "o", stats=fam["stats"], base=fam["base_dir"],
            ray_workers=2, progress=False,
        )  # fmt: skip
    assert not (tmp_path / "o").exists()


# --------------------------------------------------------------------------- LoRA of the merge


def _peft_weights(base: Any, folder: Path) -> dict[str, np.ndarray]:
    from peft import PeftModel

    model = PeftModel.from_pretrained(copy.deepcopy(base), str(folder))
    return {n: t.detach().numpy() for n, t in model.merge_and_unload().state_dict().items()}


@pytest.mark.parametrize("arch", ["bert", "gpt2", "llama"])
def test_lora_of_the_merge_loads_with_peft(families, tmp_path, arch):
    """A LoRA of rank ≥ the merged update's carries the merged model exactly; one of
    lower rank is the truncated SVD of each update, its errors as reported."""
    fam = families[arch]
    common = {
        "stats": fam["stats"], "base": fam["base_dir"], "alpha": 0.9, "heads": H.HEADS[arch],
        "progress": False,
    }  # fmt: skip
    stream_merge(fam["adapters"], tmp_path / "full", lora_rank=64, **common)
    merged = load_file(str(tmp_path / "full" / "model.safetensors"))
    record = json.loads((tmp_path / "full" / "lmdx_merge.json").read_text())
    assert record["lora"]["relative_error"] <= 1e-12
    adapted = _peft_weights(fam["base"], tmp_path / "full" / "lora")
    for name, value in merged.items():
        assert np.abs(adapted[name] - value).max() <= 1e-10 * max(np.abs(value).max(), 1.0), name

    rank = 2
    stream_merge(fam["adapters"], tmp_path / "low", lora_rank=rank, **common)
    record = json.loads((tmp_path / "low" / "lmdx_merge.json").read_text())
    adapted = _peft_weights(fam["base"], tmp_path / "low" / "lora")
    base = {n: t.numpy() for n, t in fam["base"].state_dict().items()}
    left_all = total_all = 0.0
    for name, error in record["lora"]["layers"].items():
        update = merged[name] - base[name]
        sv = np.linalg.svd(update, compute_uv=False)
        left, total = np.sqrt(np.sum(sv[rank:] ** 2)), np.sqrt(np.sum(sv**2))
        assert abs(error - left / total) <= 1e-8, name
        got = np.linalg.norm(update - (adapted[name] - base[name]))
        assert abs(got - left) <= 1e-8 * total, name
        left_all, total_all = left_all + left**2, total_all + total**2
    assert abs(record["lora"]["relative_error"] - np.sqrt(left_all / total_all)) <= 1e-8
    for name in record["lora"]["carried"]:
        assert np.array_equal(adapted[name], merged[name]), name
    assert "lora" in (tmp_path / "low" / "README.md").read_text()


# --------------------------------------------------------------------------- configs and CLI


def test_config_with_adapters(families, tmp_path):
    fam = families["bert"]
    lines = [f"base: {fam['base_dir']}", "method: regmean", "alpha: 0.9", "models:"]
    for a, s in zip(fam["adapters"], fam["stats"], strict=True):
        lines.append(f"  - {{adapter: {a}, stats: {s}}}")
    lines += ["heads: {patterns: ['classifier.*'], per_task_folders: true}", "output:",
              "  lora_rank: 4"]  # fmt: skip
    (tmp_path / "merge.yaml").write_text("\n".join(lines) + "\n")
    cfg = load_merge_config(tmp_path / "merge.yaml")
    assert all(m.adapter for m in cfg.models) and cfg.options.output.lora_rank == 4
    run_merge(cfg, tmp_path / "streamed", progress=False)
    run_merge(cfg, tmp_path / "in-memory", progress=False, streaming=False)
    for folder in ("streamed", "in-memory"):
        out = tmp_path / folder
        assert (out / "lora" / "adapter_config.json").is_file()
        assert (out / "tasks" / "2" / "config.json").is_file()
    a = load_file(str(tmp_path / "streamed" / "model.safetensors"))
    b = load_file(str(tmp_path / "in-memory" / "model.safetensors"))
    assert all(np.array_equal(a[n], b[n]) for n in a)
    bad = (tmp_path / "merge.yaml").read_text().replace("{adapter:", "{path:", 1)
    (tmp_path / "bad.yaml").write_text(bad)
    with pytest.raises(MergeError, match=r"models\[0\].path .* is a LoRA adapter folder"):
        load_merge_config(tmp_path / "bad.yaml")
    no_base = "\n".join(line for line in lines if not line.startswith("base:"))
    (tmp_path / "no-base.yaml").write_text(no_base + "\n")
    with pytest.raises(MergeError, match=r"models\[0\]\.adapter: a LoRA adapter folder needs base"):
        load_merge_config(tmp_path / "no-base.yaml")
