"""RegMean merge alone, lmdx (precision auto and float64) against FusionBench, interleaved.

Reuses the statistics a run of ``bench_regmean.py --workdir WORK`` left in ``WORK``
(FusionBench's Grams ``fb_grams_*.pt`` and lmdx's ``lmdx_incl_*.safetensors``, the same
systems) and the models ``bench_regmean.py`` builds from ``--seed`` and ``--noise`` (default
0.02, as there). Each run first measures the machine's float32 and float64 FMA peaks at
``--threads`` (``merge_work.measure_peaks``) and prints them. Per round, each of
FusionBench, lmdx ``auto`` and lmdx ``float64`` merges the whole model once in its own
subprocess (``bench_regmean.py``'s merge worker), one after the other, so the machine's load
hits them alike; ``--rounds`` rounds. Then per implementation: the median time, its share of
the measured float32 peak (and of the float64 peak for ``float64``) for the merge's float32
work (``merge_work.model_flops``: the deviation form's flops of every RegMean system merged,
from their shapes and K; every implementation is credited the same work), and against lmdx's
float64 merge the weight error ``max|E|/max|W|`` and the output error ``‖E‖_S/‖W‖_S``
(S = Σ G̃_i) of every RegMean weight (max and median over the layers), the systems per
precision and the largest certified output error. The whole-model merge checks that the
statistics belong to the models, so a ``--noise`` other than the collection run's needs
``--rounds 0``.

With ``--profile LAYERS``, each RegMean system of those encoder layers is also merged
alone (``compare_systems``) by ``lmdx.regmean_merge_layer`` in auto and float64 and, where
it is installed, by FusionBench's ``merging_with_regmean_weights`` (``fusionbench_merge``:
the same Grams, divided by the counts, the same formula) on the same Grams (any
``--noise``: the copies' deviations from their average then have another size, e.g. 1 %
instead of 2 %), and the totals printed: time, float32 GFLOP and share of the measured
peaks, systems per precision, both error measures of auto and FusionBench against float64,
the ratios; with ``--verbose`` each system's ``info.timings`` (where its time goes, per
phase; in a core built with ``LMDX_PROFILE=ON``, else only the phases it went through).
Those comparisons report wall and process CPU time (the shares of the peak are of the wall
time) and rotate the order of the implementations from system to system, after an untimed
merge by each: on a loaded machine read the CPU time of a one-thread run (``--threads 1``).

With ``--baseline DIR`` (another build of lmdx, e.g. ``pip install --no-deps --target DIR``
of an earlier commit), that build's ``auto`` merge (``lmdx_base``) is timed in the same
rounds, between lmdx ``auto`` and ``float64``, and reported like them: a before/after
comparison on the same machine and load. With ``--baseline-workdir BASEWORK`` as well,
that build reads its statistics from ``BASEWORK`` instead (the same Grams in a format it
reads, e.g. files of an older statistics format next to ``lmdx stats add`` rewrites).

With ``--real FOLDER ...`` (fine-tuned models, each folder with ``model.safetensors`` and
the statistics the real example collected, ``stats-*/regmean.safetensors``), the same
comparison on their RegMean systems, after each weight's measured deviation from the
models' average.

Run from the repository root, after ``bench_regmean.py --workdir WORK ...``::

    python bench/bench_regmean_merge.py --workdir WORK --rounds 2 --profile 0 11 --verbose
    python bench/bench_regmean_merge.py --workdir WORK --noise 0.01 --rounds 0 --profile $(seq 0 11)
    python bench/bench_regmean_merge.py --workdir WORK --rounds 3 --baseline /tmp/lmdx-main
    python bench/bench_regmean_merge.py --real F1 F2 F3 F4 --threads 1  # one set of four fine-tunes
"""

from __future__ import annotations

import argparse
import copy
import functools
import importlib.util
import os
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_regmean as bench  # the sibling script: models, merge workers
from merge_work import (
    deviation,
    efficiency,
    measure_peaks,
    merged_errors,
    model_flops,
    peak_line,
    reduced_sum,
    regmean_flops,
)
from merge_work import errors as weight_output_errors

IMPLS = ("fusionbench", "lmdx", "lmdx_f64")


