"""RegMean merge alone, lmdx (precision auto and float64) against FusionBench, interleaved.

Reuses the statistics a run of ``bench_regmean.py --workdir WORK`` left in ``WORK``
(FusionBench's Grams ``fb_grams_*.pt`` and lmdx's ``lmdx_incl_*.safetensors``, the same
systems) and the models ``bench_regmean.py`` builds from ``--seed`` and ``--noise``. Per
round, each of FusionBench, lmdx ``auto`` and lmdx ``float64`` merges the whole model once
in its own subprocess (``bench_regmean.py``'s merge worker), one after the other, so the
machine's load hits them alike; ``--rounds`` rounds. Then, against lmdx's float64 merge:
the weight error ``max|E|/max|W|`` and the output error ``‖E‖_S/‖W‖_S`` (S = Σ G̃_i) of
every RegMean weight (max and median over the layers), the systems per precision and the
largest certified output error. The whole-model merge checks that the statistics belong
to the models, so a ``--noise`` other than the collection run's needs ``--rounds 0``.

With ``--profile LAYERS``, each RegMean system of those encoder layers is also merged
alone by ``lmdx.regmean_merge_layer`` (auto, then float64) on the same Grams (any
``--noise``: the copies' deviations from their average then have another size, e.g. 1 %
instead of 10 %), and the totals printed: time, systems per precision, both error
measures of auto against float64; with ``--verbose`` each system's ``info.timings`` (where
its time goes, per phase; in a core built with ``LMDX_PROFILE=ON``, else only the phases
it went through).

Run from the repository root, after ``bench_regmean.py --workdir WORK ...``::

    python bench/bench_regmean_merge.py --workdir WORK --rounds 2 --profile 0 11 --verbose
    python bench/bench_regmean_merge.py --workdir WORK --noise 0.01 --rounds 0 --profile $(seq 0 11)
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_regmean as bench  # the sibling script: models, merge workers, error measures

IMPLS = ("fusionbench", "lmdx", "lmdx_f64")


def profile(args: argparse.Namespace, workdir: Path) -> None:
    """Per RegMean system of the given encoder layers: phases of auto and float64, and the
    totals over those systems (time, precision, both error measures of auto)."""
    import lmdx
    from lmdx import Statistics

    stats = [Statistics.load(workdir / f"lmdx_incl_{i}.safetensors") for i in range(args.models)]
    models = bench.build_models(args)
    params = [dict(m.named_parameters()) for m in models]
    groups: dict[str, list[str]] = {}
    for module in stats[0].modules:
        if any(f"encoder.layer.{n}." in module for n in args.profile):
            groups.setdefault(stats[0].group_of(module), []).append(module)
    total = {"auto": 0.0, "float64": 0.0}
    chosen: dict[str, int] = defaultdict(int)
    weight_errors, output_errors = [], []
    alpha = args.alphas[0]
    for modules in groups.values():
        grams = [s.gram_stored(modules[0]) for s in stats]
        counts = [s.count(modules[0]) for s in stats]
        weights = [
            np.concatenate([p[m + ".weight"].detach().numpy() for m in modules]) for p in params
        ]
        merged = {}
        for precision in ("auto", "float64"):
            t0 = time.perf_counter()
            res = lmdx.regmean_merge_layer(
                grams, weights, counts, alpha=alpha, precision=precision, n_threads=args.threads
            )
            seconds = time.perf_counter() - t0
            total[precision] += seconds
            merged[precision] = res.weight
            info = res.info
            if precision == "auto":
                chosen[info.precision] += 1
            timed = info.timings or dict.fromkeys(info.phases, float("nan"))  # LMDX_PROFILE=ON
            phases = " ".join(f"{k} {v:.3f}" for k, v in timed.items())
            if args.verbose:
                print(
                    f"  {modules[0]} ({weights[0].shape[1]} -> {weights[0].shape[0]})"
                    f" {precision}: {seconds:.3f} s, {info.precision} (estimate"
                    f" {info.output_error_estimate:.1e}); {phases}",
                    flush=True,
                )
        s = 0.0
        for st in stats:
            g = st.gram(modules[0]) / st.count(modules[0])
            s = s + alpha * g + (1.0 - alpha) * np.diag(np.diag(g))
        w = merged["float64"].astype(np.float32).astype(np.float64)  # as stored
        e = merged["auto"].astype(np.float32).astype(np.float64) - w
        weight_errors.append(bench.rel_max(w + e, w))
        output_errors.append(float(np.sqrt(np.sum((e @ s) * e) / np.sum((w @ s) * w))))
    print(
        f"  {len(groups)} systems: auto {total['auto']:.2f} s ({dict(chosen)}), float64"
        f" {total['float64']:.2f} s, float64 / auto {total['float64'] / total['auto']:.2f}x;"
        f" auto against float64 (both stored in float32): weight error max"
        f" {max(weight_errors):.1e} (median {bench.med(weight_errors):.1e}), output error max"
        f" {max(output_errors):.1e} (median {bench.med(output_errors):.1e})",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", required=True, help="a bench_regmean.py --workdir with Grams")
    ap.add_argument("--rounds", type=int, default=2, help="merges of each implementation")
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.9])
    ap.add_argument("--models", type=int, default=3)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--noise", type=float, default=0.1, help="fine-tuning noise (× tensor std)")
    ap.add_argument("--profile", type=int, nargs="*", default=None, help="encoder layers")
    ap.add_argument("--verbose", action="store_true", help="print every system's phases")
    args = ap.parse_args()
    workdir = Path(args.workdir)
    from lmdx import Statistics
    from safetensors.numpy import load_file

    info = bench.machine()
    print(f"machine: {info}", flush=True)
    one = copy.copy(args)
    one.merge_reps = 1
    times: dict[tuple[str, float], list[float]] = defaultdict(list)
    solver: dict[tuple[str, float], dict[str, Any]] = {}
    for r in range(args.rounds):
        for impl in IMPLS:
            for alpha, res in bench.run_merges(one, impl, workdir).items():
                times[impl, alpha] += res["times"]
                solver[impl, alpha] = res["solver"]
                print(f"round {r}: {impl} α={alpha}: {res['times'][0]:.2f} s", flush=True)
    stats = [Statistics.load(workdir / f"lmdx_incl_{i}.safetensors") for i in range(args.models)]
    print(f"load average at the end: {list(os.getloadavg())}")
    for alpha in args.alphas if args.rounds > 0 else []:
        merged = {
            impl: load_file(str(workdir / f"merged_{impl}_{alpha}.safetensors")) for impl in IMPLS
        }
        fb = bench.med(times["fusionbench", alpha])
        print(
            f"\nα = {alpha}, noise {args.noise}: merge time per round, median, FusionBench / this"
        )
        for impl in IMPLS:
            t = times[impl, alpha]
            sv = solver[impl, alpha]
            line = (
                f"  {impl:12s} {' '.join(f'{x:.2f}' for x in t)} s, median {bench.med(t):.2f} s,"
                f" {fb / bench.med(t):.2f}x"
            )
            if sv:
                line += (
                    f"; systems {sv.get('precision')}, largest certified output error"
                    f" {sv.get('max_output_error_estimate', 0.0):.1e}"
                )
            if impl != "lmdx_f64":
                e = bench.merged_errors(merged[impl], merged["lmdx_f64"], stats, alpha)
                line += (
                    f"; weight error {e['weight_max']:.1e} ({e['weight_median']:.1e}),"
                    f" output error {e['output_max']:.1e} ({e['output_median']:.1e})"
                )
            print(line, flush=True)
    if args.profile:
        print("\nper system (regmean_merge_layer, phases in seconds):")
        profile(args, workdir)


if __name__ == "__main__":
    main()
