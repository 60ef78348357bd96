"""What each task pays, timed against the merge it measures, at BERT-base's layer shapes.

Per encoder layer of BERT-base: one q/k/v group (768 -> 3 x 768, one shared Gram), the
attention output (768 -> 768), the intermediate (768 -> 3072) and the output (3072 ->
768), times 12 layers (layers of one shape are timed once and counted 12 times). For K
models it times, in one process, one thread, CPU time (``time.process_time``), best of
``--reps``, alternating A B A B:

* the RegMean solve of each layer (:func:`lmdx.regmean_merge_layer`, precision ``auto``
  and ``float64``), the merge's arithmetic;
* :func:`lmdx.merge.cost.layer_cost` of each module: per model two symmetric rank-k
  products (``EᵀE`` and ``W_iᵀW_i``, ``out·in²`` flops each) and two ``in²`` inner
  products, in float64.

and checks the costs against an explicit float64 NumPy reference (``E Ĝ Eᵀ``). Flops per
layer: the float64 solve ``2(K − 1)·in²·out + in³/3 + 2·in²·out``; the cost ``2K·in²·out``.

    OPENBLAS_NUM_THREADS=1 python bench/bench_cost.py [--k 4] [--reps 3]
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from lmdx import regmean_merge_layer
from lmdx.merge.cost import layer_cost
from merge_work import regmean_flops

LAYERS = 12
#: name -> (in, [out of each module sharing that input])
SHAPES = {
    "q/k/v group": (768, [768, 768, 768]),
    "attn out": (768, [768]),
    "intermediate": (768, [3072]),
    "output": (3072, [768]),
}
ALPHA = 0.9


def cpu(fn) -> float:  # type: ignore[no-untyped-def]
    t = time.process_time()
    fn()
    return time.process_time() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    k = args.k
    rng = np.random.default_rng(0)
    totals = {"auto": 0.0, "float64": 0.0, "cost": 0.0}
    flops = {"float64": 0.0, "cost": 0.0}
    print(f"K = {k}, α = {ALPHA}, 1 thread, CPU time, best of {args.reps}; x {LAYERS} layers")
    print(f"{'layer':<14}{'auto s':>9}{'float64 s':>11}{'cost s':>9}{'cost/auto':>11}"
          f"{'cost/f64':>10}{'max rel err':>13}")  # fmt: skip
    for name, (d_in, outs) in SHAPES.items():
        d_out = sum(outs)
        grams = []
        for _ in range(k):
            x = rng.standard_normal((2 * d_in, d_in)) * rng.uniform(0.5, 2.0, d_in)
            grams.append(x.T @ x)
        counts = [2.0 * d_in] * k
        common = rng.standard_normal((d_out, d_in)).astype(np.float32)
        weights = [common + 0.1 * rng.standard_normal((d_out, d_in)).astype(np.float32)
                   for _ in range(k)]  # fmt: skip

        def solve(precision: str, grams=grams, weights=weights, counts=counts) -> np.ndarray:  # type: ignore[no-untyped-def]
            return np.asarray(
                regmean_merge_layer(grams, weights, counts, alpha=ALPHA, precision=precision,
                                    n_threads=1).weight
            )  # fmt: skip

        merged = solve("auto").astype(np.float32).astype(np.float64)
        w64 = [w.astype(np.float64) for w in weights]
        parts = []
        start = 0
        for o in outs:
            parts.append((merged[start : start + o], [w[start : start + o] for w in w64]))
            start += o

        def costs(parts=parts, grams=grams, counts=counts) -> list:  # type: ignore[no-untyped-def,type-arg]
            return [layer_cost(m, ws, grams, counts) for m, ws in parts]

        best = {"auto": np.inf, "float64": np.inf, "cost": np.inf}
        for _ in range(args.reps):
            best["auto"] = min(best["auto"], cpu(lambda: solve("auto")))
            best["cost"] = min(best["cost"], cpu(costs))
            best["float64"] = min(best["float64"], cpu(lambda: solve("float64")))
        err = 0.0
        for (m, ws), got in zip(parts, costs(), strict=True):
            for w, g, n, c in zip(ws, grams, counts, got.cost, strict=True):
                e = m - w
                ref = np.sqrt(np.trace(e @ (g / n) @ e.T) / np.trace(w @ (g / n) @ w.T))
                err = max(err, abs(c - ref) / ref)
        for key in totals:
            totals[key] += LAYERS * best[key]
        flops["float64"] += LAYERS * regmean_flops(d_in, d_out, k)
        flops["cost"] += LAYERS * 2 * k * d_in**2 * d_out
        print(f"{name:<14}{best['auto']:>9.3f}{best['float64']:>11.3f}{best['cost']:>9.3f}"
              f"{best['cost'] / best['auto']:>11.2f}{best['cost'] / best['float64']:>10.2f}"
              f"{err:>13.1e}")  # fmt: skip
    print(f"{'BERT-base':<14}{totals['auto']:>9.2f}{totals['float64']:>11.2f}"
          f"{totals['cost']:>9.2f}{totals['cost'] / totals['auto']:>11.2f}"
          f"{totals['cost'] / totals['float64']:>10.2f}")  # fmt: skip
    print(f"flops: float64 solve {flops['float64'] / 1e9:.1f} G, cost {flops['cost'] / 1e9:.1f} G "
          f"(ratio {flops['cost'] / flops['float64']:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