def compare_systems(
    systems: list[tuple[str, list[Any], list[float], list[np.ndarray]]],
    alpha: float,
    threads: int,
    verbose: bool,
    peaks: dict[str, float],
    noise_floor: float = 0.0,
) -> None:
    """Each system (name, stored Grams, counts, weights [out, in]) merged alone by
    ``lmdx.regmean_merge_layer`` in auto and float64, and by FusionBench where it is
    installed (``fusionbench_merge``), after an untimed merge of each; the order rotating
    from system to system. Wall and process CPU time (the CPU time is the one to read on a
    loaded machine, with one thread), the float32 work (``merge_work.regmean_flops``) and
    its share of the measured peaks (wall), systems per precision, both error measures of
    auto and FusionBench against float64, the largest certified output error.
    ``noise_floor`` as for ``regmean_merge_layer``."""
    import lmdx

    fusionbench = importlib.util.find_spec("fusion_bench") is not None
    variants = ("auto", "float64", "fusionbench") if fusionbench else ("auto", "float64")
    wall, cpu = dict.fromkeys(variants, 0.0), dict.fromkeys(variants, 0.0)
    chosen: dict[str, int] = defaultdict(int)
    errors: dict[str, list[tuple[float, float]]] = defaultdict(list)
    certified, flops = [0.0], 0.0
    for n, (name, grams, counts, weights) in enumerate(systems):
        d_out, d_in = weights[0].shape
        flops += regmean_flops(d_in, d_out, len(weights))
        run = {
            p: functools.partial(
                lmdx.regmean_merge_layer,
                grams,
                weights,
                counts,
                alpha=alpha,
                precision=p,
                n_threads=threads,
                noise_floor=noise_floor,
            )
            for p in ("auto", "float64")
        }
        if fusionbench:
            run["fusionbench"] = fusionbench_merge(grams, counts, weights, alpha, threads)
        for fn in run.values():  # untimed: the first merge of a system touches its inputs
            fn()
        merged = {}
        for v in variants[n % len(variants) :] + variants[: n % len(variants)]:
            t0, c0 = time.perf_counter(), time.process_time()
            res = run[v]()
            seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
            wall[v] += seconds
            cpu[v] += cpu_seconds
            if v == "fusionbench":
                merged[v] = res
                if verbose:
                    print(f"  {name} ({d_in} -> {d_out}) FusionBench: {seconds:.3f} s (CPU"
                          f" {cpu_seconds:.3f} s)", flush=True)  # fmt: skip
                continue
            merged[v] = res.weight
            info = res.info
            if v == "auto":
                chosen[info.precision] += 1
                certified.append(info.output_error_estimate)
            timed = info.timings or dict.fromkeys(info.phases, float("nan"))  # LMDX_PROFILE=ON
            phases = " ".join(f"{k} {t:.3f}" for k, t in timed.items())
            if verbose:
                print(
                    f"  {name} ({d_in} -> {d_out}) {v}: {seconds:.3f} s (CPU {cpu_seconds:.3f} s),"
                    f" {info.precision} (estimate {info.output_error_estimate:.1e}); {phases}",
                    flush=True,
                )
        s = reduced_sum(
            [gram_matrix(g, d_in) / c for g, c in zip(grams, counts, strict=True)], alpha
        )
        w = merged["float64"].astype(np.float32)  # as stored
        for v in (v for v in variants if v != "float64"):
            errors[v].append(weight_output_errors(merged[v].astype(np.float32), w, s))
            if verbose:
                print(f"  {name} {v} against float64: weight error {errors[v][-1][0]:.1e},"
                      f" output error {errors[v][-1][1]:.1e}", flush=True)  # fmt: skip
    print(
        f"  {len(systems)} systems, {threads} thread(s), K = {len(systems[0][3])}: float32 work"
        f" {flops / 1e9:.2f} GFLOP",
        flush=True,
    )
    labels = {"auto": "lmdx auto", "float64": "lmdx float64", "fusionbench": "FusionBench"}
    for v in variants:
        line = (
            f"  {labels[v]:12s} {wall[v]:.2f} s (CPU {cpu[v]:.2f} s),"
            f" {efficiency(flops, wall[v], peaks, v == 'float64')}"
        )
        if v == "auto":
            line += f"; systems {dict(chosen)}, certified <= {max(certified):.1e}"
        if v != "float64":
            w_err, o_err = (np.array(x) for x in zip(*errors[v], strict=True))
            line += (
                f"; against float64 (stored in float32): weight error max {w_err.max():.1e}"
                f" (median {np.median(w_err):.1e}), output error max {o_err.max():.1e}"
                f" (median {np.median(o_err):.1e})"
            )
        print(line, flush=True)
    ratios = [("float64", "auto")] + (
        [("fusionbench", "auto"), ("fusionbench", "float64")] if fusionbench else []
    )
    print(
        "  "
        + ", ".join(
            f"{labels[a]} / {labels[b]} {wall[a] / wall[b]:.2f}x (CPU {cpu[a] / cpu[b]:.2f}x)"
            for a, b in ratios
        ),
        flush=True,
    )


