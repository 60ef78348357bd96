"""What each task pays, timed against the merge it measures, at BERT-base's layer shapes.

Per encoder layer of BERT-base: one q/k/v group (768 -> 3 x 768, one shared Gram), the
attention output (768 -> 768), the intermediate (768 -> 3072) and the output (3072 ->
768), times 12 layers (layers of one shape are timed once and counted 12 times). For K
models it times, in one process, one thread, CPU time (``time.process_time``), best of
``--reps``, alternating A B A B:

* the RegMean solve of each layer (:func:`lmdx.regmean_merge_layer`, precision ``auto``
  and ``float64``), the merge's arithmetic;
* the exact cost (:func:`lmdx.merge.layer_cost.group_cost`, ``mode="exact"``) of each input
  group: per model two symmetric rank-k products (``EᵀE`` and ``W_iᵀW_i``, ``out·in²``
  flops each) and two ``in²`` inner products, in float64;
* the default, estimated cost (``mode="estimate"``) on the Grams as files hold them
  (packed upper triangles) with their sums: one :func:`lmdx.moments.gram_product` per
  model of ``2·SKETCH`` columns per term (``4·SKETCH·in²`` flops per term).

and checks both against an explicit float64 NumPy reference (``E Ĝ Eᵀ``): the exact one's
largest relative error, the estimate's largest and median. The models are copies of one
weight perturbed by ``--noise`` × its scale (0.02: what real fine-tunes show); the
activations have a mean and correlated features. Flops per layer: the float64 solve
``2(K − 1)·in²·out + in³/3 + 2·in²·out``; the exact cost ``2K·in²·out``.

    OPENBLAS_NUM_THREADS=1 python bench/bench_cost.py [--k 4] [--reps 3] [--noise 0.02]

``--whole-model DIR``: instead, what a user's call costs. K BERT-base encoders (random
init, seed 0; each parameter of copy i perturbed by ``--noise`` × its standard deviation,
seeded) are saved in DIR with their statistics (``collect_regmean_stats``, padding
included, ``--seqs`` random sequences of 128 tokens each, made once and reused), then
``merge_models(method="regmean", alpha=0.9)`` is timed (wall, all threads) with the cost
off (``cost=False``), estimated (the default) and exact (``cost="exact"``), alternated
``--reps`` times; the estimate's per-task means are compared with the exact ones.

    python bench/bench_cost.py --whole-model /tmp/bench_cost --k 3 --reps 2
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from lmdx import regmean_merge_layer
from lmdx.merge.layer_cost import group_cost
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
    ap.add_argument("--noise", type=float, default=0.02)
    ap.add_argument("--whole-model", metavar="DIR", type=Path, default=None)
    ap.add_argument("--seqs", type=int, default=48)
    args = ap.parse_args()
    if args.whole_model is not None:
        whole_model(args.whole_model, args.k, args.noise, args.seqs, args.reps)
        return
    k = args.k
    rng = np.random.default_rng(0)
    totals = {"auto": 0.0, "float64": 0.0, "cost": 0.0, "estimate": 0.0}
    flops = {"float64": 0.0, "cost": 0.0}
    errors: list[float] = []
    print(f"K = {k}, α = {ALPHA}, noise {args.noise}, 1 thread, CPU time, best of {args.reps}; "
          f"x {LAYERS} layers")  # fmt: skip
    print(f"{'layer':<14}{'auto s':>9}{'float64 s':>11}{'exact s':>9}{'estim. s':>10}"
          f"{'exact/auto':>11}{'estim./auto':>12}{'exact err':>11}"
          f"{'estim. err max, median':>24}")  # fmt: skip
    for name, (d_in, outs) in SHAPES.items():
        d_out = sum(outs)
        grams, sums = [], []
        mix = np.eye(d_in) + rng.standard_normal((d_in, d_in)) / np.sqrt(d_in)
        for _ in range(k):
            x = rng.standard_normal((2 * d_in, d_in)) @ mix + 0.5 * rng.standard_normal(d_in)
            x *= rng.uniform(0.5, 2.0, d_in)
            grams.append(x.T @ x)
            sums.append(x.sum(axis=0))
        packed = [g[np.triu_indices(d_in)] for g in grams]
        counts = [2.0 * d_in] * k
        common = rng.standard_normal((d_out, d_in)).astype(np.float32)
        weights = [common + args.noise * rng.standard_normal((d_out, d_in)).astype(np.float32)
                   for _ in range(k)]  # fmt: skip

        def solve(precision: str, grams=grams, weights=weights, counts=counts) -> np.ndarray:  # type: ignore[no-untyped-def]
            return np.asarray(
                regmean_merge_layer(grams, weights, counts, alpha=ALPHA, precision=precision,
                                    n_threads=1).weight
            )  # fmt: skip

        merged = solve("auto").astype(np.float32).astype(np.float64)
        w64 = [w.astype(np.float64) for w in weights]
        merged_parts, weight_parts = {}, {}
        start = 0
        for j, o in enumerate(outs):
            merged_parts[f"m{j}"] = merged[start : start + o]
            weight_parts[f"m{j}"] = [w[start : start + o] for w in w64]
            start += o

        def costs(
            mode: str,
            merged_parts=merged_parts,
            weight_parts=weight_parts,
            grams=grams,
            packed=packed,
            sums=sums,
            counts=counts,
        ) -> dict:  # type: ignore[no-untyped-def,type-arg]
            held = grams if mode == "exact" else packed
            return group_cost(merged_parts, weight_parts, held, counts, mode=mode, n_threads=1,
                              sums=None if mode == "exact" else sums)  # fmt: skip

        best = {"auto": np.inf, "float64": np.inf, "cost": np.inf, "estimate": np.inf}
        for _ in range(args.reps):
            best["auto"] = min(best["auto"], cpu(lambda: solve("auto")))
            best["cost"] = min(best["cost"], cpu(lambda: costs("exact")))
            best["estimate"] = min(best["estimate"], cpu(lambda: costs("estimate")))
            best["float64"] = min(best["float64"], cpu(lambda: solve("float64")))
        err, est_err = 0.0, []
        exact, estimate = costs("exact"), costs("estimate")
        for name_m, m in merged_parts.items():
            for i, (w, g, n) in enumerate(zip(weight_parts[name_m], grams, counts, strict=True)):
                e = m - w
                ref = np.sqrt(np.trace(e @ (g / n) @ e.T) / np.trace(w @ (g / n) @ w.T))
                err = max(err, abs(exact[name_m].cost[i] - ref) / ref)
                est_err.append(abs(estimate[name_m].cost[i] - ref) / ref)
        errors += est_err
        for key in totals:
            totals[key] += LAYERS * best[key]
        flops["float64"] += LAYERS * regmean_flops(d_in, d_out, k)
        flops["cost"] += LAYERS * 2 * k * d_in**2 * d_out
        print(f"{name:<14}{best['auto']:>9.3f}{best['float64']:>11.3f}{best['cost']:>9.3f}"
              f"{best['estimate']:>10.4f}{best['cost'] / best['auto']:>11.2f}"
              f"{best['estimate'] / best['auto']:>12.3f}{err:>11.1e}"
              f"{max(est_err):>15.1e}, {np.median(est_err):.1e}")  # fmt: skip
    print(f"{'BERT-base':<14}{totals['auto']:>9.2f}{totals['float64']:>11.2f}"
          f"{totals['cost']:>9.2f}{totals['estimate']:>10.3f}"
          f"{totals['cost'] / totals['auto']:>11.2f}{totals['estimate'] / totals['auto']:>12.3f}"
          f"{'':>11}{max(errors):>15.1e}, {np.median(errors):.1e}")  # fmt: skip
    print(f"flops: float64 solve {flops['float64'] / 1e9:.1f} G, cost {flops['cost'] / 1e9:.1f} G "
          f"(ratio {flops['cost'] / flops['float64']:.2f})")  # fmt: skip


def whole_model(root: Path, k: int, noise: float, seqs: int, reps: int) -> None:
    """The whole-model timing of ``--whole-model`` (see the module's description)."""
    import warnings

    import torch
    from lmdx import collect_regmean_stats, merge_models
    from transformers import BertConfig, BertModel

    paths = [root / f"model{i}" for i in range(k)]
    stats = [root / f"stats{i}.safetensors" for i in range(k)]
    if not all(p.is_dir() for p in paths) or not all(s.is_file() for s in stats):
        torch.manual_seed(0)
        base = BertModel(BertConfig()).eval()
        for i, (path, out) in enumerate(zip(paths, stats, strict=True)):
            model = BertModel(BertConfig()).eval()
            g = torch.Generator().manual_seed(100 + i)
            with torch.no_grad():
                for p, q in zip(model.parameters(), base.parameters(), strict=True):
                    spread = noise * q.std() if q.numel() > 1 else 0.0
                    p.copy_(q + spread * torch.randn(q.shape, generator=g))
            model.save_pretrained(path)
            ids = torch.randint(1000, 20000, (seqs, 128), generator=g)
            batches = [
                {"input_ids": ids[j : j + 16], "attention_mask": torch.ones_like(ids[j : j + 16])}
                for j in range(0, seqs, 16)
            ]
            collect_regmean_stats(model, batches, include_padding=True, progress=False, out=out)
    runs: dict[str, list[float]] = {"off": [], "estimate": [], "exact": []}
    means: dict[str, dict[str, float]] = {}
    for _ in range(reps):
        for mode, cost in (("off", False), ("estimate", None), ("exact", "exact")):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                t0 = time.perf_counter()
                result = merge_models(
                    [str(p) for p in paths],
                    "regmean",
                    stats=[str(s) for s in stats],
                    alpha=ALPHA,
                    progress=False,
                    cost=cost,
                )
                runs[mode].append(time.perf_counter() - t0)
            if cost is not False:
                means[mode] = {t: v["mean"] for t, v in result.report["cost"]["tasks"].items()}
            del result
    print(f"BERT-base x {k}, noise {noise}, {seqs} x 128 tokens each, α {ALPHA}; wall s")
    for mode, times in runs.items():
        ratio = min(times) / min(runs["off"])
        print(f"  {mode:<9} min {min(times):7.2f}  all {[round(t, 2) for t in times]}  "
              f"x {ratio:.3f} the merge alone")  # fmt: skip
    for task, exact in means["exact"].items():
        est = means["estimate"][task]
        print(f"  {task}: mean cost exact {exact:.5f}, estimate {est:.5f} "
              f"({(est - exact) / exact:+.2%})")  # fmt: skip


if __name__ == "__main__":
    main()
