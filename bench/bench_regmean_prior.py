"""What a prior costs RegMean: ``merge_models(method="regmean")`` against the same call with
``prior=<anchor>`` and ``prior_strength``, on the same BERT-base-shaped models and Grams
(``bench_methods_speed.py``'s: K = 3 copies 2 % apart, ``--layers`` encoder layers,
statistics from synthetic token batches), alternated, the same threads.

The anchor's own time (its merge of each solved tensor, which the issue excepts) is
measured inside the merge, by timing :meth:`lmdx.merge.builtin.regmean_prior.Prior.values`,
and reported apart: ``ratio = (prior merge − anchor time) / RegMean merge``. The prior
adds one model to each layer's system (its Gram ``Λ = λ t I``), so its products grow from
K − 1 to K per layer.

Every solved weight of each merge is checked against the formula solved in float64 by
NumPy (``(Σ G̃_i + Λ)⁻¹ (Σ G̃_i W_iᵀ + Λ W_aᵀ)``, ``W_a`` the anchor's own merge of that
tensor): the weight error max |E| / max |W*| and the output error ‖E‖_S / ‖W*‖_S
(S the system).

    python bench/bench_regmean_prior.py [--layers 2] [--reps 3] [--threads 2]
        [--anchors task_arithmetic ties tsv_m] [--strength 1.0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_methods_speed import ALPHA, batches, bert, machine_line, perturbed, timed


def formula_system(stats: list, models: list, module: str) -> tuple[np.ndarray, np.ndarray]:
    """RegMean's float64 system ``Σ G̃_i`` and right-hand side ``Σ G̃_i W_iᵀ`` of ``module``."""
    w = stats[0].modules[module]["weight"]
    lhs, rhs = 0.0, 0.0
    for s, m in zip(stats, models, strict=True):
        g = s.gram(module) / s.count(module)
        g = ALPHA * g + (1 - ALPHA) * np.diag(np.diag(g))
        lhs, rhs = lhs + g, rhs + g @ m.state_dict()[w].double().numpy().T
    return lhs, rhs


def reference_errors(models: list, stats: list, merged: dict, anchor: dict | None, lam: float):
    """The largest weight and output errors over the solved modules against NumPy's
    float64 solve of the formula (``anchor``: the anchor's merged state; None: RegMean)."""
    worst_w = worst_s = 0.0
    for module, info in stats[0].modules.items():
        w = info["weight"]
        lhs, rhs = formula_system(stats, models, module)
        if anchor is not None and lam > 0:
            t = lam * np.trace(lhs) / lhs.shape[0]
            lhs = lhs + t * np.eye(lhs.shape[0])
            rhs = rhs + t * anchor[w].detach().double().numpy().T
        want = np.linalg.solve(lhs, rhs)  # W*ᵀ
        err = merged[w].detach().double().numpy().T - want
        worst_w = max(worst_w, float(np.abs(err).max() / np.abs(want).max()))
        out = np.sqrt(
            np.einsum("ij,ik,kj->", err, lhs, err) / np.einsum("ij,ik,kj->", want, lhs, want)
        )
        worst_s = max(worst_s, float(out))
    return worst_w, worst_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--noise", type=float, default=0.02)
    p.add_argument("--seqs", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--anchors", nargs="+", default=["task_arithmetic", "ties", "tsv_m"])
    p.add_argument("--strength", type=float, default=1.0)
    args = p.parse_args()
    torch.set_num_threads(args.threads)

    import lmdx
    from lmdx.merge.builtin import regmean_prior

    base = bert(args)
    models = perturbed(base, args.noise, args.seed)
    stats = [
        lmdx.collect_regmean_stats(
            m, batches(args, i, 30522), progress=False, n_threads=args.threads
        )
        for i, m in enumerate(models)
    ]
    anchor_s: list[float] = []
    precisions: dict[str, Counter] = {}  # merge -> its layers' precisions (the last run's)
    values = regmean_prior.Prior.values

    def timed_values(self: Any, tensors: Any, reads: Any) -> Any:
        t = time.perf_counter()
        try:
            return values(self, tensors, reads)
        finally:
            anchor_s[-1] += time.perf_counter() - t

    regmean_prior.Prior.values = timed_values  # type: ignore[method-assign]

    def call(**kw: Any) -> Any:
        def run() -> Any:
            anchor_s.append(0.0)
            res = lmdx.merge_models(
                models,
                "regmean",
                stats=stats,
                alpha=ALPHA,
                progress=False,
                n_threads=args.threads,
                **kw,
            )
            precisions[kw.get("prior", "regmean")] = Counter(
                str(v["precision"]) for v in res.report["layers"].values()
            )
            return res.state_dict

        return run

    fns = {"regmean": call()}
    for a in args.anchors:
        fns[a] = call(base=base, prior=a, prior_strength=args.strength)
    times, last = timed(fns, args.reps)
    anchors = {
        a: lmdx.merge_models(
            models, a, base=base, progress=False, n_threads=args.threads
        ).state_dict
        for a in args.anchors
    }
    # anchor_s holds one entry per run, in the order timed() ran them
    per_run = {name: anchor_s[i :: len(fns)] for i, name in enumerate(fns)}
    print(f"# {machine_line(args.threads)}")
    print(
        f"# BERT-base widths, {args.layers} layers, K = 3, noise {args.noise}, alpha {ALPHA}, "
        f"lambda {args.strength}, {args.reps} reps (min / median s)"
    )
    print(
        "| merge | wall s | anchor s | (wall − anchor) / RegMean | weight err | output err "
        "| layers by precision |"
    )
    print("|---|---:|---:|---:|---:|---:|---|")
    ref = min(times["regmean"])
    for name, ts in times.items():
        anchor = anchors.get(name)
        werr, serr = reference_errors(models, stats, last[name], anchor, args.strength)
        a = min(per_run[name]) if anchor is not None else 0.0
        ratio = (min(ts) - a) / ref
        label = "regmean" if anchor is None else f"regmean, prior {name}"
        print(
            f"| {label} | {min(ts):.2f} / {statistics.median(ts):.2f} | {a:.2f} | {ratio:.2f}× "
            f"| {werr:.1e} | {serr:.1e} | {dict(sorted(precisions[name].items()))} |"
        )


if __name__ == "__main__":
    main()
