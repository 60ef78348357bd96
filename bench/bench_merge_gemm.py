"""RegMean merge of a BERT-base-sized model (K = 3) against its pure-GEMM time.

Issue 6's merge goal: the merge runs within 1.3x of the time its flop count takes at the
GEMM rate this machine achieves. This script times lmdx's native per-layer merge
(``lmdx._core.core.regmean_merge_layer``: right-hand side, Cholesky, solves; float64) over the
layer shapes of BERT-base -- per encoder layer one q/k/v group (768 -> 2304, one shared
Gram), the attention output (768 -> 768), the intermediate (768 -> 3072) and the output
(3072 -> 768), times 12 layers -- and measures torch's fp64 GEMM rate (3072 x 3072 x 768,
same thread count) in the same run. Layers of one shape are timed once and counted 12
times (their inputs are alike). Flops per layer: ``merge_work.regmean_flops``, as the core
computes since it solves for the deviation from the average (K − 1 right-hand-side
products, Cholesky, solves). (Runs before 2026-12-02 08:45 counted K products,
2·K·d_in²·d_out, which had become one too many.)

    python bench/bench_merge_gemm.py [--reps 3] [--threads 1 2]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch
from lmdx._core import core
from merge_work import regmean_flops

K = 3
LAYERS = 12
SHAPES = {"q/k/v group": (768, 2304), "attn out": (768, 768), "intermediate": (768, 3072),
          "output": (3072, 768)}  # fmt: skip
ALPHA = 0.9


def gemm_rate(threads: int, reps: int) -> float:
    """torch fp64 GEMM flop/s, best of ``reps``."""
    torch.set_num_threads(threads)
    a = torch.randn(3072, 3072, dtype=torch.float64)
    b = torch.randn(3072, 768, dtype=torch.float64)
    a @ b
    best = min(_timed(lambda: a @ b) for _ in range(reps))
    return 2 * 3072 * 3072 * 768 / best


def _timed(fn) -> float:  # type: ignore[no-untyped-def]
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    inputs = {}
    for name, (d_in, d_out) in SHAPES.items():
        grams = []
        for _ in range(K):
            x = rng.standard_normal((2 * d_in, d_in)) * rng.uniform(0.5, 2.0, d_in)
            grams.append(x.T @ x)
        weights = [rng.standard_normal((d_out, d_in)).astype(np.float32) for _ in range(K)]
        inputs[name] = (grams, [2.0 * d_in] * K, weights)
    print(f"K = {K}, α = {ALPHA}, best of {args.reps}; per-layer times x {LAYERS} layers")
    for t in args.threads:
        rate = gemm_rate(t, args.reps)
        total_s = total_flops = 0.0
        for name, (d_in, d_out) in SHAPES.items():
            grams, counts, weights = inputs[name]

            def merge(grams=grams, counts=counts, weights=weights, t=t) -> None:  # type: ignore[no-untyped-def]
                core.regmean_merge_layer(
                    grams=grams,
                    weights=weights,
                    counts=counts,
                    alpha=ALPHA,
                    coefficients=None,
                    layout="linear",
                    precision="float64",
                    noise_floor=0.0,
                    ridge=0.0,
                    allow_regularization=True,
                    name="l",
                    n_threads=t,
                )

            merge()
            best = min(_timed(merge) for _ in range(args.reps))
            flops = regmean_flops(d_in, d_out, K)
            print(
                f"threads {t}  {name:<13s} {d_in:4d} -> {d_out:4d}: {best * 1e3:8.1f} ms, "
                f"{flops / best * 1e-9:6.1f} GFLOP/s, {best / (flops / rate):.2f}x its GEMM time"
            )
            total_s += LAYERS * best
            total_flops += LAYERS * flops
        print(
            f"threads {t}  torch fp64 GEMM {rate * 1e-9:.1f} GFLOP/s; BERT-base linear layers: "
            f"{total_s:.2f} s merge vs {total_flops / rate:.2f} s at the GEMM rate -> "
            f"{total_s / (total_flops / rate):.2f}x (goal <= 1.3)"
        )


if __name__ == "__main__":
    main()
