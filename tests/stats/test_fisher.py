"""collect_fisher against a per-example loop written here: each example run alone on its real
tokens, one backward each, squared gradients summed in float64 (float64 models, so that the
batched path and the loop must agree to rounding of float64)."""

from __future__ import annotations

import copy
import types

import hf_models as H
import numpy as np
import pytest
import torch
import transformers
from lmdx.stats import fisher
from lmdx.stats.fisher import collect_fisher

TOKEN_CLASSES = {
    "bert": transformers.BertForTokenClassification,
    "gpt2": transformers.GPT2ForTokenClassification,
    "llama": transformers.LlamaForTokenClassification,
}


def reference(model, batches, gold, trim=True):
    """Σ over examples of (∂ Σ log p(y|x) / ∂θ)², each example alone; with ``trim`` on its
    real tokens, else on its whole (padded) row with its mask. Token-level models score
    every real token (gold labels below 0 are not scored)."""
    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    sums = {n: np.zeros(tuple(p.shape)) for n, p in params.items()}
    for batch in batches:
        for i in range(batch["input_ids"].shape[0]):
            mask = batch["attention_mask"][i]
            keep = mask.bool() if trim else torch.ones_like(mask, dtype=torch.bool)
            ids, m = batch["input_ids"][i][keep][None], mask[keep][None]
            logp = torch.log_softmax(
                model(input_ids=ids, attention_mask=m).logits[0].double(), dim=-1
            )
            if logp.dim() == 1:
                y = int(batch["labels"][i]) if gold else int(logp.argmax())
                ll = logp[y]
            else:
                y = batch["labels"][i][keep] if gold else logp.argmax(-1)
                scored = (m[0] == 1) & (y >= 0)
                ll = logp[scored.nonzero()[:, 0], y[scored]].sum()
            grads = torch.autograd.grad(ll, list(params.values()), allow_unused=True)
            for n, g in zip(params, grads, strict=True):
                if g is not None:
                    sums[n] += g.double().numpy() ** 2
    return sums


def assert_close(stats, ref, rtol):
    """Every parameter within ``rtol`` of its own norm (plus 1e-9 of the largest, for
    parameters whose gradient vanishes in exact arithmetic and is rounding noise)."""
    assert set(stats.parameters) == set(ref)
    floor = 1e-9 * max(np.linalg.norm(v) for v in ref.values())
    for name, expected in ref.items():
        err = np.linalg.norm(stats.fisher(name) - expected)
        assert err <= rtol * np.linalg.norm(expected) + floor, (name, err)


def token_model(arch, dtype=torch.float64):
    config = H.build_base(arch).config
    torch.manual_seed(5)
    model = TOKEN_CLASSES[arch](config).eval().to(dtype)
    with torch.no_grad():  # move norms and biases off 1 / 0 (as hf_models does)
        for p in model.parameters():
            if bool((p == 0).all()) or bool((p == 1).all()):
                p.add_(0.1 * torch.randn_like(p))
    return model


def token_batches(arch, seed, **kw):
    batches = H.random_batches(arch, seed, n_sequences=11, batch_size=5, **kw)
    rng = np.random.default_rng(seed)
    for b in batches:
        labels = torch.from_numpy(rng.integers(0, H.NUM_LABELS, tuple(b["input_ids"].shape)))
        labels[b["attention_mask"] == 0] = -100
        labels[:, 0] = -100  # e.g. a special token: not scored
        b["labels"] = labels
    return batches


@pytest.mark.parametrize("labels", ["predicted", "gold"])
@pytest.mark.parametrize("arch", H.ARCHS)
def test_sequence_classification_equals_the_per_example_loop(arch, labels):
    _, models, _ = H.cached_family(arch, "float64")
    data = H.random_batches(arch, 31, n_sequences=13, batch_size=6, min_len=2, labels=True)
    stats = collect_fisher(models[1], data, labels=labels, progress=False, description="d")
    assert stats.kind == "fisher" and stats.count() == 13 and stats.data == "d"
    assert stats.extra == {"labels": labels, "frozen": []}
    assert_close(stats, reference(models[1], data, gold=labels == "gold"), 1e-10)


