"""Why lmdx's and FusionBench's RegMean merges differ (bench_methods_speed.py's agreement
column): each against the float64 formula ``W* = ((Σ G̃_i)⁻¹ Σ G̃_i W_iᵀ)ᵀ`` solved by
NumPy, per solved weight, relative to the merged update ``‖W − W*‖_F / ‖W* − θ_base‖_F``,
beside the system's condition number.

The models and statistics are bench_methods_speed.py's (BERT-base widths, K = 3 copies 2 %
apart, α 0.9, Grams from synthetic token batches); lmdx merges with its default
``precision: auto`` and with ``float64``, FusionBench with ``merging_with_regmean_weights``
on the same Grams (divided by the counts, in float32, as it collects them).

    python bench/regmean_agreement.py [--layers 1]
"""

from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_methods_speed import ALPHA, batches, bert, machine_line, perturbed
from bench_regmean_prior import formula_system


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    args.hidden, args.seed, args.seqs, args.seq_len, args.batch = 768, 0, 64, 128, 16
    torch.set_num_threads(args.threads)
    import lmdx
    from fusion_bench.method.regmean.regmean import merging_with_regmean_weights

    base = bert(args)
    models = perturbed(base, 0.02, 0)
    stats = [
        lmdx.collect_regmean_stats(m, batches(args, i, 30522), progress=False)
        for i, m in enumerate(models)
    ]
    fb_grams = [
        {
            mod: torch.from_numpy((s.gram(mod) / s.count(mod)).astype(np.float32))
            for mod in s.modules
        }
        for s in stats
    ]
    params: dict[str, list] = defaultdict(list)
    for m in models:
        for n, par in m.named_parameters():
            params[n].append(par)
    with torch.no_grad():
        fb = merging_with_regmean_weights(params, fb_grams, reduce_non_diagonal_ratio=ALPHA)
    merged = {
        prec: lmdx.merge_models(
            models, "regmean", stats=stats, alpha=ALPHA, precision=prec, progress=False
        ).state_dict
        for prec in ("auto", "float64")
    }
    theta0 = base.state_dict()
    print(f"# {machine_line(args.threads)}")
    print("| module | condition | lmdx auto | lmdx float64 | FusionBench |")
    print("|---|---:|---:|---:|---:|")
    for mod, info in stats[0].modules.items():
        w = info["weight"]
        lhs, rhs = formula_system(stats, models, mod)
        ref = np.linalg.solve(lhs, rhs).T
        update = np.linalg.norm(ref - theta0[w].double().numpy())

        def err(x: torch.Tensor, ref: np.ndarray = ref, update: float = update) -> float:
            return float(np.linalg.norm(x.double().numpy() - ref) / update)

        print(
            f"| {mod} | {np.linalg.cond(lhs):.1e} | {err(merged['auto'][w]):.1e} | "
            f"{err(merged['float64'][w]):.1e} | {err(fb[w]):.1e} |"
        )


if __name__ == "__main__":
    main()
