"""Tiny Hugging Face models built from configs, fine-tuned stand-ins and float64 references.

Shared by stats/test_collect.py, stats/test_stats_file.py and merge/test_merge.py. No
reference here calls lmdx: they (module-input Grams captured by this module's own forward hooks) are
independent of the code under test; ``collect`` is only a shorthand for calling it.

* four architectures with a 3-class sequence-classification head: BERT, RoBERTa, GPT-2
  (``Conv1D`` layers, weight ``[in, out]``) and a Llama-style model (q/k/v with grouped
  key/value heads, gate/up);
* ``finetuned``: copies of one base whose every floating-point tensor is perturbed by
  seeded noise;
* ``random_batches``: random token ids, right-padded with the model's pad id, with the
  matching attention mask;
* ``reference_grams``: per linear module, ``G = Σ x xᵀ``, ``s = Σ x`` and ``n`` in float64
  from its inputs, padding rows dropped by the attention mask (or kept);
* ``reference_regmean`` / ``reference_average``: the RegMean closed form solved with
  ``np.linalg.solve``, and the coefficient-weighted average, in float64.
"""

from __future__ import annotations

import copy
import fnmatch
import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from transformers.pytorch_utils import Conv1D

ARCHS = ("bert", "roberta", "gpt2", "llama")
VOCAB = 50
HIDDEN = 16
NUM_LABELS = 3
#: Parameter-name patterns of each architecture's task head.
HEADS = {
    "bert": ("classifier.*",),
    "roberta": ("classifier.*",),
    "gpt2": ("score.*",),
    "llama": ("score.*",),
}
#: Module-name prefix of the backbone (``model.base_model_prefix``).
PREFIX = {"bert": "bert", "roberta": "roberta", "gpt2": "transformer", "llama": "model"}
#: Module name of each architecture's stack of repeated blocks (layers).
BLOCKS = {
    "bert": "bert.encoder.layer",
    "roberta": "roberta.encoder.layer",
    "gpt2": "transformer.h",
    "llama": "model.layers",
}


def _config(arch: str) -> Any:
    common = {"vocab_size": VOCAB, "num_labels": NUM_LABELS}
    if arch == "bert":
        return transformers.BertConfig(
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=24,
            max_position_embeddings=64,
            pad_token_id=0,
            **common,
        )
    if arch == "roberta":
        return transformers.RobertaConfig(
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=24,
            max_position_embeddings=64,
            pad_token_id=1,
            bos_token_id=0,
            eos_token_id=2,
            **common,
        )
    if arch == "gpt2":
        return transformers.GPT2Config(
            n_embd=HIDDEN,
            n_layer=2,
            n_head=2,
            n_inner=32,
            n_positions=64,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=2,
            **common,
        )
    if arch == "llama":
        return transformers.LlamaConfig(
            hidden_size=HIDDEN,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            intermediate_size=24,
            max_position_embeddings=64,
            pad_token_id=0,
            bos_token_id=2,
            eos_token_id=2,
            **common,
        )
    raise ValueError(arch)


_CLASSES = {
    "bert": "BertForSequenceClassification",
    "roberta": "RobertaForSequenceClassification",
    "gpt2": "GPT2ForSequenceClassification",
    "llama": "LlamaForSequenceClassification",
}


def collect(model: Any, batches: Any, **kwargs: Any) -> Any:
    """lmdx's statistics of ``model`` on ``batches``, without a progress bar."""
    from lmdx.stats.collect import collect_regmean_stats

    return collect_regmean_stats(model, batches, progress=False, **kwargs)


def pad_id(arch: str) -> int:
    return int(_config(arch).pad_token_id)


def build_base(arch: str, seed: int = 0, **overrides: Any) -> Any:
    """A randomly initialized model standing in for a pre-trained checkpoint.

    Norm scales and biases are moved away from their 1/0 initialization so that layer
    inputs are not confined to a hyperplane (their Grams are then well conditioned).
    """
    config = _config(arch)
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = getattr(transformers, _CLASSES[arch])(config).eval()
    spread_init(model, seed)
    return model