@pytest.mark.parametrize("labels", ["predicted", "gold"])
@pytest.mark.parametrize("arch", sorted(TOKEN_CLASSES))
def test_token_classification_equals_the_per_example_loop(arch, labels):
    model = token_model(arch)
    data = token_batches(arch, 8)
    stats = collect_fisher(model, data, labels=labels, progress=False)
    assert stats.count() == 11
    assert_close(stats, reference(model, data, gold=labels == "gold"), 1e-10)


def test_float32_model_agrees_with_the_float64_loop_of_the_same_weights():
    _, models, _ = H.cached_family("bert")
    data = H.random_batches("bert", 32, n_sequences=12, batch_size=6, labels=True)
    stats = collect_fisher(models[0], data, labels="gold", progress=False)
    ref = reference(copy.deepcopy(models[0]).double(), data, gold=True)
    assert_close(stats, ref, 1e-5)


def test_padding_and_batching_do_not_change_results():
    _, models, _ = H.cached_family("gpt2", "float64")
    seqs = H.sequences_of(H.random_batches("gpt2", 33, n_sequences=9, min_len=1, max_len=20))
    alone = collect_fisher(models[0], H.batch_sequences("gpt2", seqs, 1), progress=False)
    batched = H.batch_sequences("gpt2", seqs, 9)
    wider = []
    for b in H.batch_sequences("gpt2", seqs, 4):  # extra padding columns on the right
        pad = torch.full((b["input_ids"].shape[0], 7), H.pad_id("gpt2"))
        wider.append(
            {
                "input_ids": torch.cat([b["input_ids"], pad], 1),
                "attention_mask": torch.cat([b["attention_mask"], torch.zeros_like(pad)], 1),
            }
        )
    for data in (batched, wider):
        stats = collect_fisher(models[0], data, progress=False)
        for name in alone.parameters:
            expected = alone.fisher(name)
            assert np.allclose(stats.fisher(name), expected, rtol=1e-10, atol=1e-14), name


def test_left_padding_equals_the_loop_over_padded_rows():
    # left padding moves the real tokens' positions, so each example counts with its row
    # as given (the model's own semantics); batched and per-row results agree
    _, models, _ = H.cached_family("bert", "float64")
    data = H.random_batches("bert", 34, n_sequences=8, batch_size=4)
    left = []
    for b in data:
        ids, mask = b["input_ids"].clone(), b["attention_mask"].clone()
        for i in range(ids.shape[0]):
            n = int(mask[i].sum())
            ids[i] = torch.roll(ids[i], ids.shape[1] - n)
            mask[i] = torch.roll(mask[i], ids.shape[1] - n)
        left.append({"input_ids": ids, "attention_mask": mask})
    stats = collect_fisher(models[0], left, progress=False)
    assert_close(stats, reference(models[0], left, gold=False, trim=False), 1e-10)


def test_patterns_match_parameter_names():
    _, models, _ = H.cached_family("bert", "float64")
    data = H.random_batches("bert", 35, n_sequences=6, batch_size=3)
    ref = reference(models[0], data, gold=False)
    stats = collect_fisher(
        models[0], data, include=["bert.encoder.*"], exclude=["*.bias"], progress=False
    )
    kept = {n for n in ref if n.startswith("bert.encoder.") and not n.endswith(".bias")}
    assert set(stats.parameters) == kept
    assert_close(stats, {n: ref[n] for n in kept}, 1e-10)
    # a module name alone matches no parameter: the error says patterns are parameter names
    with pytest.raises(ValueError, match=r"match parameter names such as 'bert\.embeddings"):
        collect_fisher(models[0], data, include=["bert.encoder.layer.0.output.dense"])


