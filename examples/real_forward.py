"""The real example's encoder passes (``examples/regmean_real.py``): the frozen lower
layers run once per text and cached, the fine-tuned top layers on those states, the
fine-tuning itself, the logistic heads of the frozen baselines and accuracy."""

from __future__ import annotations

import argparse
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from real_tasks import Task, log
from torch import nn

try:  # transformers >= 4.56
    from transformers.masking_utils import create_bidirectional_mask
except ImportError:  # pragma: no cover - older transformers
    create_bidirectional_mask = None


def _attention_mask(model: Any, hidden: torch.Tensor, mask: torch.Tensor) -> Any:
    if create_bidirectional_mask is not None:
        return create_bidirectional_mask(
            config=model.config, inputs_embeds=hidden, attention_mask=mask
        )
    return model.get_extended_attention_mask(mask, mask.shape)  # pragma: no cover


def _run_layers(
    model: Any, layers: Sequence[nn.Module], h: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    att = _attention_mask(model, h, mask)
    for layer in layers:
        h = layer(h, attention_mask=att)
        if isinstance(h, tuple):
            h = h[0]
    return h


def pad_ids(seqs: Sequence[Sequence[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad, dtype=torch.long)
    mask = torch.zeros((len(seqs), width), dtype=torch.long)
    for row, s in enumerate(seqs):
        ids[row, : len(s)] = torch.as_tensor(s)
        mask[row, : len(s)] = 1
    return ids, mask


def pad_hidden(states: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(s.shape[0] for s in states)
    h = states[0].new_zeros((len(states), width, states[0].shape[1]))
    mask = torch.zeros((len(states), width), dtype=torch.long)
    for row, s in enumerate(states):
        h[row, : s.shape[0]] = s
        mask[row, : s.shape[0]] = 1
    return h, mask


def length_batches(lengths: Sequence[int], size: int) -> list[np.ndarray]:
    order = np.argsort(np.asarray(lengths), kind="stable")
    return [order[i : i + size] for i in range(0, len(order), size)]


@torch.no_grad()
def bottom_states(
    model: Any, seqs: Sequence[Sequence[int]], n_bottom: int, pad: int, batch_size: int = 64
) -> list[torch.Tensor]:
    """Output of the embeddings and the lower ``n_bottom`` layers, per text (real tokens)."""
    model.eval()
    out: list[torch.Tensor] = [None] * len(seqs)  # type: ignore[list-item]
    layers = model.bert.encoder.layer[:n_bottom]
    for idx in length_batches([len(s) for s in seqs], batch_size):
        ids, mask = pad_ids([seqs[i] for i in idx], pad)
        h = model.bert.embeddings(input_ids=ids, token_type_ids=torch.zeros_like(ids))
        h = _run_layers(model, layers, h, mask)
        for row, i in enumerate(idx):
            out[i] = h[row, : len(seqs[i])].clone()
    return out


def _last_layer_cls(layer: Any, h: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """A BertLayer's output at the first ([CLS]) position only, (B, 1, D).

    The pooler reads nothing else, so in the last layer only the keys and values are
    needed at every position: the query, attention output and MLP run for one token.
    Same modules and dropouts as ``BertLayer.forward``; checked against the model's own
    forward pass at start-up (:func:`check_split_forward`).
    """
    att = layer.attention.self
    b = h.shape[0]
    heads, size = att.num_attention_heads, att.attention_head_size

    def split(x: torch.Tensor) -> torch.Tensor:
        return x.view(b, x.shape[1], heads, size).transpose(1, 2)

    q, k, v = split(att.query(h[:, :1])), split(att.key(h)), split(att.value(h))
    bias = (1.0 - mask[:, None, None, :].to(h.dtype)) * torch.finfo(h.dtype).min
    ctx = nn.functional.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=bias,
        dropout_p=att.dropout.p if att.training else 0.0,
        scale=getattr(att, "scaling", size**-0.5),
    )
    ctx = ctx.transpose(1, 2).reshape(b, 1, heads * size)
    out = layer.attention.output(ctx, h[:, :1])
    return layer.output(layer.intermediate(out), out)


def top_pooled(model: Any, states: Sequence[torch.Tensor], n_bottom: int) -> torch.Tensor:
    """The upper layers and the pooler of ``model`` on bottom states: (B, D)."""
    h, mask = pad_hidden(states)
    layers = model.bert.encoder.layer
    h = _run_layers(model, layers[n_bottom:-1], h, mask)
    return model.bert.pooler(_last_layer_cls(layers[-1], h, mask))


def top_logits(model: Any, states: Sequence[torch.Tensor], n_bottom: int) -> torch.Tensor:
    """The rest of ``model`` (upper layers, pooler, dropout, classifier) on bottom states."""
    return model.classifier(model.dropout(top_pooled(model, states, n_bottom)))


@torch.no_grad()
def pooled_features(
    model: Any, states: Sequence[torch.Tensor], n_bottom: int, batch_size: int = 64
) -> torch.Tensor:
    model.eval()
    out = torch.empty(len(states), model.config.hidden_size)
    for idx in length_batches([s.shape[0] for s in states], batch_size):
        out[torch.as_tensor(idx)] = top_pooled(model, [states[i] for i in idx], n_bottom)
    return out


@torch.no_grad()
def mean_pooled(model: Any, seqs: Sequence[Sequence[int]], pad: int) -> torch.Tensor:
    """The mean of the last hidden states over each text's real tokens: (N, D)."""
    states = bottom_states(model, seqs, model.config.num_hidden_layers, pad)
    return torch.stack([h.mean(0) for h in states])


@torch.no_grad()
def accuracy(
    model: Any,
    states: Sequence[torch.Tensor],
    labels: np.ndarray,
    n_bottom: int,
    batch_size: int = 64,
) -> float:
    model.eval()
    correct = 0
    for idx in length_batches([s.shape[0] for s in states], batch_size):
        logits = top_logits(model, [states[i] for i in idx], n_bottom)
        correct += int((logits.argmax(-1).numpy() == labels[idx]).sum())
    return correct / len(states)


def check_split_forward(
    model: Any, tokenizer: Any, texts: Sequence[str], n_bottom: int, max_length: int
) -> float:
    """Max |logit difference| between bottom+top and the model's own forward."""
    model.eval()
    seqs = tokenizer(list(texts), truncation=True, max_length=max_length)["input_ids"]
    ids, mask = pad_ids(seqs, tokenizer.pad_token_id)
    with torch.no_grad():
        full = model(input_ids=ids, attention_mask=mask).logits
        split = top_logits(
            model, bottom_states(model, seqs, n_bottom, tokenizer.pad_token_id), n_bottom
        )
    return float((full - split).abs().max())


# ------------------------------------------------------------------------- training


def trainable_prefixes(n_layers: int, n_top: int) -> list[str]:
    return [f"bert.encoder.layer.{i}." for i in range(n_layers - n_top, n_layers)] + [
        "bert.pooler.",
        "classifier.",
    ]


def bucket_batches(lengths: Sequence[int], size: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Random batches of similar lengths (shuffle, sort within chunks, shuffle batches)."""
    perm = rng.permutation(len(lengths))
    chunk = size * 32
    batches = []
    for start in range(0, len(perm), chunk):
        part = perm[start : start + chunk]
        part = part[np.argsort([lengths[i] for i in part], kind="stable")]
        batches.extend(part[i : i + size] for i in range(0, len(part), size))
    return [batches[i] for i in rng.permutation(len(batches))]


def fine_tune(
    model: Any,
    task: Task,
    h_train: list[torch.Tensor],
    h_val: list[torch.Tensor],
    n_bottom: int,
    args: argparse.Namespace,
    seed: int,
) -> list[float]:
    prefixes = trainable_prefixes(model.config.num_hidden_layers, args.layers)
    params = []
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith(tuple(prefixes)))
        if p.requires_grad:
            params.append(p)
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.01)
    steps_per_epoch = math.ceil(len(h_train) / args.batch_size)
    total = args.epochs * steps_per_epoch
    warmup = max(1, total // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min((s + 1) / warmup, max(0.0, (total - s) / (total - warmup)))
    )
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)
    y = torch.as_tensor(task.labels["train"])
    lengths = [h.shape[0] for h in h_train]
    val_acc = []
    for epoch in range(args.epochs):
        model.train()
        t = time.perf_counter()
        loss_sum = 0.0
        for idx in bucket_batches(lengths, args.batch_size, rng):
            logits = top_logits(model, [h_train[i] for i in idx], n_bottom)
            loss = nn.functional.cross_entropy(logits, y[torch.as_tensor(idx)])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            sched.step()
            loss_sum += float(loss.detach()) * len(idx)
        val_acc.append(accuracy(model, h_val, task.labels["val"], n_bottom))
        log(
            f"  {task.name} epoch {epoch + 1}/{args.epochs}: train loss "
            f"{loss_sum / len(h_train):.3f}, val acc {100 * val_acc[-1]:.1f} % "
            f"({time.perf_counter() - t:.0f} s)"
        )
    for p in model.parameters():
        p.requires_grad_(True)
    model.eval()
    return val_acc


def fit_logistic(
    x: torch.Tensor, y: torch.Tensor, n_classes: int, l2: float, seed: int
) -> nn.Linear:
    torch.manual_seed(seed)
    head = nn.Linear(x.shape[1], n_classes)
    nn.init.normal_(head.weight, std=0.02)
    nn.init.zeros_(head.bias)
    opt = torch.optim.LBFGS(head.parameters(), max_iter=300, line_search_fn="strong_wolfe")

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.cross_entropy(head(x), y) + l2 * head.weight.pow(2).sum()
        loss.backward()
        return loss

    opt.step(closure)
    return head


def train_head(
    features: dict[str, torch.Tensor], labels: dict[str, np.ndarray], n_classes: int, seed: int
) -> tuple[nn.Linear, float, float]:
    """Logistic regression on frozen features (L-BFGS), L2 strength chosen on val."""
    x, y = features["train"], torch.as_tensor(labels["train"])
    best: tuple[float, float, nn.Linear] | None = None
    for l2 in (1e-4, 1e-3, 1e-2):
        head = fit_logistic(x, y, n_classes, l2, seed)
        with torch.no_grad():
            acc = float((head(features["val"]).argmax(-1).numpy() == labels["val"]).mean())
        if best is None or acc > best[0]:
            best = (acc, l2, head)
    assert best is not None
    return best[2], best[0], best[1]


# ---------------------------------------------------------------------------- cache
