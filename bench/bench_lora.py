"""RegMean of K LoRA adapters over one base: the low-rank right-hand side against the dense
merge, per BERT-base layer shape.

With ``W_i = W₀ + B_i A_i`` (rank r per adapted weight) lmdx solves RegMean on the factors
(:func:`lmdx.merge.builtin.regmean.regmean_low_rank`: NumPy products ``G_i A_iᵀ`` -- O(d_in² r) per
model -- the existing native Cholesky solve with 2R right-hand sides, R = Σ r_i, and the
update ``[B_1 … B_K] Fᵀ``) instead of the dense right-hand side ``Σ c_i G̃_i (W_i − W̄)ᵀ``
-- O(d_in² d_out) per model -- of the native layer merge. This script times, on one
process and the same inputs:

* ``dense``: :func:`lmdx.regmean_merge_layer` on the dense weights ``W₀ + B_i A_i``
  (float32, as a merge of full checkpoints reads them; ``precision="auto"``) and on
  float64 weights with ``precision="float64"`` (the reference the low-rank path must
  match);
* ``low-rank``: :func:`regmean_low_rank` from the packed Grams and the factors, with its
  time split into the native solve (``spd_solve`` of the d_in x d_in system with 2R
  right-hand sides, timed alone) and the rest, which is NumPy: the Grams placed from
  their packed triangles and multiplied by the ``A_i``, their sum, the dense ``B_i A_i``
  (for the spread) and ``W₀ + B Fᵀ``;

and prints the ratio and the largest difference from the float64 dense merge (relative
to the largest weight). Shapes: per BERT-base encoder layer the q/k/v group (768 ->
3 × 768, one shared Gram; rank r for each of q, k, v: 3r per model), the attention output
(768 -> 768), the intermediate (768 -> 3072) and the output (3072 -> 768); K = 3, α = 0.9,
Grams of 2·d_in random rows.

    python bench/bench_lora.py [--ranks 8 16] [--reps 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from lmdx import regmean_merge_layer, spd
from lmdx.merge.builtin.regmean import regmean_low_rank
from lmdx.stats.packing import pack_upper, unpack_upper

K = 3
ALPHA = 0.9
#: name -> (d_in, output sizes of the members sharing the input)
SHAPES = {
    "q/k/v group": (768, (768, 768, 768)),
    "attn out": (768, (768,)),
    "intermediate": (768, (3072,)),
    "output": (3072, (768,)),
}


def _best(fn: Callable[[], Any], reps: int) -> tuple[float, Any]:
    out, best = None, float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - t0)
    return best, out


def _inputs(rng: np.random.Generator, d_in: int, outs: tuple[int, ...], r: int) -> dict[str, Any]:
    d_out = sum(outs)
    grams, counts = [], []
    for _ in range(K):
        x = rng.standard_normal((2 * d_in, d_in)) * rng.uniform(0.5, 2.0, d_in)
        grams.append(pack_upper(x.T @ x))
        counts.append(float(2 * d_in))
    base = rng.standard_normal((d_out, d_in)) * 0.05
    factors = []
    for _ in range(K):
        a = rng.standard_normal((r * len(outs), d_in)) * 0.05
        b = np.zeros((d_out, r * len(outs)))
        row = 0
        for j, size in enumerate(outs):  # each member its own rank-r update
            b[row : row + size, j * r : (j + 1) * r] = rng.standard_normal((size, r)) * 0.05
            row += size
        factors.append((b, a))
    return {"grams": grams, "counts": counts, "base": base, "factors": factors}


def _solve_time(inp: dict[str, Any], threads: int, reps: int) -> float:
    """The native part of the low-rank path alone: spd_solve of a system of its size
    (d_in x d_in) with its 2R right-hand sides."""
    d_in = inp["base"].shape[1]
    rank = sum(a.shape[0] for _, a in inp["factors"])
    a = unpack_upper(inp["grams"][0], d_in)
    b = np.ones((d_in, 2 * rank))
    return _best(lambda: spd.spd_solve(a, b, alpha=ALPHA, n_threads=threads), reps)[0]


def _row(name: str, inp: dict[str, Any], r: int, threads: int, reps: int) -> tuple[float, float]:
    """Time one layer both ways, print its line; return (dense, low-rank) seconds."""
    dense64 = [inp["base"] + b @ a for b, a in inp["factors"]]
    dense32 = [w.astype(np.float32) for w in dense64]
    grams, counts = inp["grams"], inp["counts"]
    common = {"alpha": ALPHA, "n_threads": threads}
    t32, _ = _best(lambda: regmean_merge_layer(grams, dense32, counts, **common), reps)
    t64, ref = _best(
        lambda: regmean_merge_layer(grams, dense64, counts, precision="float64", **common), reps
    )
    t_low, low = _best(
        lambda: regmean_low_rank(grams, counts, inp["base"], inp["factors"], **common), reps
    )
    diff = float(np.abs(low[0] - ref.weight).max() / np.abs(ref.weight).max())
    t_solve = _solve_time(inp, threads, reps)
    print(
        f"{name:14s} {r:3d} {t32:10.4f} {t64:10.4f} {t_low:9.4f} "
        f"{min(t32, t64) / t_low:7.1f}x {t_solve:7.4f} {t_low - t_solve:7.4f} {diff:12.2e}"
    )
    return min(t32, t64), t_low


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    blas = os.environ.get("OPENBLAS_NUM_THREADS", "its default")
    print(
        f"K = {K}, alpha = {ALPHA}, threads = {args.threads} (NumPy's BLAS: {blas}); "
        f"load average {os.getloadavg()[0]:.1f} before"
    )
    head = (
        f"{'layer':14s} {'r':>3s} {'dense f32':>10s} {'dense f64':>10s} {'low-rank':>9s} "
        f"{'speed-up':>8s} {'solve':>7s} {'NumPy':>7s} {'max rel diff':>12s}"
    )
    print(head)
    print("-" * len(head))
    totals = {"dense": 0.0, "low": 0.0}
    for r in args.ranks:
        for name, (d_in, outs) in SHAPES.items():
            dense, low = _row(name, _inputs(rng, d_in, outs, r), r, args.threads, args.reps)
            totals["dense"] += dense
            totals["low"] += low
    print(
        f"all shapes and ranks: dense (faster of f32/f64) {totals['dense']:.3f} s, "
        f"low-rank {totals['low']:.3f} s ({totals['dense'] / totals['low']:.1f}x); "
        f"load average {os.getloadavg()[0]:.1f} after"
    )


if __name__ == "__main__":
    main()
