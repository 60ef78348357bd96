"""lmdx.stats.collect and lmdx.stats.fisher on tiny Hugging Face models: Grams and Fisher
against float64 references.

The references come from tests/hf_models.py: this suite's own forward hooks (Grams of
every linear module's input, padding rows dropped by the attention mask or kept) and
its own per-example gradient loop (Fisher). Models are built from configs, never
downloaded.
"""

from __future__ import annotations

import copy

import hf_models as H
import numpy as np
import pytest
import torch
import transformers  # noqa: F401
from lmdx.data.batches import text_batches
from lmdx.merge import merge_models
from lmdx.stats.fisher import collect_fisher
from lmdx.stats.sites import find_linear_modules

pytestmark = pytest.mark.usefixtures("one_torch_thread")


_collect = H.collect


def _token_rows(batches, include_padding):
    """Rows a token-level module sees, counted from the masks alone."""
    if include_padding:
        return float(sum(b["attention_mask"].numel() for b in batches))
    return float(sum(int(b["attention_mask"].sum()) for b in batches))


def _sequences(batches):
    return float(sum(b["input_ids"].shape[0] for b in batches))


# --------------------------------------------------------------------------- modules

EXPECTED_LAYOUT = {
    "bert": {"linear": 14, "conv1d": 0},
    "roberta": {"linear": 14, "conv1d": 0},
    "gpt2": {"linear": 1, "conv1d": 8},
    "llama": {"linear": 15, "conv1d": 0},
}


@pytest.mark.parametrize("arch", H.ARCHS)
def test_find_linear_modules_finds_every_linear_and_conv1d(arch):
    _, models, _ = H.cached_family(arch)
    found = find_linear_modules(models[0])
    mine = H.linear_modules(models[0])
    assert list(found) == list(mine)
    for name, (module, layout) in found.items():
        assert module is mine[name][0] and layout == mine[name][1], name
    layouts = [layout for _, layout in found.values()]
    assert {k: layouts.count(k) for k in ("linear", "conv1d")} == EXPECTED_LAYOUT[arch]


def test_find_linear_modules_include_exclude_patterns():
    _, models, _ = H.cached_family("bert")
    found = find_linear_modules(models[0], include=["*.layer.1.*"], exclude=["*.output.dense"])
    prefix = "bert.encoder.layer.1."
    assert sorted(found) == sorted(
        prefix + s
        for s in (
            "attention.self.query",
            "attention.self.key",
            "attention.self.value",
            "intermediate.dense",
        )
    )


def test_no_selected_module_is_an_error():
    _, models, batches = H.cached_family("bert")
    with pytest.raises(ValueError, match=r"no nn\.Linear / Conv1D module matches"):
        _collect(models[0], batches[0], include=["nothing.*"])


def test_empty_batches_is_an_error():
    _, models, _ = H.cached_family("bert")
    with pytest.raises(ValueError, match="batches is empty"):
        _collect(models[0], [])


# --------------------------------------------------------------------------- Grams


@pytest.mark.parametrize("include_padding", [False, True], ids=["pad-excluded", "pad-included"])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("arch", H.ARCHS)
def test_grams_equal_float64_reference(arch, dtype, include_padding):
    _, models, batches = H.cached_family(arch, dtype)
    model, data = models[1], list(batches[1])
    stats = _collect(model, data, include_padding=include_padding)
    ref = H.reference_grams(model, data, include_padding)
    # float64 activations are accumulated exactly; float32 ones within the core's
    # documented 1e-6 (float32 chunk products added into float64).
    rtol = 1e-12 if dtype == "float64" else 1e-6
    assert stats.padding == ("included" if include_padding else "excluded")
    assert set(stats.modules) == set(ref)
    tokens, sequences = _token_rows(data, include_padding), _sequences(data)
    for name, r in ref.items():
        # the reference's own counts, from the masks: one row per real (or any) token,
        # or one per sequence for pooled inputs (BERT pooler, RoBERTa classifier)
        assert r["count"] in (tokens, sequences), name
        assert stats.count(name) == r["count"], name
        assert H.rel_err(stats.gram(name), r["gram"]) <= rtol, name
        assert H.rel_err(stats.sum(name), r["sum"]) <= rtol, name
    if not include_padding:
        assert tokens < _token_rows(data, True), "the data must hold padding"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_half_precision_models(arch, dtype):
    """bf16/fp16 activations are widened (exactly) and accumulated like float32 ones; the
    merge returns tensors of the model's dtype."""
    _, models, batches = H.cached_family(arch, "float32")
    half = [copy.deepcopy(m).to(dtype) for m in models[:2]]
    data = [list(b) for b in batches[:2]]
    stats = [_collect(m, d) for m, d in zip(half, data, strict=True)]
    for s, m, d in zip(stats, half, data, strict=True):
        ref = H.reference_grams(m, d, False)
        for name, r in ref.items():
            assert stats[0].count(name) > 0
            assert s.count(name) == r["count"], name
            assert H.rel_err(s.gram(name), r["gram"]) <= 1e-6, name
    result = merge_models(
        half, "regmean", stats=stats, heads=H.HEADS[arch], alpha=0.9, progress=False, n_threads=1
    )
    assert all(t.dtype == dtype for t in result.state_dict.values() if t.is_floating_point())


