"""RegMean++ (``method="regmean_plusplus"``) against a float64 reimplementation written here.

The reference never calls lmdx. For block l it builds, per model i, a float64 copy of
model i in which every tensor outside the blocks (averaged) and every block before l
(the reference's own merged blocks) is replaced: the merged prefix in front of model i's
own block l. It runs that whole Hugging Face model on model i's batches with this
suite's hooks (``hf_models.reference_grams``: ``Σ x xᵀ`` of every linear module's input
over the real tokens, padding dropped by the attention mask), solves the RegMean
formula ``W_Mᵀ = (Σ c_i G̃_i)⁻¹ Σ c_i G̃_i W_iᵀ`` (``G̃_i = α G_i/n_i + (1−α) diag``)
with ``np.linalg.solve`` for block l's linear weights and averages the rest.

Tolerances: on float64 models every activation is exact to rounding, and lmdx matches
to 1e-9 relative (measured ≤ 4e-11 at α = 1, where these tiny random layers have
condition numbers up to 1e6, and ≤ 1e-14 at α = 0.9). On float32 models lmdx runs the
blocks in float32 and accumulates float32 products (within 1e-6 of float64, documented);
at α = 0.9 it matches the float64 reference to 1e-6 (measured ≤ 2e-7). At α = 1 the
ill-conditioned tiny layers amplify the float32 forward passes' rounding (measured up to
9e-3 on Llama's o_proj), exactly as for plain RegMean (tests/merge/test_merge.py), so the
float32 comparison is made at α < 1 only.
"""

from __future__ import annotations

import copy
import json
import re

import hf_models as H
import numpy as np
import pytest
import torch
import transformers
from lmdx import MergeError, merge_models, save_merged, stream_merge
from lmdx._tensors import to_torch
from lmdx.files import Checkpoint
from lmdx.merge.regmean_plusplus import find_blocks
from lmdx.stats.collect import collect_regmean_stats

pytestmark = pytest.mark.usefixtures("one_torch_thread")

# --------------------------------------------------------------------------- reference


def block_of(name, arch):
    """The index of the block tensor ``name`` belongs to (None: outside the blocks)."""
    prefix = H.BLOCKS[arch] + "."
    return int(name[len(prefix) :].split(".")[0]) if name.startswith(prefix) else None


def with_tensors(model, tensors):
    """A float64 copy of ``model`` with ``tensors`` (name -> float64 array) put in."""
    out = copy.deepcopy(model).double()
    state = out.state_dict()
    with torch.no_grad():
        for name, value in tensors.items():
            state[name].copy_(torch.from_numpy(value))
    return out


def block_grams(models, batches, merged):
    """Per model, the Grams of every linear module with ``merged`` put in front."""
    return [
        H.reference_grams(with_tensors(m, merged), list(b), False)
        for m, b in zip(models, batches, strict=True)
    ]


def solve_block(index, arch, models, states, grams, alpha, coefficients):
    """Block ``index`` merged: RegMean of its linear weights on ``grams``, the rest averaged."""
    linear = H.linear_modules(models[0])
    out = {}
    for name in states[0]:
        if block_of(name, arch) != index:
            continue
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module in linear:
            out[name] = H.reference_regmean(
                [g[module]["gram"] for g in grams],
                [g[module]["count"] for g in grams],
                [s[name] for s in states],
                alpha,
                coefficients,
                linear[module][1],
            )
        else:
            out[name] = H.reference_average([s[name] for s in states], coefficients)
    return out


def reference_plusplus(models, batches, arch, alpha, coefficients):
    """RegMean++ in float64: every merged tensor but the heads, by name."""
    states = [H.state_arrays(m) for m in models]
    merged = {
        n: H.reference_average([s[n] for s in states], coefficients)
        for n in states[0]
        if block_of(n, arch) is None and not H.is_head(n, arch)
    }
    for index in range(len(models[0].get_submodule(H.BLOCKS[arch]))):
        grams = block_grams(models, batches, merged)
        merged.update(solve_block(index, arch, models, states, grams, alpha, coefficients))
    return merged


def _merge(models, batches, arch, **kwargs):
    kwargs.setdefault("n_threads", 1)
    return merge_models(
        list(models),
        "regmean_plusplus",
        data=[list(b) for b in batches],
        heads=H.HEADS[arch],
        progress=False,
        **kwargs,
    )