def spread_init(model: Any, seed: int) -> None:
    """Move every parameter initialized to all 0 or all 1 (norm scales, biases) by seeded
    noise of 0.1, in place."""
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            if bool((p == 0).all()) or bool((p == 1).all()):
                p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))


def finetuned(base: Any, seed: int, scale: float = 0.1) -> Any:
    """A copy of ``base`` with every floating-point tensor moved by seeded noise of
    ``scale`` times that tensor's root-mean-square."""
    model = copy.deepcopy(base)
    gen = torch.Generator().manual_seed(1000 + seed)
    with torch.no_grad():
        for p in model.parameters():
            rms = float(p.double().pow(2).mean().sqrt())
            p.add_(scale * rms * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return model


def family(arch: str, k: int = 3, seed: int = 0) -> tuple[Any, list[Any]]:
    """The base model and ``k`` fine-tuned copies of it."""
    base = build_base(arch, seed)
    return base, [finetuned(base, seed * 100 + i) for i in range(k)]


@functools.cache
def cached_family(arch: str, dtype: str = "float32", k: int = 3) -> tuple[Any, tuple, tuple]:
    """Base, ``k`` fine-tuned models and each model's own data, built once per session.

    Tests must not modify these (tests that do work on copies); ``dtype="float64"``
    converts the models so that every activation is exact in float64.
    """
    base, models = family(arch, k)
    if dtype == "float64":
        base = base.double()
        models = [m.double() for m in models]
    batches = tuple(random_batches(arch, 10 + i) for i in range(k))
    return base, tuple(models), batches


def saved_family(root: Path, arch: str) -> dict[str, Any]:
    """:func:`cached_family` written under ``root``: model folders ``{arch}{i}``, each
    model's statistics on its own batches (``{arch}{i}.safetensors``) and the base's folder
    ``{arch}-base``. Returns ``base`` and ``models`` (the modules), ``paths``, ``stats``
    and ``base_path``."""
    base, models, batches = cached_family(arch)
    paths, stats = [], []
    for i, (m, b) in enumerate(zip(models, batches, strict=True)):
        p = root / f"{arch}{i}"
        m.save_pretrained(p)
        paths.append(p)
        stats.append(collect(m, b).save(root / f"{arch}{i}.safetensors"))
    base_path = root / f"{arch}-base"
    base.save_pretrained(base_path)
    return {"base": base, "models": models, "paths": paths, "stats": stats, "base_path": base_path}


def forged_stats(path: Any, out: Path, groups: Any = None) -> Path:
    """The statistics file ``path`` with every Gram and sum ×100 (only those of the input
    groups in ``groups``, if given), the row counts kept, written anew (its content hashes
    recomputed: every file check passes)."""
    from lmdx.stats import Statistics

    s = Statistics.load(path)

    def forged(name: str) -> bool:
        kind, _, group = name.partition("/")
        return kind in ("gram", "sum") and (groups is None or group in groups)

    tensors = {t.name: s.packed(t.name) * (100.0 if forged(t.name) else 1.0) for t in s.specs()}
    return Path(s.rebuilt(tensors).save(out))


def random_batches(
    arch: str,
    seed: int,
    *,
    n_sequences: int = 40,
    batch_size: int = 8,
    min_len: int = 3,
    max_len: int = 14,
    labels: bool = False,
) -> list[dict[str, Any]]:
    """Random token ids (never the pad id), right-padded per batch, with attention masks.

    Every batch holds sequences of different lengths, so it has real padding.
    """
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_len, max_len + 1, n_sequences)
    seqs = [rng.integers(3, VOCAB, n) for n in lengths]
    gold = rng.integers(0, NUM_LABELS, n_sequences)
    return batch_sequences(arch, seqs, batch_size, gold if labels else None)


