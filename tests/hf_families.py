"""Tiny models of many Hugging Face architecture families, built from configs (nothing is
downloaded), their data, and float64 references of chosen layers' input Grams.

Shared by stats/test_architectures.py. No reference here calls lmdx: the Grams come from
this module's own forward hooks (for mixture-of-experts layers: the tokens routed to an
expert read off the router's choice, and the expert's down-projection input recomputed
in float64 from its weights), and the RegMean formula is written out in NumPy.

* ``FAMILIES``: per family, the model class, a tiny config, its inputs (text, text to
  text, images), its task heads and the layers whose merged weight is checked;
* ``build``: a randomly initialized model standing in for a pre-trained checkpoint
  (``hf_models.spread_init``) and ``hf_models.finetuned`` makes fine-tuned stand-ins;
* ``batches``: right-padded token ids with attention masks (encoder and decoder masks
  for encoder-decoder models, of different lengths), or random pixel values;
* ``reference_gram``: ``G = Σ x xᵀ`` and ``n`` in float64 of one layer's inputs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import hf_models as H
import numpy as np
import torch
import transformers

VOCAB = 64
HIDDEN = 16
IMAGE = 16  # pixels per side; patches of 8


@dataclass(frozen=True)
class Check:
    """One layer whose merged weight is checked against the float64 formula.

    ``module``: the in-memory module whose input is hooked; ``kind``: ``"linear"`` (an
    ``nn.Linear`` or a module computing ``F.linear(x, weight)``), ``"conv1d"`` (GPT-2's
    ``Conv1D``, weight ``[in, out]``), ``"expert_in"`` / ``"expert_mid"`` (expert
    ``expert``'s gate/up or down projection of a fused-experts module; ``rows``: the
    gate_up rows checked); ``stack``: whose padding mask applies to its rows
    (``"encoder"``: ``attention_mask``, ``"decoder"``: ``decoder_attention_mask``,
    ``None``: every row)."""

    module: str
    kind: str = "linear"
    stack: str | None = "encoder"
    expert: int = 0
    rows: tuple[int, int] | None = None

    def weight(self, model: Any) -> np.ndarray:
        """The layer's weight in ``model`` as float64 ``[out, in]``."""
        m = model.get_submodule(self.module)
        if self.kind == "linear":
            w = m.weight
        elif self.kind == "conv1d":
            w = m.weight.T
        elif self.kind == "expert_in":
            w = m.gate_up_proj[self.expert]
            w = w.T if m.is_transposed else w
            w = w if self.rows is None else w[self.rows[0] : self.rows[1]]
        else:
            w = m.down_proj[self.expert]
            w = w.T if m.is_transposed else w
        return w.detach().to(torch.float64).numpy().copy()


@dataclass(frozen=True)
class Family:
    """A Hugging Face architecture family in the matrix."""

    name: str
    cls: str
    config: Callable[[], Any]
    inputs: str = "text"  # "text" | "seq2seq" | "image"
    heads: tuple[str, ...] = ()
    checks: tuple[Check, ...] = ()
    note: str = ""
    #: Saved tensors (fnmatch patterns) lmdx cannot solve: averaged and reported.
    unsolved: tuple[str, ...] = ()

    @property
    def pad(self) -> int:
        return int(getattr(self.config(), "pad_token_id", 0) or 0)


def _bert_like(cfg_cls: Any, **kw: Any) -> Callable[[], Any]:
    base = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 24,
        "max_position_embeddings": 64,
        "num_labels": 3,
    }
    return lambda: cfg_cls(**{**base, **kw})