def fusionbench_merge(
    grams: list[Any], counts: list[float], weights: list[np.ndarray], alpha: float, threads: int
) -> Callable[[], np.ndarray]:
    """FusionBench's ``merging_with_regmean_weights`` on one system, its inputs made before
    (untimed): the same formula as lmdx's ``W_Mᵀ = (Σ G̃_i)⁻¹ Σ G̃_i W_iᵀ`` with
    Ĝ_i = G_i / n_i (FusionBench's Grams are running means, so the lmdx sums divided by
    their counts, rounded to float32, are the Grams it would have collected) and
    G̃_i = α Ĝ_i + (1 − α) diag Ĝ_i (its ``reduce_non_diagonal_ratio`` = α: off-diagonal
    × α, diagonal kept); float32, explicit ``torch.inverse``. The system is given once, as
    one module with the concatenated weight: on a whole model FusionBench would invert a
    shared (q/k/v) Gram once per module. Where Σ G̃ is singular or below the statistics'
    rounding in some direction, lmdx keeps the average there and the inverse does not:
    that shows far more in the weight error than in the output error."""
    import torch
    from fusion_bench.method.regmean.regmean import merging_with_regmean_weights

    d_in = weights[0].shape[1]
    fb_grams = [
        {"system": torch.from_numpy((gram_matrix(g, d_in) / c).astype(np.float32))}
        for g, c in zip(grams, counts, strict=True)
    ]
    params = {"system.weight": [torch.from_numpy(np.asarray(w, dtype=np.float32)) for w in weights]}
    torch.set_num_threads(threads)

    def run() -> np.ndarray:
        with torch.no_grad():  # as regmean_merging calls it
            out = merging_with_regmean_weights(params, fb_grams, reduce_non_diagonal_ratio=alpha)
        return np.asarray(out["system.weight"].numpy(), dtype=np.float64)

    return run


def gram_matrix(g: np.ndarray, d: int) -> np.ndarray:
    """A stored Gram (d x d, or its upper triangle packed row by row) as a d x d matrix."""
    g = np.asarray(g, dtype=np.float64)
    if g.ndim == 2:
        return g
    full = np.zeros((d, d))
    full[np.triu_indices(d)] = g
    return full + np.triu(full, 1).T


def profile(args: argparse.Namespace, workdir: Path, peaks: dict[str, float]) -> None:
    """Per RegMean system of the given encoder layers of bench_regmean.py's model:
    auto against float64 (``compare_systems``)."""
    from lmdx import Statistics

    stats = [Statistics.load(workdir / f"lmdx_incl_{i}.safetensors") for i in range(args.models)]
    models = bench.build_models(args)
    params = [dict(m.named_parameters()) for m in models]
    groups: dict[str, list[str]] = {}
    for module in stats[0].modules:
        if any(f"encoder.layer.{n}." in module for n in args.profile):
            groups.setdefault(stats[0].group_of(module), []).append(module)
    systems = []
    for modules in groups.values():
        grams = [s.gram_stored(modules[0]) for s in stats]
        counts = [s.count(modules[0]) for s in stats]
        weights = [
            np.concatenate([p[m + ".weight"].detach().numpy() for m in modules]) for p in params
        ]
        systems.append((modules[0], grams, counts, weights))
    compare_systems(systems, args.alphas[0], args.threads, args.verbose, peaks)