def test_frozen_parameters_are_skipped_and_recorded():
    _, models, _ = H.cached_family("bert", "float64")
    model = copy.deepcopy(models[0]).train()
    frozen = ["bert.embeddings.word_embeddings.weight", "bert.encoder.layer.0.output.dense.bias"]
    for name in frozen:
        model.get_parameter(name).requires_grad_(False)
    data = H.random_batches("bert", 36, n_sequences=6, batch_size=3)
    stats = collect_fisher(model, data, progress=False)
    assert stats.extra["frozen"] == sorted(frozen)
    model.eval()
    assert_close(stats, reference(model, data, gold=False), 1e-10)
    everything = collect_fisher(model, data, frozen=True, progress=False)
    assert everything.extra["frozen"] == [] and set(frozen) <= set(everything.parameters)
    assert_close(everything, reference(copy.deepcopy(models[0]), data, gold=False), 1e-10)
    # the model is left as it was: flags, training mode, no gradients, no hooks
    assert {n for n, p in model.named_parameters() if not p.requires_grad} == set(frozen)
    assert all(p.grad is None for p in model.parameters())
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    with pytest.raises(ValueError, match=r"frozen \(requires_grad=False\); pass frozen=True"):
        collect_fisher(model, data, include=frozen[:1], progress=False)


class _Odd(torch.nn.Module):
    """Every case the batched path cannot read off a layer, next to ones it can: a Linear
    used twice, a parameter of a module with submodules, an embedding tied to an output
    projection used outside its module, a Linear output changed in place, a leaf module
    that vmap runs (RMS norm), one that vmap cannot run (``.item()``) and a frozen layer."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(H.VOCAB, 6, padding_idx=0)
        self.twice = torch.nn.Linear(6, 6)
        self.inplace = torch.nn.Linear(6, 6)
        self.norm = _RMSNorm(6)
        self.fussy = _Fussy(6)
        self.scale = torch.nn.Parameter(torch.tensor(1.3))
        self.head = torch.nn.Linear(6, 3)

    def forward(self, input_ids, attention_mask):
        h = self.embed(input_ids)
        h = torch.tanh(self.twice(torch.tanh(self.twice(h))))
        k = self.inplace(h)
        k.mul_(0.5)
        h = self.fussy(self.norm(h + k)) * self.scale
        pooled = ((h * attention_mask[..., None]).sum(1)) / attention_mask.sum(1, keepdim=True)
        tied = torch.nn.functional.linear(pooled, self.embed.weight[3:6])  # outside self.embed
        return types.SimpleNamespace(logits=self.head(pooled) + tied)


class _RMSNorm(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(0.5, 1.5, d))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class _Fussy(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.linspace(-1.0, 1.0, d))

    def forward(self, x):
        if float(x.abs().max().item()) > 1e9:  # data-dependent: vmap cannot run it
            return x
        return x + torch.sin(self.weight * x)


def test_every_fallback_is_exact(monkeypatch):
    torch.manual_seed(3)
    model = _Odd().double().eval()
    model.head.bias.requires_grad_(False)
    data = H.random_batches("bert", 37, n_sequences=10, batch_size=4, min_len=1, max_len=9)
    looped = set()
    loop = fisher._per_example

    def spy(plan, *args):
        looped.update(plan.loop)
        return loop(plan, *args)

    monkeypatch.setattr(fisher, "_per_example", spy)
    stats = collect_fisher(model, data, progress=False)
    # the cases the batched path cannot read off a layer, and only those, took the loop
    assert looped == {"scale", "embed.weight", "inplace.weight", "inplace.bias", "fussy.weight"}
    assert stats.extra["frozen"] == ["head.bias"]
    ref = reference(model, data, gold=False)
    assert_close(stats, ref, 1e-10)
    assert not stats.fisher("embed.weight")[0].any()  # the padding row has no gradient
    assert stats.fisher("scale") > 0 and stats.fisher("fussy.weight").any()


def test_errors():
    _, models, _ = H.cached_family("bert")
    data = H.random_batches("bert", 3, n_sequences=4)
    with pytest.raises(ValueError, match="labels='gold' but a batch has no 'labels'"):
        collect_fisher(models[0], data, labels="gold", progress=False)
    with pytest.raises(ValueError, match="labels: expected 'predicted' or 'gold'"):
        collect_fisher(models[0], data, labels="argmax", progress=False)
    bad = [{**data[0], "labels": torch.zeros(3, dtype=torch.long)}]
    with pytest.raises(ValueError, match=r"labels of shape \(3,\) do not fit logits"):
        collect_fisher(models[0], bad, labels="gold", progress=False)
    with pytest.raises(ValueError, match="batches is empty"):
        collect_fisher(models[0], [], progress=False)