def batch_sequences(
    arch: str, seqs: list[Any], batch_size: int, labels: Any = None
) -> list[dict[str, Any]]:
    """Right-pad token-id sequences into batches of ``batch_size``."""
    pad = pad_id(arch)
    out = []
    for start in range(0, len(seqs), batch_size):
        chunk = seqs[start : start + batch_size]
        width = max(len(s) for s in chunk)
        ids = np.full((len(chunk), width), pad, dtype=np.int64)
        mask = np.zeros((len(chunk), width), dtype=np.int64)
        for i, s in enumerate(chunk):
            ids[i, : len(s)] = s
            mask[i, : len(s)] = 1
        batch = {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}
        if labels is not None:
            batch["labels"] = torch.as_tensor(np.asarray(labels[start : start + batch_size]))
        out.append(batch)
    return out


def sequences_of(batches: list[dict[str, Any]]) -> list[Any]:
    """The unpadded token-id sequences of ``batches``, in order."""
    seqs = []
    for b in batches:
        for ids, mask in zip(b["input_ids"], b["attention_mask"], strict=True):
            seqs.append(ids[mask.bool()].numpy())
    return seqs


def linear_modules(model: Any) -> dict[str, tuple[Any, str]]:
    """Every ``nn.Linear`` / ``Conv1D`` of ``model``: name -> (module, layout)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            out[name] = (module, "linear")
        elif isinstance(module, Conv1D):
            out[name] = (module, "conv1d")
    return out


def input_dim(module: Any, layout: str) -> int:
    return int(module.weight.shape[1] if layout == "linear" else module.weight.shape[0])


def reference_grams(
    model: Any, batches: list[dict[str, Any]], include_padding: bool
) -> dict[str, dict[str, Any]]:
    """Per linear module: float64 ``gram`` (Σ x xᵀ), ``sum`` (Σ x) and ``count`` of its
    input rows over ``batches``, captured by forward pre-hooks.

    Token-level inputs (batch, tokens, d) lose the rows whose attention mask is 0 unless
    ``include_padding``; per-sequence inputs (batch, d) keep every row.
    """
    modules = linear_modules(model)
    acc = {
        name: {
            "gram": np.zeros((input_dim(m, lay), input_dim(m, lay))),
            "sum": np.zeros(input_dim(m, lay)),
            "count": 0.0,
        }
        for name, (m, lay) in modules.items()
    }
    state: dict[str, Any] = {}

    def hook_for(name: str) -> Any:
        def hook(module: Any, args: tuple[Any, ...]) -> None:
            x = args[0].detach().to(torch.float64)
            mask = state["mask"]
            if x.dim() == 3 and tuple(x.shape[:2]) == tuple(mask.shape) and not include_padding:
                rows = x[mask.bool()]
            else:
                rows = x.reshape(-1, x.shape[-1])
            r = rows.numpy()
            acc[name]["gram"] += r.T @ r
            acc[name]["sum"] += r.sum(axis=0)
            acc[name]["count"] += float(r.shape[0])

        return hook

    handles = [m.register_forward_pre_hook(hook_for(n)) for n, (m, _) in modules.items()]
    try:
        with torch.no_grad():
            for batch in batches:
                state["mask"] = batch["attention_mask"]
                model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    finally:
        for h in handles:
            h.remove()
    return acc


def reference_regmean(grams, counts, weights, alpha, coefficients, layout, prior=None):
    """The paper's closed form in float64 (weights in their stored layout):
    ``W_Mᵀ = (Σ c_i G̃_i)⁻¹ Σ c_i G̃_i W_iᵀ``, ``G̃_i = α G_i/n_i + (1−α) diag(G_i/n_i)``;
    with ``prior = (λ, W_a)``, RegMean's prior: ``Λ = λ t I`` (``t = tr(Σ c_i G̃_i) / d``)
    added to the system and ``Λ W_aᵀ`` to the right-hand side."""
    c = np.ones(len(grams)) if coefficients is None else np.asarray(coefficients, float)
    lhs, rhs = 0.0, 0.0
    for ci, g, n, w in zip(c, grams, counts, weights, strict=True):
        g_hat = g / n
        g_tilde = alpha * g_hat + (1.0 - alpha) * np.diag(np.diag(g_hat))
        lhs = lhs + ci * g_tilde
        rhs = rhs + ci * g_tilde @ (w.T if layout == "linear" else w)
    if prior is not None:
        strength, anchor = prior
        t = strength * np.trace(lhs) / lhs.shape[0]
        lhs = lhs + t * np.eye(lhs.shape[0])
        rhs = rhs + t * (anchor.T if layout == "linear" else anchor)
    solved = np.linalg.solve(lhs, rhs)
    return solved.T if layout == "linear" else solved


def reference_average(tensors, coefficients):
    """``Σ c_i θ_i / Σ c_i`` in float64."""
    c = np.ones(len(tensors)) if coefficients is None else np.asarray(coefficients, float)
    return sum(ci * t for ci, t in zip(c, tensors, strict=True)) / c.sum()


def state_arrays(model_or_state: Any) -> dict[str, np.ndarray]:
    """A model's state dict as float64 NumPy arrays (copies)."""
    state = model_or_state
    if not isinstance(state, Mapping):
        state = state.state_dict()
    return {n: t.detach().to(torch.float64).numpy().copy() for n, t in state.items()}