def _decoder(cfg_cls: Any, **kw: Any) -> Callable[[], Any]:
    base = {
        "vocab_size": VOCAB,
        "hidden_size": HIDDEN,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 24,
        "max_position_embeddings": 64,
        "pad_token_id": 0,
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    return lambda: cfg_cls(**{**base, **kw})


T = transformers
MOE = {"num_key_value_heads": 1, "num_experts_per_tok": 2}
QKV_LLAMA = Check("model.layers.1.self_attn.k_proj")
DOWN_LLAMA = Check("model.layers.0.mlp.down_proj")

FAMILIES: dict[str, Family] = {
    f.name: f
    for f in [
        # ---- encoders, with a sequence-classification head kept per model
        Family(
            "BERT",
            "BertForSequenceClassification",
            _bert_like(T.BertConfig, pad_token_id=0),
            heads=("classifier.*",),
            checks=(Check("bert.encoder.layer.1.attention.self.query"),),
        ),
        Family(
            "RoBERTa",
            "RobertaForSequenceClassification",
            _bert_like(T.RobertaConfig, pad_token_id=1, bos_token_id=0, eos_token_id=2),
            heads=("classifier.*",),
            checks=(Check("roberta.encoder.layer.0.output.dense"),),
        ),
        Family(
            "XLM-RoBERTa",
            "XLMRobertaForSequenceClassification",
            _bert_like(T.XLMRobertaConfig, pad_token_id=1, bos_token_id=0, eos_token_id=2),
            heads=("classifier.*",),
            checks=(Check("roberta.encoder.layer.1.intermediate.dense"),),
        ),
        Family(
            "DistilBERT",
            "DistilBertForSequenceClassification",
            lambda: T.DistilBertConfig(
                vocab_size=VOCAB,
                dim=HIDDEN,
                n_layers=2,
                n_heads=2,
                hidden_dim=24,
                max_position_embeddings=64,
                num_labels=3,
                pad_token_id=0,
            ),
            heads=("pre_classifier.*", "classifier.*"),
            checks=(Check("distilbert.transformer.layer.1.ffn.lin2"),),
        ),
        Family(
            "ALBERT",
            "AlbertForSequenceClassification",
            _bert_like(
                T.AlbertConfig, embedding_size=8, pad_token_id=0, bos_token_id=2, eos_token_id=3
            ),
            heads=("classifier.*",),
            checks=(Check("albert.encoder.albert_layer_groups.0.albert_layers.0.ffn"),),
            note="one layer's weights shared by every layer: its Gram sums all their inputs",
        ),
        Family(
            "ELECTRA",
            "ElectraForSequenceClassification",
            _bert_like(T.ElectraConfig, embedding_size=8, pad_token_id=0),
            heads=("classifier.*",),
            checks=(Check("electra.embeddings_project"),),
        ),
        Family(
            "DeBERTa-v2",
            "DebertaV2ForSequenceClassification",
            _bert_like(T.DebertaV2Config, pad_token_id=0),
            heads=("classifier.*", "pooler.*"),
            checks=(Check("deberta.encoder.layer.0.attention.self.value_proj"),),
        ),
        Family(
            "MPNet",
            "MPNetForSequenceClassification",
            _bert_like(T.MPNetConfig, pad_token_id=1, bos_token_id=0, eos_token_id=2),
            heads=("classifier.*",),
            checks=(Check("mpnet.encoder.layer.0.attention.attn.q"),),
        ),
        # ---- decoders
        Family(
            "GPT-2",
            "GPT2LMHeadModel",
            lambda: T.GPT2Config(
                vocab_size=VOCAB,
                n_embd=HIDDEN,
                n_layer=2,
                n_head=2,
                n_inner=32,
                n_positions=64,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
            ),
            checks=(Check("transformer.h.1.attn.c_attn", kind="conv1d"),),
            note="Conv1D layers ([in, out]); lm_head tied to the embeddings",
        ),
        Family(
            "GPT-NeoX (Pythia)",
            "GPTNeoXForCausalLM",
            _decoder(T.GPTNeoXConfig),
            checks=(Check("gpt_neox.layers.0.attention.query_key_value"), Check("lm_head")),
            note="fused q/k/v; untied lm_head saved as embed_out",
        ),
        Family(
            "Llama",
            "LlamaForCausalLM",
            _decoder(T.LlamaConfig, num_key_value_heads=1, tie_word_embeddings=False),
            checks=(QKV_LLAMA, Check("lm_head")),
            note="grouped-query attention; untied lm_head",
        ),
        Family(
            "Mistral",
            "MistralForCausalLM",
            _decoder(T.MistralConfig, num_key_value_heads=1),
            checks=(DOWN_LLAMA,),
            note="grouped-query attention",
        ),
        Family(
            "Qwen2",
            "Qwen2ForCausalLM",
            _decoder(T.Qwen2Config, num_key_value_heads=1, tie_word_embeddings=True),
            checks=(Check("model.layers.1.self_attn.q_proj"),),
            note="grouped-query attention with q/k/v biases; lm_head tied",
        ),
        Family(
            "Gemma",
            "GemmaForCausalLM",
            _decoder(T.GemmaConfig, num_key_value_heads=1, head_dim=8),
            checks=(Check("model.layers.0.mlp.gate_proj"),),
            note="lm_head tied",
        ),
        Family(
            "Phi",
            "PhiForCausalLM",
            _decoder(T.PhiConfig),
            checks=(Check("model.layers.1.mlp.fc2"), Check("lm_head")),
        ),
        Family(
            "OPT",
            "OPTForCausalLM",
            lambda: T.OPTConfig(
                vocab_size=VOCAB,
                hidden_size=HIDDEN,
                num_hidden_layers=2,
                num_attention_heads=2,
                ffn_dim=24,
                activation_function="gelu",  # ReLU's dead units leave fc2's Gram singular
                word_embed_proj_dim=HIDDEN,
                max_position_embeddings=64,
                pad_token_id=1,
                bos_token_id=2,
                eos_token_id=2,
            ),
            checks=(Check("model.decoder.layers.1.fc1"),),
            note="lm_head tied",
        ),
        Family(
            "Falcon",
            "FalconForCausalLM",
            lambda: T.FalconConfig(
                vocab_size=VOCAB,
                hidden_size=HIDDEN,
                num_hidden_layers=2,
                num_attention_heads=2,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
            ),
            checks=(Check("transformer.h.0.self_attention.query_key_value"),),
            note="fused multi-query q/k/v; lm_head tied",
        ),
        # ---- encoder-decoder: one padding mask per stack
        Family(
            "T5",
            "T5ForConditionalGeneration",
            lambda: T.T5Config(
                vocab_size=VOCAB,
                d_model=HIDDEN,
                d_kv=8,
                d_ff=24,
                num_layers=2,
                num_heads=2,
                pad_token_id=0,
                eos_token_id=1,
                decoder_start_token_id=0,
            ),
            inputs="seq2seq",
            checks=(
                Check("encoder.block.0.layer.1.DenseReluDense.wo", stack="encoder"),
                Check("decoder.block.1.layer.0.SelfAttention.q", stack="decoder"),
                Check("decoder.block.0.layer.1.EncDecAttention.k", stack="encoder"),
            ),
            note="lm_head tied",
        ),
        Family(
            "BART",
            "BartForConditionalGeneration",
            lambda: T.BartConfig(
                vocab_size=VOCAB,
                d_model=HIDDEN,
                encoder_layers=1,
                decoder_layers=2,
                encoder_attention_heads=2,
                decoder_attention_heads=2,
                encoder_ffn_dim=24,
                decoder_ffn_dim=24,
                max_position_embeddings=64,
                pad_token_id=1,
                bos_token_id=0,
                eos_token_id=2,
                decoder_start_token_id=2,
                forced_eos_token_id=None,
            ),
            inputs="seq2seq",
            checks=(
                Check("model.encoder.layers.0.fc2", stack="encoder"),
                Check("model.decoder.layers.1.encoder_attn.v_proj", stack="encoder"),
                Check("model.decoder.layers.0.self_attn.k_proj", stack="decoder"),
            ),
            note="lm_head tied",
        ),
        # ---- mixtures of experts (fused 3-D expert tensors in memory)
        Family(
            "Mixtral",
            "MixtralForCausalLM",
            _decoder(T.MixtralConfig, num_local_experts=4, **MOE),
            checks=(
                Check("model.layers.0.mlp.experts", kind="expert_in", expert=1, rows=(0, 24)),
                Check("model.layers.1.mlp.experts", kind="expert_mid", expert=3),
                Check("model.layers.0.mlp.gate"),
            ),
            note="router and every expert solved; experts saved per expert (w1/w3/w2)",
        ),
        Family(
            "Qwen2-MoE",
            "Qwen2MoeForCausalLM",
            _decoder(
                T.Qwen2MoeConfig,
                moe_intermediate_size=12,
                shared_expert_intermediate_size=20,
                num_experts=4,
                **MOE,
            ),
            checks=(
                Check("model.layers.1.mlp.experts", kind="expert_in", expert=2, rows=(12, 24)),
                Check("model.layers.0.mlp.experts", kind="expert_mid", expert=0),
                Check("model.layers.0.mlp.shared_expert.up_proj"),
            ),
            note="with a shared expert",
        ),
        Family(
            "OLMoE",
            "OlmoeForCausalLM",
            _decoder(T.OlmoeConfig, num_experts=4, **MOE),
            checks=(
                Check("model.layers.1.mlp.experts", kind="expert_mid", expert=2),
                Check("model.layers.1.mlp.gate"),
            ),
        ),
        Family(
            "GPT-OSS",
            "GptOssForCausalLM",
            _decoder(
                T.GptOssConfig,
                num_local_experts=4,
                head_dim=8,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                **MOE,
            ),
            checks=(Check("model.layers.1.mlp.router"), Check("model.layers.0.self_attn.o_proj")),
            note="experts saved as 3-D tensors of all experts: averaged, and reported",
            unsolved=("*.mlp.experts.gate_up_proj", "*.mlp.experts.down_proj"),
        ),
        # ---- vision: pixel_values, no padding
        Family(
            "ViT",
            "ViTForImageClassification",
            lambda: T.ViTConfig(
                image_size=IMAGE,
                patch_size=8,
                hidden_size=HIDDEN,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=24,
                num_labels=3,
            ),
            inputs="image",
            heads=("classifier.*",),
            checks=(Check("vit.layers.1.attention.q_proj", stack=None),),
            note="renamed on save (attention.attention.query ...)",
        ),
        Family(
            "CLIP vision",
            "CLIPVisionModel",
            lambda: T.CLIPVisionConfig(
                image_size=IMAGE,
                patch_size=8,
                hidden_size=HIDDEN,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=24,
                projection_dim=8,
            ),
            inputs="image",
            checks=(Check("encoder.layers.0.mlp.fc1", stack=None),),
        ),
    ]
}


def build(family: Family, seed: int = 0) -> Any:
    """A randomly initialized model of ``family`` (float32, eval mode)."""
    torch.manual_seed(seed)
    model = getattr(transformers, family.cls)(family.config()).eval()
    H.spread_init(model, seed)
    return model


def _pad_rows(seqs: list[np.ndarray], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = np.full((len(seqs), width), pad, dtype=np.int64)
    mask = np.zeros((len(seqs), width), dtype=np.int64)
    for i, s in enumerate(seqs):
        ids[i, : len(s)] = s
        mask[i, : len(s)] = 1
    return torch.from_numpy(ids), torch.from_numpy(mask)


def batches(
    family: Family, seed: int, n_sequences: int = 24, batch_size: int = 8
) -> list[dict[str, Any]]:
    """Inputs for ``family``: random token ids (never a special id), right-padded per
    batch, with attention masks (for encoder-decoder models also decoder ids and masks,
    of other lengths), or random pixel values. The sequences depend on ``seed`` only,
    not on ``batch_size``."""
    rng = np.random.default_rng(seed)
    if family.inputs == "image":
        pixels = torch.from_numpy(
            rng.standard_normal((n_sequences, 3, IMAGE, IMAGE)).astype(np.float32)
        )
        return [
            {"pixel_values": pixels[i : i + batch_size]} for i in range(0, n_sequences, batch_size)
        ]
    seqs = [rng.integers(4, VOCAB, k) for k in rng.integers(3, 15, n_sequences)]
    targets = [rng.integers(4, VOCAB, k) for k in rng.integers(2, 10, n_sequences)]
    out = []
    for i in range(0, n_sequences, batch_size):
        ids, mask = _pad_rows(seqs[i : i + batch_size], family.pad)
        batch = {"input_ids": ids, "attention_mask": mask}
        if family.inputs == "seq2seq":
            dec, dec_mask = _pad_rows(targets[i : i + batch_size], family.pad)
            batch |= {"decoder_input_ids": dec, "decoder_attention_mask": dec_mask}
        out.append(batch)
    return out


def _rows(x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Rows of ``x`` (..., d) in float64, those whose mask is 0 left out."""
    x = x.detach().to(torch.float64)
    rows = x.reshape(-1, x.shape[-1])
    if mask is None:
        return rows
    return rows[mask.reshape(-1).bool()]


def _expert_mid(module: Any, x: torch.Tensor, e: int) -> torch.Tensor:
    """The input of expert ``e``'s down projection for rows ``x``, in float64: gate and up
    halves of the gate_up projection, silu(gate) * up (the families here)."""
    w = module.gate_up_proj[e].detach().to(torch.float64)
    h = x @ w if module.is_transposed else x @ w.T
    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def reference_gram(
    model: Any, family: Family, check: Check, data: list[dict[str, Any]]
) -> tuple[np.ndarray, float]:
    """``(Σ x xᵀ, n)`` in float64 over the rows the layer of ``check`` reads in ``data``
    (padding rows of its stack left out; for an expert, only the tokens routed to it)."""
    module = model.get_submodule(check.module)
    state: dict[str, Any] = {"gram": 0.0, "n": 0.0}

    def add(rows: torch.Tensor) -> None:
        r = rows.numpy()
        state["gram"] = state["gram"] + r.T @ r
        state["n"] += float(r.shape[0])

    def mask_for(x: torch.Tensor) -> torch.Tensor | None:
        if check.stack is None:
            return None
        key = "attention_mask" if check.stack == "encoder" else "decoder_attention_mask"
        mask = state["batch"][key]
        assert x.shape[:-1].numel() == mask.numel(), (check.module, x.shape, mask.shape)
        return mask

    def hook(mod: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if check.kind in ("linear", "conv1d"):
            x = args[0] if args else next(iter(kwargs.values()))
            add(_rows(x, mask_for(x)))
            return
        x = args[0] if args else kwargs["hidden_states"]
        index = args[1] if len(args) > 1 else kwargs["top_k_index"]
        mask = mask_for(x)
        keep = (index.reshape(x.shape[0], -1) == check.expert).any(dim=1)
        if mask is not None:
            keep &= mask.reshape(-1).bool()
        rows = x.detach().to(torch.float64)[keep]
        add(rows if check.kind == "expert_in" else _expert_mid(mod, rows, check.expert))

    handle = module.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            for batch in data:
                state["batch"] = batch
                model(**batch)
    finally:
        handle.remove()
    return np.asarray(state["gram"], dtype=np.float64), state["n"]


def regmean_reference(
    grams: list[np.ndarray], counts: list[float], weights: list[np.ndarray], alpha: float
) -> np.ndarray:
    """The paper's RegMean of ``[out, in]`` weights: ``W_Mᵀ = (Σ G̃_i)⁻¹ Σ G̃_i W_iᵀ`` with
    ``G̃_i = α G_i/n_i + (1−α) diag(G_i/n_i)``, in float64."""
    reduced = []
    for g, n in zip(grams, counts, strict=True):
        g = g / n
        reduced.append(alpha * g + (1 - alpha) * np.diag(np.diag(g)))
    lhs = sum(reduced)
    rhs = sum(r @ w.T for r, w in zip(reduced, weights, strict=True))
    return np.linalg.solve(lhs, rhs).T