def assert_close(state, reference, rtol):
    assert set(state) == set(reference)
    errors = {n: H.rel_err(state[n], reference[n]) for n in reference}
    worst = max(errors, key=errors.__getitem__)
    assert errors[worst] <= rtol, (worst, errors[worst])


# --------------------------------------------------------------------------- the formula


@pytest.mark.parametrize(
    ("arch", "alpha", "coefficients"),
    [
        ("bert", 1.0, None),
        ("bert", 0.9, (0.5, 2.0, 1.25)),
        ("llama", 1.0, None),
        ("llama", 0.9, (0.5, 2.0, 1.25)),
        ("gpt2", 0.5, None),  # Conv1D layers ([in, out] weights)
    ],
)
def test_float64_models_equal_the_reference(arch, alpha, coefficients):
    _, models, batches = H.cached_family(arch, "float64")
    result = _merge(models, batches, arch, alpha=alpha, coefficients=coefficients)
    reference = reference_plusplus(models, batches, arch, alpha, coefficients)
    assert_close(result.state_dict, reference, 1e-9)
    solved = {n for n in H.linear_modules(models[0]) if block_of(n, arch) is not None}
    assert set(result.report["layers"]) == solved  # nothing outside the blocks is solved
    for i, model in enumerate(models):  # each model keeps its own head, untouched
        heads = {n: t for n, t in model.state_dict().items() if H.is_head(n, arch)}
        assert all(torch.equal(result.heads[i][n], t) for n, t in heads.items())
    assert result.report["method"] == "regmean_plusplus" and result.report["alpha"] == alpha


@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_float32_models_match_the_float64_reference(arch):
    _, models, batches = H.cached_family(arch, "float32")
    result = _merge(models, batches, arch, alpha=0.9)
    assert all(t.dtype == torch.float32 for t in result.state_dict.values())
    assert_close(result.state_dict, reference_plusplus(models, batches, arch, 0.9, None), 1e-6)


@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_block_0_is_plain_regmean_and_block_1_sees_the_merged_block_0(arch):
    """With everything outside the blocks equal across models, block 0's Grams are those
    of the unmerged models: block 0 is plain RegMean's. Block 1's are taken with the
    merged block 0 in front, and differ from plain RegMean's."""
    _, family, batches = H.cached_family(arch, "float64")
    models = [copy.deepcopy(m) for m in family]
    outside = {n: t for n, t in models[0].state_dict().items() if block_of(n, arch) is None}
    with torch.no_grad():
        for m in models[1:]:
            for n, t in m.state_dict().items():
                if n in outside and not H.is_head(n, arch):
                    t.copy_(outside[n])
    alpha = 0.95
    result = _merge(models, batches, arch, alpha=alpha)
    states = [H.state_arrays(m) for m in models]
    unmerged = [H.reference_grams(m, list(b), False) for m, b in zip(models, batches, strict=True)]
    block0 = solve_block(0, arch, models, states, unmerged, alpha, None)
    assert_close({n: result.state_dict[n] for n in block0}, block0, 1e-9)
    stats = [
        collect_regmean_stats(m, b, progress=False) for m, b in zip(models, batches, strict=True)
    ]
    plain = merge_models(models, stats=stats, alpha=alpha, heads=H.HEADS[arch], progress=False)
    for name in block0:
        assert H.rel_err(result.state_dict[name], plain.state_dict[name].numpy()) <= 1e-9, name

    prefix = {n: states[0][n] for n in outside if not H.is_head(n, arch)} | block0
    in_front = block_grams(models, batches, prefix)
    block1 = solve_block(1, arch, models, states, in_front, alpha, None)
    assert_close({n: result.state_dict[n] for n in block1}, block1, 1e-9)
    weight = f"{H.BLOCKS[arch]}.1.{'output.dense' if arch == 'bert' else 'mlp.down_proj'}.weight"
    assert H.rel_err(plain.state_dict[weight], block1[weight]) > 1e-4  # the cross-layer part


@pytest.mark.parametrize("arch", ["bert", "llama"])
def test_a_model_merged_with_itself_comes_back(arch):
    _, models, batches = H.cached_family(arch, "float32")
    result = _merge([models[0]] * 3, batches, arch, alpha=0.9)
    state = models[0].state_dict()
    assert all(torch.equal(t, state[n]) for n, t in result.state_dict.items())
    assert {v["precision"] for v in result.report["layers"].values()} == {"identical"}


# --------------------------------------------------------------------------- data