@pytest.mark.parametrize("arch", H.ARCHS)
def test_padding_excluded_statistics_do_not_depend_on_batching(arch):
    _, models, batches = H.cached_family(arch, "float64")
    model = models[0]
    seqs = H.sequences_of(list(batches[0]))
    runs = {bs: H.batch_sequences(arch, seqs, bs) for bs in (1, 7, len(seqs))}
    excluded = {bs: _collect(model, b) for bs, b in runs.items()}
    included = {bs: _collect(model, b, include_padding=True) for bs, b in runs.items()}
    alone = excluded[1]  # batch size 1: no padding at all
    for name in alone.modules:
        for bs in (7, len(seqs)):
            assert excluded[bs].count(name) == alone.count(name), (bs, name)
            assert H.rel_err(excluded[bs].gram(name), alone.gram(name)) <= 1e-12, (bs, name)
            assert H.rel_err(excluded[bs].sum(name), alone.sum(name)) <= 1e-12, (bs, name)
        # counting padding rows makes the statistics depend on the batching
        assert included[1].count(name) == alone.count(name)
    token_level = [n for n in alone.modules if alone.count(n) > len(seqs)]
    assert token_level
    for name in token_level:
        assert included[len(seqs)].count(name) > included[7].count(name) > alone.count(name)
        assert H.rel_err(included[len(seqs)].gram(name), alone.gram(name)) > 1e-3


def test_text_batches_pad_on_the_right_and_feed_collection():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "[X]", *[f"w{i}" for i in range(40)]]
    word_level = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, "[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=word_level, pad_token="[PAD]", unk_token="[UNK]"
    )
    rng = np.random.default_rng(5)
    texts = [" ".join(f"w{j}" for j in rng.integers(0, 40, n)) for n in rng.integers(2, 12, 9)]
    batches = text_batches(texts, tokenizer, batch_size=4, max_length=8, labels=list(range(9)))
    assert [b["input_ids"].shape[0] for b in batches] == [4, 4, 1]
    assert [int(x) for b in batches for x in b["labels"]] == list(range(9))
    lengths = [min(len(t.split()), 8) for t in texts]
    for b, chunk in zip(batches, [lengths[:4], lengths[4:8], lengths[8:]], strict=True):
        mask = b["attention_mask"].numpy()
        assert mask.shape[1] == max(chunk)
        for row, n in zip(mask, chunk, strict=True):
            assert row.tolist() == [1] * n + [0] * (mask.shape[1] - n)  # right padding
    with pytest.raises(ValueError, match="labels: 2 labels for 9 texts"):
        text_batches(texts, tokenizer, labels=[0, 1])
    # the batches feed a model: a token-level module sees exactly the real tokens
    _, fam, _ = H.cached_family("bert")
    stats = _collect(fam[0], batches)
    assert stats.count("bert.encoder.layer.0.intermediate.dense") == sum(lengths)


# --------------------------------------------------------------------------- sharing

SHARED = {
    "bert": [("attention.self.query", "attention.self.key", "attention.self.value")],
    "roberta": [("attention.self.query", "attention.self.key", "attention.self.value")],
    "gpt2": [],  # c_attn is already one fused Conv1D
    "llama": [
        ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        ("mlp.gate_proj", "mlp.up_proj"),
    ],
}
LAYER_PREFIX = {arch: f"{blocks}.{{}}." for arch, blocks in H.BLOCKS.items()}


def expected_groups(arch, names):
    """The partition of module names into shared-input groups, written out per family."""
    groups = []
    for layer in range(2):
        prefix = LAYER_PREFIX[arch].format(layer)
        groups += [frozenset(prefix + m for m in members) for members in SHARED[arch]]
    grouped = set().union(*groups) if groups else set()
    return set(groups) | {frozenset([n]) for n in names if n not in grouped}


def partition(stats):
    by_group = {}
    for name, info in stats.modules.items():
        by_group.setdefault(info["group"], set()).add(name)
    for group, members in by_group.items():
        assert group in members  # a group is named after one of its modules
    return {frozenset(m) for m in by_group.values()}


