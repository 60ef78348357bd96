"""RegMean++ against plain RegMean: the same K models, the same data, one run.

K "fine-tuned" copies of a randomly initialized ``BertModel`` (every parameter perturbed
by seeded Gaussian noise, 10 % of its standard deviation) each get their own synthetic
data: ``--seqs`` sequences of token ids with random real lengths up to ``--seq-len``,
right-padded per batch of ``--batch`` sequences, ``attention_mask`` 1 on real tokens.

Timed (models in memory, wall clock, median of ``--reps`` runs):

* ``regmean``: ``lmdx.collect_regmean_stats`` on each model and its data (padding
  excluded), then ``lmdx.merge_models(..., "regmean")``: the whole plain pipeline;
* ``regmean_plusplus``: ``lmdx.merge_models(..., "regmean_plusplus", data=...)`` on the
  same models and batches (its Grams are collected inside, block by block);
* ``forward``: one forward pass of each model over its batches (what a collection
  costs at least), for scale.

The three are interleaved within each of the ``--reps`` rounds. ``--threads N`` sets
torch's and lmdx's threads (on a loaded machine one thread is steadier).

Two sizes by default: the tests' tiny BERT (2 layers, hidden 32) and a small one (4 layers,
hidden 256, 4 heads, intermediate 1024). Both merges use ``--alpha``. Prints the load
average: record quiet runs (bench/README.md).

Run from the repository root: ``python bench/bench_regmean_plusplus.py --reps 3``.
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time
from typing import Any

import numpy as np

os.environ.setdefault("TQDM_DISABLE", "1")

SIZES = {
    "tiny": {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
             "intermediate_size": 37},
    "small": {"hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 4,
              "intermediate_size": 1024},
}  # fmt: skip


def models_and_data(size: str, k: int, seqs: int, seq_len: int, batch: int) -> Any:
    import torch
    from transformers import BertConfig, BertModel

    config = BertConfig(vocab_size=1000, max_position_embeddings=512, **SIZES[size])
    torch.manual_seed(0)
    base = BertModel(config, add_pooling_layer=False).eval()
    models, data = [], []
    rng = np.random.default_rng(1)
    for i in range(k):
        model = copy.deepcopy(base)
        gen = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.1 * float(p.std()) * torch.randn(p.shape, generator=gen))
        models.append(model)
        batches = []
        for start in range(0, seqs, batch):
            n = min(batch, seqs - start)
            lengths = rng.integers(seq_len // 4, seq_len + 1, n)
            width = int(lengths.max())
            ids = np.zeros((n, width), dtype=np.int64)
            mask = np.zeros((n, width), dtype=np.int64)
            for j, length in enumerate(lengths):
                ids[j, :length] = rng.integers(5, 1000, length)
                mask[j, :length] = 1
            batches.append(
                {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)}
            )
        data.append(batches)
    return models, data


def timed(fns: dict[str, Any], reps: int) -> tuple[dict[str, float], dict[str, Any]]:
    """Median wall time of each function over ``reps`` rounds, the functions interleaved
    within each round (so that a change in the machine's load hits them alike)."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    results: dict[str, Any] = {}
    for _ in range(reps):
        for key, fn in fns.items():
            t0 = time.perf_counter()
            results[key] = fn()
            samples[key].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}, results


def forward(models: list[Any], data: list[Any]) -> None:
    import torch

    with torch.no_grad():
        for model, batches in zip(models, data, strict=True):
            for b in batches:
                model(**b)


def plain(models: list[Any], data: list[Any], alpha: float, threads: int | None) -> Any:
    import lmdx

    stats = [
        lmdx.collect_regmean_stats(m, b, progress=False, n_threads=threads)
        for m, b in zip(models, data, strict=True)
    ]
    return lmdx.merge_models(
        models, "regmean", stats=stats, alpha=alpha, progress=False, n_threads=threads
    )


def plusplus(models: list[Any], data: list[Any], alpha: float, threads: int | None) -> Any:
    import lmdx

    return lmdx.merge_models(
        models, "regmean_plusplus", data=data, alpha=alpha, progress=False, n_threads=threads
    )


def main() -> None:
    import lmdx
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    parser.add_argument("--k", type=int, default=3, help="models")
    parser.add_argument("--seqs", type=int, default=64, help="sequences per model")
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--alpha", type=float, default=0.9)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch and lmdx threads (default: theirs)"
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
        f"{torch.__version__} ({torch.get_num_threads()} threads), lmdx {lmdx.__version__}, "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    print(
        f"K={args.k} models, {args.seqs} sequences of <= {args.seq_len} tokens each, "
        f"batches of {args.batch}, alpha={args.alpha}, median of {args.reps}"
    )
    print(f"{'size':6} {'params':>8} {'forward':>9} {'regmean':>9} {'regmean++':>10} {'ratio':>6}")
    for size in args.sizes:
        models, data = models_and_data(size, args.k, args.seqs, args.seq_len, args.batch)
        params = sum(p.numel() for p in models[0].parameters())
        fns = {
            "forward": lambda: forward(models, data),  # noqa: B023
            "regmean": lambda: plain(models, data, args.alpha, args.threads),  # noqa: B023
            "regmean++": lambda: plusplus(models, data, args.alpha, args.threads),  # noqa: B023
        }
        t, results = timed(fns, args.reps)
        run = results["regmean++"].report["regmean_plusplus"]
        print(
            f"{size:6} {params / 1e6:7.2f}M {t['forward']:8.3f}s {t['regmean']:8.3f}s "
            f"{t['regmean++']:9.3f}s {t['regmean++'] / t['regmean']:5.2f}x   "
            f"({run['block_forwards']} block forwards, {run['prefix_forwards']} prefix runs)"
        )


if __name__ == "__main__":
    main()