def test_padding_is_excluded():
    """The same texts batched differently (other padding), or padded with extra columns,
    give the same merge: only real tokens count."""
    arch = "llama"
    _, models, batches = H.cached_family(arch, "float64")
    base = _merge(models, batches, arch, alpha=0.9)
    rebatched = [H.batch_sequences(arch, H.sequences_of(list(b)), 3) for b in batches]
    padded = []
    for b in batches:
        wider = []
        for batch in b:
            extra = torch.full((batch["input_ids"].shape[0], 4), H.pad_id(arch))
            wider.append(
                {
                    "input_ids": torch.cat([batch["input_ids"], extra], dim=1),
                    "attention_mask": torch.cat([batch["attention_mask"], 0 * extra], dim=1),
                }
            )
        padded.append(wider)
    real_tokens = [sum(int(batch["attention_mask"].sum()) for batch in b) for b in batches]
    assert base.report["layers"]["model.layers.1.mlp.down_proj"]["rows"] == min(real_tokens)
    for other in (rebatched, padded):
        result = _merge(models, other, arch, alpha=0.9)
        for name, t in result.state_dict.items():
            assert H.rel_err(t, base.state_dict[name].numpy()) <= 1e-12, name


def test_texts_are_tokenized_like_given_batches():
    _, models, _ = H.cached_family("bert", "float32")
    tokenizer = _word_tokenizer()
    rng = np.random.default_rng(5)
    texts = [
        [" ".join(rng.choice(["a", "b", "c", "d"], size=rng.integers(2, 9))) for _ in range(12)]
        for _ in models
    ]
    common = {"heads": H.HEADS["bert"], "progress": False, "alpha": 0.9}
    from_texts = merge_models(
        models, "regmean_plusplus", data=texts, tokenizer=tokenizer, max_texts=10,
        batch_size=4, max_length=6, **common,
    )  # fmt: skip
    batches = [
        [dict(b) for b in lmdx_batches(t[:10], tokenizer, batch_size=4, max_length=6)]
        for t in texts
    ]
    from_batches = merge_models(models, "regmean_plusplus", data=batches, **common)
    for name, t in from_texts.state_dict.items():
        assert torch.equal(t, from_batches.state_dict[name]), name
    assert from_texts.report["regmean_plusplus"]["batches"] == [3, 3, 3]


def lmdx_batches(texts, tokenizer, **kwargs):
    from lmdx import text_batches

    return text_batches(texts, tokenizer, **kwargs)