def real_finetunes(args: argparse.Namespace, peaks: dict[str, float]) -> None:
    """The RegMean systems of real fine-tuned models (folders with ``model.safetensors`` and
    the statistics the real example collected, ``stats-*/regmean.safetensors``): each
    weight's deviation from the models' average (RMS relative, ||W_i - W-|| / ||W-||), then
    auto against float64 on every system whose weights differ (``compare_systems``, with
    the noise floor of the statistics' accumulation precision, as a merge uses)."""
    from lmdx import Statistics
    from lmdx.merge.builtin.regmean_solve import noise_floor
    from safetensors.numpy import load_file

    folders = [Path(f) for f in args.real]
    stats, params = [], []
    for f in folders:
        found = sorted(f.glob("stats-*/regmean.safetensors"))
        if not found:
            raise SystemExit(f"{f}: no stats-*/regmean.safetensors (run the real example first)")
        stats.append(Statistics.load(found[0]))
        params.append(load_file(str(f / "model.safetensors")))
    groups: dict[str, list[str]] = {}
    for module in stats[0].modules:
        groups.setdefault(stats[0].group_of(module), []).append(module)
    systems, deviations = [], []
    for modules in groups.values():
        weights = [np.concatenate([p[m + ".weight"] for m in modules]) for p in params]
        dev = deviation(weights)
        if dev == 0.0:
            continue  # frozen in every fine-tune: returned as it is, nothing to solve
        deviations.append((modules[0], dev))
        grams = [s.gram_stored(modules[0]) for s in stats]
        counts = [s.count(modules[0]) for s in stats]
        systems.append((modules[0], grams, counts, weights))
    print(f"real fine-tunes: {', '.join(f.name for f in folders)}")
    for name, dev in deviations:
        print(f"  {name}: largest deviation from the average {100 * dev:.2f} %")
    compare_systems(systems, args.alphas[0], args.threads, args.verbose, peaks, noise_floor(stats))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", help="a bench_regmean.py --workdir with Grams")
    ap.add_argument("--rounds", type=int, default=2, help="merges of each implementation")
    ap.add_argument("--alphas", type=float, nargs="+", default=[0.9])
    ap.add_argument("--models", type=int, default=3)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--noise", type=float, default=0.02, help="copies' noise × std (0.1: stress)")
    ap.add_argument("--profile", type=int, nargs="*", default=None, help="encoder layers")
    ap.add_argument("--verbose", action="store_true", help="print every system's phases")
    ap.add_argument("--real", nargs="*", default=None, help="fine-tuned model folders")
    ap.add_argument("--baseline", default=None, help="another lmdx build's folder (lmdx_base)")
    ap.add_argument("--baseline-workdir", default=None, help="lmdx_base's Grams (else --workdir)")
    args = ap.parse_args()
    if not args.real and args.workdir is None:
        ap.error("--workdir is needed (or --real FOLDER ...)")
    print(f"machine: {bench.machine()}", flush=True)
    peaks = measure_peaks(args.threads)
    print(peak_line(peaks, args.threads), flush=True)
    if args.real:
        real_finetunes(args, peaks)
        return
    workdir = Path(args.workdir)
    where = {"lmdx_base": Path(args.baseline_workdir or workdir)}  # each impl's Grams
    from lmdx import Statistics
    from safetensors.numpy import load_file

    one = copy.copy(args)
    one.merge_reps = 1
    times: dict[tuple[str, float], list[float]] = defaultdict(list)
    solver: dict[tuple[str, float], dict[str, Any]] = {}
    impls = ("fusionbench", "lmdx", "lmdx_base", "lmdx_f64") if args.baseline else IMPLS
    for r in range(args.rounds):
        for impl in impls:
            path = args.baseline if impl == "lmdx_base" else None
            folder = where.get(impl, workdir)
            for alpha, res in bench.run_merges(one, impl, folder, path).items():
                times[impl, alpha] += res["times"]
                solver[impl, alpha] = res["solver"]
                print(f"round {r}: {impl} α={alpha}: {res['times'][0]:.2f} s", flush=True)
    stats = [Statistics.load(workdir / f"lmdx_incl_{i}.safetensors") for i in range(args.models)]
    print(f"load average at the end: {list(os.getloadavg())}")
    for alpha in args.alphas if args.rounds > 0 else []:
        merged = {
            impl: load_file(str(where.get(impl, workdir) / f"merged_{impl}_{alpha}.safetensors"))
            for impl in impls
        }
        fb = bench.med(times["fusionbench", alpha])
        flops = model_flops(stats[0], merged["lmdx_f64"], args.models)
        print(
            f"\nα = {alpha}, noise {args.noise}: merge time per round, median, FusionBench / this,"
            f" share of the measured peak for {flops / 1e9:.1f} GFLOP of float32 work"
        )
        for impl in impls:
            t, sv = times[impl, alpha], solver[impl, alpha]
            share = efficiency(flops, bench.med(t), peaks, impl == "lmdx_f64")
            line = (
                f"  {impl:12s} {' '.join(f'{x:.2f}' for x in t)} s, median {bench.med(t):.2f} s,"
                f" {fb / bench.med(t):.2f}x, {share}"
            )
            if sv:
                line += (
                    f"; systems {sv.get('precision')}, largest certified output error"
                    f" {sv.get('max_output_error_estimate', 0.0):.1e}"
                )
            if impl != "lmdx_f64":
                e = merged_errors(merged[impl], merged["lmdx_f64"], stats, alpha)
                line += (
                    f"; weight error {e['weight_max']:.1e} ({e['weight_median']:.1e}),"
                    f" output error {e['output_max']:.1e} ({e['output_median']:.1e})"
                )
            print(line, flush=True)
    if args.profile:
        print("\nper system (regmean_merge_layer, phases in seconds):")
        profile(args, workdir, peaks)


if __name__ == "__main__":
    main()