def snapshot(model: Any) -> dict[str, Any]:
    """Exact copies of a model's state tensors (to check it was not modified)."""
    return {n: t.detach().clone() for n, t in model.state_dict().items()}


def same_state(model: Any, before: Mapping[str, Any]) -> bool:
    after = model.state_dict()
    return set(after) == set(before) and all(torch.equal(after[n], before[n]) for n in before)


def rel_err(got: Any, ref: Any) -> float:
    """‖got − ref‖ / ‖ref‖ in float64."""
    g = np.asarray(got.detach().to(torch.float64) if hasattr(got, "detach") else got, np.float64)
    r = np.asarray(ref, dtype=np.float64)
    assert g.shape == r.shape, (g.shape, r.shape)
    return float(np.linalg.norm(g - r) / np.linalg.norm(r))


def is_head(name: str, arch: str) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in HEADS[arch])


def leftovers(folder: os.PathLike[str] | str) -> list[str]:
    """Names in ``folder`` that look like an abandoned temporary file or directory."""
    return sorted(n for n in os.listdir(folder) if n.endswith(".tmp") or n.startswith("."))


def reference_fisher(
    model: Any, batches: list[dict[str, Any]], gold: bool
) -> tuple[dict[str, np.ndarray], int]:
    """Σ over examples of (∂ log p(y|x) / ∂θ)² per parameter, float64, and the example count.

    Each example is run alone on its real tokens; ``y`` is the model's argmax or, with
    ``gold``, the batch's ``labels``.
    """
    params = dict(model.named_parameters())
    sums = {n: np.zeros(tuple(p.shape)) for n, p in params.items()}
    examples = 0
    for batch in batches:
        for i in range(batch["input_ids"].shape[0]):
            length = int(batch["attention_mask"][i].sum())
            ids = batch["input_ids"][i : i + 1, :length]
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0]
            logp = torch.log_softmax(logits.to(torch.float64), dim=-1)
            y = int(batch["labels"][i]) if gold else int(torch.argmax(logits))
            grads = torch.autograd.grad(logp[y], list(params.values()), allow_unused=True)
            for name, g in zip(params, grads, strict=True):
                if g is not None:
                    sums[name] += g.detach().to(torch.float64).numpy() ** 2
            examples += 1
    return sums, examples


def assert_fisher_close(stats, ref, rtol=1e-5):
    """Per parameter within ``rtol`` of its norm, or of 1e-9 of the largest norm (the
    gradients of e.g. attention key biases vanish in exact arithmetic; only rounding
    noise is left of them)."""
    floor = 1e-9 * max(np.linalg.norm(v) for v in ref.values())
    for name in stats.parameters:
        expected = ref[name]
        got = stats.fisher(name)
        assert stats.parameters[name]["shape"] == list(expected.shape)
        err = np.linalg.norm(got - expected)
        assert err <= rtol * np.linalg.norm(expected) + floor, (name, err)