def _word_tokenizer():
    """A whitespace word-level tokenizer over a, b, c, d (ids 3..6; [PAD] is 0)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[PAD]": 0, "[UNK]": 1, "[X]": 2, "a": 3, "b": 4, "c": 5, "d": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]"
    )


# --------------------------------------------------------------------------- cost, memory


def test_two_block_forwards_per_model_and_block():
    arch = "bert"
    _, models, batches = H.cached_family(arch, "float32")
    result = _merge(models, batches, arch, alpha=0.9)
    run = result.report["regmean_plusplus"]
    k, n, blocks = len(models), len(batches[0]), run["blocks"]
    assert run["batches"] == [n] * k and blocks == 2
    # model i's block (Grams) on every batch; the merged block (next inputs) on every batch
    # but after the last block; one batch per block to find shared inputs; and model 0's
    # blocks once on one batch (the check of how the model calls them)
    assert run["block_forwards"] == k * n * blocks + k * n * (blocks - 1) + blocks + blocks
    assert run["prefix_forwards"] == k * n + 1  # block 0's inputs, and the check
    assert run["held_batches"] == k * n and run["recomputed_batches"] == 0
    assert run["activation_bytes_held"] > 0


@pytest.mark.parametrize("budget", [1, "20KB"], ids=["recompute-all", "recompute-some"])
def test_recomputed_activations_give_the_same_bits(budget):
    arch = "llama"
    _, models, batches = H.cached_family(arch, "float32")
    held = _merge(models, batches, arch, alpha=0.9)
    result = _merge(models, batches, arch, alpha=0.9, max_activation_memory=budget)
    for name, t in result.state_dict.items():
        assert torch.equal(t, held.state_dict[name]), name
    run = result.report["regmean_plusplus"]
    total = len(models) * len(batches[0])
    assert run["recomputed_batches"] > 0
    assert run["held_batches"] + run["recomputed_batches"] == total
    if budget == 1:
        assert run["held_batches"] == 0
    assert run["activation_bytes_held"] <= (1 if budget == 1 else 20_000)
    # a recomputed batch runs the prefix again for every block (and for the probe of
    # shared inputs, which runs model 0's first batch, when that batch is not held), and
    # at block 1 merged block 0, which a held batch runs once too (no more, with 2 blocks)
    before, blocks = held.report["regmean_plusplus"], run["blocks"]
    again = blocks * run["recomputed_batches"] + (blocks if budget == 1 else 0)
    assert run["prefix_forwards"] == before["prefix_forwards"] + again
    assert run["block_forwards"] >= before["block_forwards"]


def test_excluded_modules_are_averaged():
    arch = "llama"
    _, models, batches = H.cached_family(arch, "float64")
    result = _merge(models, batches, arch, alpha=0.9, exclude=["*.mlp.*"])
    states = [H.state_arrays(m) for m in models]
    assert not any(".mlp." in n for n in result.report["layers"])
    assert "model.layers.1.self_attn.q_proj" in result.report["layers"]
    for name in ("model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.down_proj.weight"):
        expected = H.reference_average([s[name] for s in states], None)
        assert H.rel_err(result.state_dict[name], expected) <= 1e-14


# --------------------------------------------------------------------------- front doors


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("regmean-pp")
    _, models, batches = H.cached_family("llama", "float32")
    paths = []
    for i, m in enumerate(models):
        m.save_pretrained(root / f"m{i}", max_shard_size="8KB")  # sharded checkpoints
        paths.append(root / f"m{i}")
    return {"root": root, "models": models, "paths": paths, "batches": batches}


def test_streaming_equals_in_memory_bit_for_bit(folders, tmp_path):
    kwargs = {
        "data": [list(b) for b in folders["batches"]],
        "alpha": 0.9,
        "heads": H.HEADS["llama"],
        "progress": False,
    }
    mem = merge_models(folders["models"], "regmean_plusplus", **kwargs)
    from_folders = merge_models(folders["paths"], "regmean_plusplus", **kwargs)
    res = stream_merge(
        folders["paths"], tmp_path / "s", "regmean_plusplus", max_shard_size="8KB", **kwargs
    )
    out = Checkpoint(res.out_dir)
    assert set(out.names()) == set(mem.model_state(0))
    for name, t in mem.model_state(0).items():
        assert torch.equal(to_torch(out.read(name)), t), name
        assert torch.equal(from_folders.model_state(0)[name], t), name
    saved = save_merged(mem, tmp_path / "mem", folders["paths"][0], progress=False)
    for name in out.names():
        assert torch.equal(to_torch(Checkpoint(saved).read(name)), to_torch(out.read(name))), name
    report = json.loads((res.out_dir / "lmdx_merge.json").read_text())["report"]
    assert report["method"] == "regmean_plusplus" and report["regmean_plusplus"]["blocks"] == 2
    # the outputs are written block by block, after everything outside the blocks
    order = [block_of(o.source, "llama") for o in res.plan.outputs]
    order = [-1 if b is None else b for b in order]
    assert order == sorted(order) and len(res.plan.shards) > 1
    assert {s.kind for s in res.plan.steps} == {"average", "regmean_plusplus"}
    assert "regmean_plusplus" in res.plan.describe()


def test_bfloat16_checkpoints(tmp_path):
    """bfloat16 models run and are merged in bfloat16; streaming equals in memory."""
    _, models, batches = H.cached_family("llama", "float32")
    paths = []
    for i, m in enumerate(models):
        copy.deepcopy(m).to(torch.bfloat16).save_pretrained(tmp_path / f"m{i}")
        paths.append(tmp_path / f"m{i}")
    kwargs = {"data": [list(b) for b in batches], "alpha": 0.9, "heads": H.HEADS["llama"]}
    mem = merge_models(paths, "regmean_plusplus", progress=False, **kwargs)
    res = stream_merge(paths, tmp_path / "s", "regmean_plusplus", progress=False, **kwargs)
    out = Checkpoint(res.out_dir)
    assert out.dtype("model.layers.1.mlp.down_proj.weight") == "bfloat16"
    for name in out.names():
        assert torch.equal(to_torch(out.read(name)), mem.model_state(0)[name]), name


def test_dry_run_needs_no_data(folders, tmp_path):
    res = stream_merge(folders["paths"], tmp_path / "s", "regmean_plusplus", dry_run=True)
    assert res.out_dir is None and not (tmp_path / "s").exists()
    blocks = [s for s in res.plan.steps if s.kind == "regmean_plusplus"]
    assert [s.block for s in blocks] == [0, 1]
    assert "model.layers.1.mlp.down_proj" in blocks[1].modules and blocks[1].memory > 0


# --------------------------------------------------------------------------- errors


def test_one_line_errors(folders, tmp_path):
    models, batches = folders["models"], [list(b) for b in folders["batches"]]
    cases = [
        ({"method": "regmean_plusplus"}, "^data: method regmean_plusplus needs each model's data"),
        ({"method": "average", "data": batches}, "data: only method regmean_plusplus takes data"),
        ({"method": "regmean_plusplus", "data": batches[:2]}, "data: 2 entries for 3 models"),
        (
            {"method": "regmean_plusplus", "data": batches, "stats": ["a", "b", "c"]},
            "^stats: method regmean_plusplus takes no statistics \\(Gram statistics given with "
            "cost only",
        ),
        (
            {"method": "regmean_plusplus", "data": [["a text"]] * 3},
            "holds texts but the model has no folder to load a tokenizer from",
        ),
        ({"method": "regmean_plusplus", "data": [[], [], []]}, r"data\[0\] .*no texts or batches"),
        (
            {"method": "regmean_plusplus", "data": batches, "max_activation_memory": "lots"},
            "max_activation_memory: expected e.g. '4GB'",
        ),
        ({"method": "regmean_plusplus", "data": batches, "batch_size": 0}, "batch_size"),
        (
            {"method": "regmean_plusplus", "data": batches, "max_texts": "ten"},
            "max_texts: must be a whole number >= 1, got 'ten'",
        ),
        (
            {
                "method": "regmean_plusplus",
                "data": [[{"input_ids": b[0]["input_ids"].double()}] for b in batches],
            },
            "running LlamaForSequenceClassification on a batch failed: ",
        ),
    ]
    for kwargs, message in cases:
        with pytest.raises(MergeError, match=message):
            merge_models(models, heads=H.HEADS["llama"], progress=False, **kwargs)
    states = [m.state_dict() for m in models]
    with pytest.raises(MergeError, match="needs their Hugging Face configuration"):
        merge_models(states, "regmean_plusplus", data=batches, progress=False)
    with pytest.raises(MergeError, match="ray_workers: regmean_plusplus"):
        stream_merge(
            folders["paths"], tmp_path / "r", "regmean_plusplus", data=batches, ray_workers=2
        )
    with pytest.raises(MergeError, match=re.escape("found no repeated blocks in Sequential")):
        find_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_models_that_pass_blocks_per_block_arguments_are_refused():
    """Gemma 2 alternates sliding-window and full attention: its blocks get different
    masks, which one captured call cannot reproduce."""
    config = transformers.Gemma2Config(
        vocab_size=H.VOCAB,
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        sliding_window=4,
        max_position_embeddings=64,
        pad_token_id=0,
        num_labels=3,
    )
    torch.manual_seed(0)
    base = transformers.Gemma2ForSequenceClassification(config).eval()
    models = [H.finetuned(base, i) for i in range(2)]
    data = [H.random_batches("llama", 20 + i) for i in range(2)]
    with pytest.raises(MergeError, match=r"passes block 1 a different attention_mask= than"):
        merge_models(models, "regmean_plusplus", data=data, heads=["score.*"], progress=False)


def test_integer_tensors_in_a_block_are_the_first_models():
    """A buffer inside a block that is not floating point (here one int64 value beyond
    float64's exact integers, different per model) comes back as the first model's, a
    copy of it; the block's weights are merged as without it."""
    _, models, batches = H.cached_family("bert", "float32")
    models = [copy.deepcopy(m) for m in models]
    big = 2**62 + 1
    for i, m in enumerate(models):
        m.bert.encoder.layer[1].register_buffer("marks", torch.tensor([big, i], dtype=torch.int64))
    name = f"{H.BLOCKS['bert']}.1.marks"
    result = _merge(models, batches, "bert", alpha=0.9)
    assert result.state_dict[name].tolist() == [big, 0]
    assert result.state_dict[name].data_ptr() != models[0].state_dict()[name].data_ptr()
    _, plain_models, _ = H.cached_family("bert", "float32")
    plain = _merge(plain_models, batches, "bert", alpha=0.9)
    for n, t in plain.state_dict.items():
        assert torch.equal(result.state_dict[n], t), n
