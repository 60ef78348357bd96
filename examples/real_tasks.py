"""The real example's tasks and options (``examples/regmean_real.py``): four labelled text
classification tasks from :mod:`lmdx.data.corpora` cut into fixed, class-balanced splits,
the example's command-line options (which ``examples/regmean_surrogate.py`` and
``bench/bench_methods.py`` take too), its log and its cache files (written atomically)."""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from lmdx.data import corpora

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


def arg_parser(description: str) -> argparse.ArgumentParser:
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
