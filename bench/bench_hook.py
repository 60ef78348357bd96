"""The cost of lmdx's collection hooks, separated from the Gram arithmetic.

On a BERT-base-sized model (random init from a config, no download) over padded random
token batches, median wall time of

* ``forward``: the model alone (``torch.no_grad``, ``eval``);
* ``hooks``: :func:`lmdx.collect_regmean_stats` with the native ``Moments.update``
  replaced by a function that does nothing — what remains is the Python side: the
  forward pre-hooks, mask handling, the hand-over of each activation as a NumPy view,
  the shared-input bookkeeping (weak references), the probe and the weight hash;
* ``full``: the real collection.

``hooks − forward`` is the hook path's overhead (also per module call), ``full − hooks``
the arithmetic. The run also checks that every activation reaches the core without a
copy (the array handed over shares memory with the module's input tensor).

    python bench/bench_hook.py [--reps 5] [--seqs 64] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import lmdx
import lmdx.moments
import lmdx.stats.collect as collect
import lmdx.stats.collector as collector
import lmdx.stats.sites as sites
import numpy as np
import torch
import transformers
from lmdx.files.identity import model_identity


def _batches(n: int, length: int, batch: int, vocab: int, seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    out = []
    for start in range(0, n, batch):
        m = min(batch, n - start)
        lengths = rng.integers(length // 5, length + 1, m)
        ids = np.zeros((m, length), dtype=np.int64)
        mask = np.zeros((m, length), dtype=np.int64)
        for i, L in enumerate(lengths):
            ids[i, :L] = rng.integers(5, vocab, L)
            mask[i, :L] = 1
        out.append({"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)})
    return out


class _NoArithmetic:
    """Stands in for the native accumulator: counts the rows it was handed."""

    def __init__(self, dim: int) -> None:
        self.dim = dim
        self.count = 0.0
        self.calls = 0

    def update(self, *, x, **kwargs):
        self.calls += 1
        self.count += x.shape[0]


class _StubMoments(lmdx.Moments):
    """``lmdx.Moments`` whose ``update`` runs its Python side (the hand-over of the rows,
    mask and weights) and hands the rows to :class:`_NoArithmetic` instead of the core."""

    def __init__(self, dim: int) -> None:
        self._native = _NoArithmetic(dim)

    @property
    def sum(self):
        return np.zeros(self.dim)

    def gram(self):
        return np.zeros((self.dim, self.dim))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = transformers.BertConfig()  # BERT-base shapes
    torch.manual_seed(0)
    model = transformers.BertModel(cfg, add_pooling_layer=False).eval()
    batches = _batches(args.seqs, args.seq_len, args.batch, cfg.vocab_size, 0)
    real = sum(int(b["attention_mask"].sum()) for b in batches)
    n_modules = len(sites.find_linear_modules(model))

    # the hand-over makes no copy: check on every call of one collection
    shared = {"yes": 0, "no": 0}
    real_as_rows = lmdx.moments.as_gram_rows

    def checking_as_rows(x, dim, name="x"):
        rows, leading, bfloat16 = real_as_rows(x, dim, name)
        whole = x.detach().numpy()
        shared["yes" if np.shares_memory(rows, whole) else "no"] += 1
        return rows, leading, bfloat16

    lmdx.moments.as_gram_rows = checking_as_rows
    try:
        collect.collect_regmean_stats(model, batches[:1], progress=False, n_threads=args.threads)
    finally:
        lmdx.moments.as_gram_rows = real_as_rows

    def forward() -> None:
        with torch.no_grad():
            for b in batches:
                model(**b)

    def full() -> None:
        collect.collect_regmean_stats(model, batches, progress=False, n_threads=args.threads)

    inside = {"seconds": 0.0, "calls": 0}
    real_accumulate = collector.GramCollector._accumulate

    def timed_accumulate(self, name, x):
        t0 = time.perf_counter()
        try:
            return real_accumulate(self, name, x)
        finally:
            inside["seconds"] += time.perf_counter() - t0
            inside["calls"] += 1

    def hooks() -> None:
        real_moments = collector.Moments
        collector.Moments = _StubMoments  # type: ignore[misc,assignment]
        collector.GramCollector._accumulate = timed_accumulate  # type: ignore[method-assign]
        try:
            collect.collect_regmean_stats(model, batches, progress=False, n_threads=args.threads)
        finally:
            collector.Moments = real_moments  # type: ignore[misc]
            collector.GramCollector._accumulate = real_accumulate  # type: ignore[method-assign]

    times: dict[str, list[float]] = {"forward": [], "hooks": [], "full": []}
    for _ in range(args.reps):  # interleaved, so the three see the same conditions
        for name, fn in (("forward", forward), ("hooks", hooks), ("full", full)):
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    t0 = time.perf_counter()
    model_identity(model)
    identity = time.perf_counter() - t0
    calls = n_modules * len(batches)
    print(
        f"lmdx {lmdx.__version__}; BERT-base shapes, {n_modules} linear modules, "
        f"{len(batches)} batches of {args.batch} x {args.seq_len} ({real} real tokens), "
        f"{args.threads} threads, median of {args.reps}; load {os.getloadavg()[0]:.2f}"
    )
    print(f"activations handed to the core without a copy: {shared['yes']} of "
          f"{shared['yes'] + shared['no']} module calls")  # fmt: skip
    print("| run | median s | over forward | per module call |")
    print("|---|---:|---:|---:|")
    print(f"| forward | {med['forward']:.2f} | | |")
    hook = med["hooks"] - med["forward"]
    arith = med["full"] - med["hooks"]
    print(f"| hooks (no arithmetic) | {med['hooks']:.2f} | {hook:+.2f} s "
          f"({hook / med['forward']:.3f}×) | {hook / calls * 1e6:.0f} µs |")  # fmt: skip
    print(f"| full collection | {med['full']:.2f} | {med['full'] - med['forward']:+.2f} s "
          f"({(med['full'] - med['forward']) / med['forward']:.3f}×) | |")  # fmt: skip
    per_call = inside["seconds"] / max(inside["calls"], 1)
    print(f"inside lmdx's hook (mask rows, hand-over as a view, shared-input checks; no "
          f"arithmetic): {per_call * 1e6:.0f} µs per call, {inside['calls']} calls in "
          f"{args.reps} runs; weight hash (model_identity, once per collection): "
          f"{identity:.2f} s")  # fmt: skip
    share = hook / max(med["full"] - med["forward"], 1e-9)
    print(f"arithmetic (full − hooks): {arith:.2f} s = {arith / med['forward']:.3f}× forward; "
          f"hook path: {share:.1%} of the overhead")  # fmt: skip


if __name__ == "__main__":
    main()