@pytest.mark.parametrize("arch", H.ARCHS)
def test_shared_inputs_form_one_group_per_attention_and_mlp_input(arch):
    _, models, batches = H.cached_family(arch, "float64")
    shared = _collect(models[0], batches[0], share_inputs=True)
    separate = _collect(models[0], batches[0], share_inputs=False)
    assert partition(shared) == expected_groups(arch, shared.modules)
    assert partition(separate) == {frozenset([n]) for n in separate.modules}
    assert len(shared.groups) == len(expected_groups(arch, shared.modules))
    for name in shared.modules:
        assert shared.count(name) == separate.count(name)
        assert H.rel_err(shared.gram(name), separate.gram(name)) <= 1e-12, name


# --------------------------------------------------------------------------- NaN, hooks


@pytest.mark.parametrize(
    ("arch", "poisoned", "module"),
    [
        (
            "bert",
            "bert.encoder.layer.0.intermediate.dense.weight",
            "bert.encoder.layer.0.output.dense",
        ),
        ("llama", "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj"),
        ("gpt2", "transformer.h.1.attn.c_proj.weight", "transformer.h.1.mlp.c_fc"),
    ],
)
def test_nan_activation_is_an_error_naming_the_module(arch, poisoned, module):
    _, models, batches = H.cached_family(arch)
    model = copy.deepcopy(models[0])
    with torch.no_grad():
        dict(model.named_parameters())[poisoned].fill_(float("nan"))
    model.train()
    with pytest.raises(ValueError, match=rf"module '{module}': its input holds NaN or Inf"):
        _collect(model, batches[0])
    # nothing left behind on the model: hooks removed, training flag restored
    assert all(not m._forward_pre_hooks for m in model.modules())
    assert model.training


def test_collection_leaves_the_model_as_it_was():
    _, models, batches = H.cached_family("gpt2")
    model = copy.deepcopy(models[0]).train()
    before = H.snapshot(model)
    _collect(model, batches[0])
    assert model.training and H.same_state(model, before)
    assert all(not m._forward_pre_hooks for m in model.modules())


# --------------------------------------------------------------------------- Fisher


def _fisher_batches(arch):
    return H.random_batches(arch, 77, n_sequences=10, batch_size=4, labels=True)


@pytest.mark.parametrize("labels", ["predicted", "gold"])
@pytest.mark.parametrize("arch", ["bert", "gpt2", "llama"])
def test_fisher_equals_per_example_squared_gradients(arch, labels):
    _, models, _ = H.cached_family(arch)
    model = models[2]
    data = _fisher_batches(arch)
    stats = collect_fisher(model, data, labels=labels, progress=False, description="ten")
    ref, examples = H.reference_fisher(model, data, gold=labels == "gold")
    assert stats.kind == "fisher" and stats.count() == examples == 10
    assert set(stats.parameters) == set(ref)
    H.assert_fisher_close(stats, ref)


def test_fisher_of_a_float64_model_is_float64_exact():
    _, models, _ = H.cached_family("bert", "float64")
    data = _fisher_batches("bert")
    stats = collect_fisher(models[0], data, progress=False)
    ref, _ = H.reference_fisher(models[0], data, gold=False)
    H.assert_fisher_close(stats, ref, rtol=1e-10)


def test_gold_and_predicted_fisher_differ_when_labels_differ():
    _, models, _ = H.cached_family("bert")
    model = models[0]
    data = _fisher_batches("bert")
    with torch.no_grad():
        predicted = [int(a) for b in data for a in model(**{**b, "labels": None}).logits.argmax(-1)]
    gold = [int(y) for b in data for y in b["labels"]]
    assert predicted != gold  # the data makes the two variants differ
    p = collect_fisher(model, data, labels="predicted", progress=False)
    g = collect_fisher(model, data, labels="gold", progress=False)
    assert H.rel_err(p.fisher("classifier.weight"), g.fisher("classifier.weight")) > 1e-2


def test_fisher_include_pattern_and_flags_restored():
    _, models, _ = H.cached_family("bert")
    model = copy.deepcopy(models[0]).train()
    frozen = "bert.embeddings.word_embeddings.weight"
    model.get_parameter(frozen).requires_grad_(False)
    data = _fisher_batches("bert")
    stats = collect_fisher(model, data, include=["*.layer.1.*"], progress=False)
    ref, _ = H.reference_fisher(copy.deepcopy(models[0]), data, gold=False)
    assert set(stats.parameters) == {n for n in ref if ".layer.1." in n}
    H.assert_fisher_close(stats, ref)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    assert flags == {n: n != frozen for n in flags}
    assert model.training and all(p.grad is None for p in model.parameters())


def test_fisher_gold_labels_missing_is_an_error():
    _, models, _ = H.cached_family("bert")
    data = H.random_batches("bert", 3, n_sequences=4)
    with pytest.raises(ValueError, match="labels='gold' but a batch has no 'labels'"):
        collect_fisher(models[0], data, labels="gold", progress=False)
    with pytest.raises(ValueError, match="labels: expected 'predicted' or 'gold'"):
        collect_fisher(models[0], data, labels="argmax", progress=False)
