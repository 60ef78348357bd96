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
it went through). Those comparisons report wall and process CPU time and alternate the
order of auto and float64 from system to system: on a loaded machine read the CPU time of a
one-thread run (``--threads 1``).

With ``--real FOLDER ...`` (fine-tuned models, each folder with ``model.safetensors`` and
the statistics the real example collected, ``stats-*/regmean.safetensors``), the same
comparison on their RegMean systems, after each weight's measured deviation from the
models' average.

Run from the repository root, after ``bench_regmean.py --workdir WORK ...``::

    python bench/bench_regmean_merge.py --workdir WORK --rounds 2 --profile 0 11 --verbose
    python bench/bench_regmean_merge.py --workdir WORK --noise 0.01 --rounds 0 --profile $(seq 0 11)
    python bench/bench_regmean_merge.py --real ~/.cache/lmdx/finetuned/* --threads 1
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


def compare_systems(
    systems: list[tuple[str, list[Any], list[float], list[np.ndarray]]],
    alpha: float,
    threads: int,
    verbose: bool,
    noise_floor: float = 0.0,
) -> None:
    """Each system (name, stored Grams, counts, weights [out, in]) merged alone by
    ``lmdx.regmean_merge_layer`` in auto and float64 after an untimed merge, the order
    alternating from system to system (auto first, then float64 first); wall and process
    CPU time (the CPU time is the one to read on a loaded machine, with one thread),
    systems per precision, both error measures of auto against float64, the largest
    certified output error. ``noise_floor`` as for ``regmean_merge_layer``."""
    import lmdx

    wall = {"auto": 0.0, "float64": 0.0}
    cpu = {"auto": 0.0, "float64": 0.0}
    chosen: dict[str, int] = defaultdict(int)
    weight_errors, output_errors, certified = [], [], [0.0]
    for n, (name, grams, counts, weights) in enumerate(systems):
        merged = {}
        order = ("auto", "float64") if n % 2 == 0 else ("float64", "auto")
        # Untimed first: the first merge of a system pays for touching its inputs.
        lmdx.regmean_merge_layer(grams, weights, counts, alpha=alpha, n_threads=threads)
        for precision in order:
            t0, c0 = time.perf_counter(), time.process_time()
            res = lmdx.regmean_merge_layer(
                grams,
                weights,
                counts,
                alpha=alpha,
                precision=precision,
                n_threads=threads,
                noise_floor=noise_floor,
            )
            seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
            wall[precision] += seconds
            cpu[precision] += cpu_seconds
            merged[precision] = res.weight
            info = res.info
            if precision == "auto":
                chosen[info.precision] += 1
                certified.append(info.output_error_estimate)
            timed = info.timings or dict.fromkeys(info.phases, float("nan"))  # LMDX_PROFILE=ON
            phases = " ".join(f"{k} {v:.3f}" for k, v in timed.items())
            if verbose:
                print(
                    f"  {name} ({weights[0].shape[1]} -> {weights[0].shape[0]})"
                    f" {precision}: {seconds:.3f} s (CPU {cpu_seconds:.3f} s), {info.precision}"
                    f" (estimate {info.output_error_estimate:.1e}); {phases}",
                    flush=True,
                )
        s = 0.0
        for g, c in zip(grams, counts, strict=True):
            g_hat = gram_matrix(g, weights[0].shape[1]) / c
            s = s + alpha * g_hat + (1.0 - alpha) * np.diag(np.diag(g_hat))
        w = merged["float64"].astype(np.float32).astype(np.float64)  # as stored
        e = merged["auto"].astype(np.float32).astype(np.float64) - w
        weight_errors.append(bench.rel_max(w + e, w))
        output_errors.append(float(np.sqrt(np.sum((e @ s) * e) / np.sum((w @ s) * w))))
    print(
        f"  {len(systems)} systems, {threads} thread(s): auto {wall['auto']:.2f} s"
        f" (CPU {cpu['auto']:.2f} s; {dict(chosen)}), float64 {wall['float64']:.2f} s"
        f" (CPU {cpu['float64']:.2f} s); float64 / auto {wall['float64'] / wall['auto']:.2f}x"
        f" (CPU {cpu['float64'] / cpu['auto']:.2f}x); auto against float64 (both stored in"
        f" float32): weight error max {max(weight_errors):.1e} (median"
        f" {bench.med(weight_errors):.1e}), output error max {max(output_errors):.1e} (median"
        f" {bench.med(output_errors):.1e}), certified <= {max(certified):.1e}",
        flush=True,
    )


def gram_matrix(g: np.ndarray, d: int) -> np.ndarray:
    """A stored Gram (d x d, or its upper triangle packed row by row) as a d x d matrix."""
    g = np.asarray(g, dtype=np.float64)
    if g.ndim == 2:
        return g
    full = np.zeros((d, d))
    full[np.triu_indices(d)] = g
    return full + np.triu(full, 1).T


def profile(args: argparse.Namespace, workdir: Path) -> None:
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
    compare_systems(systems, args.alphas[0], args.threads, args.verbose)


def real_finetunes(args: argparse.Namespace) -> None:
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
        mean = sum(w.astype(np.float64) for w in weights) / len(weights)
        dev = max(float(np.linalg.norm(w - mean) / np.linalg.norm(mean)) for w in weights)
        if dev == 0.0:
            continue  # frozen in every fine-tune: returned as it is, nothing to solve
        deviations.append((modules[0], dev))
        grams = [s.gram_stored(modules[0]) for s in stats]
        counts = [s.count(modules[0]) for s in stats]
        systems.append((modules[0], grams, counts, weights))
    print(f"real fine-tunes: {', '.join(f.name for f in folders)}")
    for name, dev in deviations:
        print(f"  {name}: largest deviation from the average {100 * dev:.2f} %")
    compare_systems(systems, args.alphas[0], args.threads, args.verbose, noise_floor(stats))


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
    ap.add_argument("--noise", type=float, default=0.1, help="fine-tuning noise (× tensor std)")
    ap.add_argument("--profile", type=int, nargs="*", default=None, help="encoder layers")
    ap.add_argument("--verbose", action="store_true", help="print every system's phases")
    ap.add_argument("--real", nargs="*", default=None, help="fine-tuned model folders")
    args = ap.parse_args()
    if args.real:
        print(f"machine: {bench.machine()}", flush=True)
        real_finetunes(args)
        return
    if args.workdir is None:
        ap.error("--workdir is needed (or --real FOLDER ...)")
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
