"""LMD group fits: lmdx (streaming moments + one factorization) vs the reference approach.

Synthetic "models": m embedding models of d dims each (default 12 × 768) that share a
k-dim latent (default 256): model j's embedding of row x is ``L(x) A_j + σ_j E_j(x) + c_j``
with ``L`` and ``E_j`` standard normal, ``A_j`` a fixed random k × d map scaled so each
dimension's signal variance is 1, and ``σ_j² = 1/r_j − 1`` for r_j evenly spaced in
[0.5, 0.99] (the population R² of model j on the latent; its group R² on the other m − 1
models is slightly below r_j). Rows are generated in seeded batches (batch b from
``default_rng([seed, 1, b])``), so every method sees identical numbers and lmdx never needs
the N × D matrix.

Methods, each in its own subprocess (so peak RSS, from ``getrusage``, is its own):

* ``lmdx``: stream the batches into ``lmdx.Decomposition`` (float32 batches, float64
  moments), then ``fit(ridge=ρ, pairwise=False, group=True)``: all m leave-one-out group
  fits from one Cholesky factorization of the joint covariance.
* ``reference``: the reference code's approach (haozhg/lmd): store all embeddings
  (N × m·d float32, torch), then for each target j build the covariance of the other
  m − 1 models (N − 1 sample covariance, float32) and the cross-covariance with torch,
  add α·I, ``torch.linalg.solve``, predict on the stored rows and compute pooled R². α is
  lmdx's λ converted to the N − 1 convention (``α = λ·N/(N−1)``, λ = ρ·tr(Σ)/D over the
  joint population covariance, as lmdx's group fits use), so both compute the same ridge
  regression and their 12 R² values must agree (float32 tolerance).

With ``--lmdx-before DIR`` the lmdx worker also runs with another lmdx package (DIR first on
its PYTHONPATH, e.g. a copy of an earlier ``python/lmdx`` with its built modules) at the
comparison's N, and the report compares the two lmdx fits: time, peak RSS and group R².

All rows are the train split; R² is the pooled (variance-weighted) in-sample R² on those
rows for both methods. See bench/README.md.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np

ROWS = 50_000
LMDX_ROWS = (10_000, 50_000)
MODELS = 12
DIM = 768
LATENT = 256
BATCH = 2_000
RHO = 1e-3
THREADS = 2
SEED = 0
TOL_R2 = 1e-4  # |R²_lmdx − R²_reference|, reference in float32
TOL_VERSIONS = 1e-9  # relative change of a group R² between two lmdx versions (float64 both)

QUICK = {
    "models": 4,
    "dim": 64,
    "latent": 32,
    "rows": 5_000,
    "lmdx_rows": (2_000, 5_000),
    "batch": 500,
}

# --------------------------------------------------------------------------- data


class Synth:
    """Seeded batches of m models' embeddings sharing a latent (see the module notes)."""

    def __init__(self, models: int, dim: int, latent: int, seed: int) -> None:
        rng = np.random.default_rng([seed, 0])
        self.models, self.dim, self.latent, self.seed = models, dim, latent, seed
        self.maps = (rng.standard_normal((models, latent, dim)) / math.sqrt(latent)).astype(
            np.float32
        )
        self.r2_latent = np.linspace(0.5, 0.99, models)
        self.noise = np.sqrt(1.0 / self.r2_latent - 1.0).astype(np.float32)
        self.offset = (0.5 * rng.standard_normal((models, dim))).astype(np.float32)

    def batches(self, rows: int, batch: int):
        """Yield (first row, list of m float32 arrays (n_b, d)) covering ``rows`` rows."""
        for b, lo in enumerate(range(0, rows, batch)):
            n = min(batch, rows - lo)
            rng = np.random.default_rng([self.seed, 1, b])
            lat = rng.standard_normal((n, self.latent), dtype=np.float32)
            out = []
            for j in range(self.models):
                x = lat @ self.maps[j]
                x += self.noise[j] * rng.standard_normal((n, self.dim), dtype=np.float32)
                x += self.offset[j]
                out.append(x)
            yield lo, out


def rss_now_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


# --------------------------------------------------------------------------- workers


def worker_lmdx(args: argparse.Namespace) -> dict[str, Any]:
    import warnings

    import lmdx
    import threadpoolctl

    # lmdx's own kernels take n_threads; the NumPy parts of the fit (centering, scoring)
    # use NumPy's OpenBLAS, limited to the same count.
    threadpoolctl.threadpool_limits(args.threads, user_api="blas")
    t = args.threads
    names = [f"m{j:02d}" for j in range(args.models)]
    dims = [args.dim] * args.models
    synth = Synth(args.models, args.dim, args.latent, args.seed)
    # Untimed warm-up on a tiny problem (thread pools, first-call costs).
    warm = lmdx.Decomposition(["a", "b", "c"], [8, 8, 8], measures=())
    wr = np.random.default_rng(1)
    warm.add("train", [wr.standard_normal((512, 8), dtype=np.float32) for _ in range(3)])
    warm.fit(ridge=args.rho, pairwise=False, n_threads=t)
    del warm
    baseline = rss_now_bytes()

    dec = lmdx.Decomposition(names, dims, seed=args.seed, measures=())  # LMD alone
    t_gen = t_add = 0.0
    start = time.perf_counter()
    gen_iter = synth.batches(args.n, args.batch)
    while True:
        t0 = time.perf_counter()
        item = next(gen_iter, None)
        t_gen += time.perf_counter() - t0
        if item is None:
            break
        t0 = time.perf_counter()
        dec.add("train", item[1], n_threads=t)
        t_add += time.perf_counter() - t0
        del item
    fit_times = []
    result = None
    for _ in range(args.reps):
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", lmdx.SampleSizeWarning)
            result = dec.fit(ridge=args.rho, pairwise=False, group=True, n_threads=t)
        fit_times.append(time.perf_counter() - t0)
    assert result is not None
    r2 = result.group_r2("train")
    return {
        "method": "lmdx",
        "lmdx_file": lmdx.__file__,
        "n": args.n,
        "threads": t,
        "generate_s": t_gen,
        "moments_s": t_add,
        "fit_s": fit_times,
        "fit_median_s": statistics.median(fit_times),
        "wall_s": time.perf_counter() - start,
        "r2": [r2[n] for n in names],
        "lam": result.group[0].ridge_absolute,
        "baseline_rss": baseline,
        "peak_rss": peak_rss_bytes(),
    }


def worker_reference(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    m, d, n = args.models, args.dim, args.n
    synth = Synth(m, d, args.latent, args.seed)
    # Untimed warm-up (thread pool, first-call costs).
    a = torch.randn(64, 64)
    torch.linalg.solve(a @ a.T + torch.eye(64), torch.randn(64, 8))
    baseline = rss_now_bytes()

    start = time.perf_counter()
    t_gen = t_store = 0.0
    store = torch.empty((n, m * d), dtype=torch.float32)
    gen_iter = synth.batches(n, args.batch)
    while True:
        t0 = time.perf_counter()
        item = next(gen_iter, None)
        t_gen += time.perf_counter() - t0
        if item is None:
            break
        t0 = time.perf_counter()
        lo, arrays = item
        rows = torch.from_numpy(np.concatenate(arrays, axis=1))
        store[lo : lo + rows.shape[0]] = rows
        t_store += time.perf_counter() - t0
        del item, arrays, rows

    # The same ridge as lmdx's group fits: λ = ρ·tr(Σ)/D on the joint population
    # covariance, as α on the N − 1 sample covariance (α = λ·N/(N−1)). Untimed: it only
    # makes the two methods solve the same problem.
    var0 = store.double().var(dim=0, correction=0) if n * m * d < 2**27 else None
    if var0 is None:  # column blocks, to avoid an N × D float64 copy
        var0 = torch.cat(
            [store[:, c : c + d].double().var(dim=0, correction=0) for c in range(0, m * d, d)]
        )
    lam = args.rho * float(var0.mean())
    alpha = lam * n / (n - 1)

    t_cov = t_solve = t_score = 0.0
    r2 = []
    fitted = min(m, args.ref_fits or m)
    for j in range(fitted):
        t0 = time.perf_counter()
        rest = torch.cat([torch.arange(0, j * d), torch.arange((j + 1) * d, m * d)])
        z = store.index_select(1, rest)  # the other models' embeddings, stacked (copy)
        u = store[:, j * d : (j + 1) * d]
        z -= z.mean(dim=0)
        uc = u - u.mean(dim=0)
        s_zz = z.T @ z / (n - 1)
        s_zu = z.T @ uc / (n - 1)
        s_zz.diagonal().add_(alpha)
        t1 = time.perf_counter()
        w = torch.linalg.solve(s_zz, s_zu)  # (D_z, d): u ≈ Wᵀ z + b
        t2 = time.perf_counter()
        resid = uc - z @ w  # b = ū − Wᵀ z̄, so u − (Wᵀ z + b) = (u − ū) − Wᵀ (z − z̄)
        ssr = float(resid.square().sum(dtype=torch.float64))
        sst = float(uc.square().sum(dtype=torch.float64))
        r2.append(1.0 - ssr / sst)
        t3 = time.perf_counter()
        t_cov += t1 - t0
        t_solve += t2 - t1
        t_score += t3 - t2
        del z, uc, s_zz, s_zu, w, resid
        print(f"  reference fit {j + 1}/{m}: {t3 - t0:.1f} s", file=sys.stderr, flush=True)
    # With --ref-fits K < m, only targets 0..K-1 are fitted; every fit has the same shapes
    # (N × (m−1)d basis, d targets), so the m-fit time is extrapolated as m/K times theirs.
    scale = m / fitted
    return {
        "fitted": fitted,
        "measured_fits_s": t_cov + t_solve + t_score,
        "method": "reference",
        "n": n,
        "threads": args.threads,
        "generate_s": t_gen,
        "store_s": t_store,
        "cov_s": t_cov * scale,
        "solve_s": t_solve * scale,
        "score_s": t_score * scale,
        "fits_s": (t_cov + t_solve + t_score) * scale,
        "wall_s": time.perf_counter() - start,
        "r2": r2,
        "lam": lam,
        "alpha": alpha,
        "baseline_rss": baseline,
        "peak_rss": peak_rss_bytes(),
    }


# --------------------------------------------------------------------------- parent


def run_worker(
    method: str, n: int, args: argparse.Namespace, lmdx_path: str | None = None
) -> dict[str, Any]:
    """Run one worker in a subprocess; ``lmdx_path`` (a folder holding an ``lmdx`` package)
    goes first on its PYTHONPATH, so another lmdx than this one's runs there."""
    env = dict(os.environ)
    if lmdx_path:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (lmdx_path, env.get("PYTHONPATH")) if p)
    cmd = [
        sys.executable, os.path.abspath(__file__), "--worker", method, "--n", str(n),
        "--models", str(args.models), "--dim", str(args.dim), "--latent", str(args.latent),
        "--batch", str(args.batch), "--rho", repr(args.rho), "--threads", str(args.threads),
        "--reps", str(args.reps), "--seed", str(args.seed), "--ref-fits", str(args.ref_fits),
    ]  # fmt: skip
    where = f" from {lmdx_path}" if lmdx_path else ""
    print(f"[{method}{where}, N = {n}] running …", flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"{method} worker (N = {n}) failed with status {proc.returncode}")
    line = next(ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("RESULT "))
    result: dict[str, Any] = json.loads(line[len("RESULT ") :])
    return result


def header_lines(args: argparse.Namespace) -> list[str]:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_core  # machine/library description shared with the core benchmark
    import lmdx
    import threadpoolctl

    cpu = bench_core.cpu_model()
    lm = lmdx.config()
    ti = bench_core.torch_info()
    lines = [
        f"date: {datetime.datetime.now().astimezone().isoformat(timespec='seconds')}",
        f"command: {' '.join([os.path.basename(sys.executable), *sys.argv])}",
        f"cpu: {cpu.get('model_name', '?')} ({cpu.get('machine')}), "
        f"{cpu.get('logical_cpus', '?')} logical CPUs, {bench_core.available_cpus()} available, "
        f"virtualized {cpu.get('virtualized', '?')}, SIMD flags "
        f"{' '.join(cpu.get('simd_flags', []))}",
        f"load average at start: {list(os.getloadavg())}",
        f"lmdx {lm['version']} ({os.path.dirname(lmdx.__file__)}): SIMD path {lm['simd_path']}, "
        f"OpenMP {lm['openmp']}, "
        f"Eigen {lm['eigen']}, {lm['compiler']}",
        f"python {platform.python_version()}, numpy {np.__version__} "
        f"(built with {bench_core.build_blas(np)}), threadpoolctl {threadpoolctl.__version__}",
        f"torch {ti.get('version')}: BLAS {ti.get('blas')} ({ti.get('mkl') or 'no MKL'}), "
        f"CPU capability {ti.get('cpu_capability')}",
        f"threads: {args.threads} for both (lmdx n_threads={args.threads} + NumPy OpenBLAS "
        f"limited by threadpoolctl; torch.set_num_threads({args.threads}))",
        f"data: {args.models} models x {args.dim} dims (D = {args.models * args.dim}), shared "
        f"latent of {args.latent} dims, batches of {args.batch} rows, seed {args.seed}; "
        f"ridge rho = {args.rho:g} (lambda = rho*tr(Sigma)/D, joint population covariance)",
        "R²: pooled, in-sample, all N rows are the train split (both methods)",
    ]
    return lines


def gib(b: float) -> str:
    return f"{b / 2**30:.2f}"


def report(
    args: argparse.Namespace, lm: list[dict], ref: dict, before: dict | None = None
) -> tuple[list[str], bool]:
    """Table lines (markdown) and whether the agreement checks passed."""
    lines = [
        f"| method | N | moments / store s | {args.models} group fits s | total s | peak RSS GiB "
        "| RSS before data GiB | reference / lmdx (total) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ref_total = ref["store_s"] + ref["fits_s"]
    for r in lm:
        total = r["moments_s"] + r["fit_median_s"]
        ratio = f"{ref_total / total:.1f}x" if r["n"] == ref["n"] else "—"
        lines.append(
            f"| **lmdx** | {r['n']} | {r['moments_s']:.1f} | {r['fit_median_s']:.1f} "
            f"| {total:.1f} | {gib(r['peak_rss'])} | {gib(r['baseline_rss'])} | {ratio} |"
        )
    if before is not None:
        total = before["moments_s"] + before["fit_median_s"]
        lines.append(
            f"| lmdx before (`{args.lmdx_before}`) | {before['n']} | {before['moments_s']:.1f} "
            f"| {before['fit_median_s']:.1f} | {total:.1f} | {gib(before['peak_rss'])} "
            f"| {gib(before['baseline_rss'])} | {ref_total / total:.1f}x |"
        )
    lines.append(
        f"| reference (torch fp32, {args.models} solves) | {ref['n']} | {ref['store_s']:.1f} "
        f"| {ref['fits_s']:.1f} | {ref_total:.1f} | {gib(ref['peak_rss'])} "
        f"| {gib(ref['baseline_rss'])} | 1.0x |"
    )
    same = next(r for r in lm if r["n"] == ref["n"])
    if ref["fitted"] < args.models:
        lines.append(
            f"\nreference: {ref['fitted']} of {args.models} fits measured "
            f"({ref['measured_fits_s']:.1f} s); its {args.models}-fit times are "
            f"{args.models}/{ref['fitted']} times that (all fits have the same shapes)"
        )
    fits_ratio = ref["fits_s"] / same["fit_median_s"]
    solve_ratio = ref["solve_s"] / same["fit_median_s"]
    k = ref["fitted"]
    diffs = np.abs(np.array(same["r2"][:k]) - np.array(ref["r2"]))
    ok = bool(diffs.max() <= TOL_R2)
    lines += [
        "",
        f"reference phases at N = {ref['n']}: covariances (copy, center, ZᵀZ, ZᵀU) "
        f"{ref['cov_s']:.1f} s, torch.linalg.solve {ref['solve_s']:.1f} s, scoring (predict "
        f"on stored rows) {ref['score_s']:.1f} s; data generation (untimed) "
        f"{ref['generate_s']:.1f} s",
        f"lmdx fit times (s): {', '.join(f'{t:.2f}' for t in same['fit_s'])}; data "
        f"generation (untimed) {same['generate_s']:.1f} s",
        f"ratios at N = {ref['n']}: end to end (store + {args.models} fits vs moments + fit) "
        f"{(ref['store_s'] + ref['fits_s']) / (same['moments_s'] + same['fit_median_s']):.1f}x; "
        f"{args.models} fits from stored data vs lmdx fit from moments {fits_ratio:.1f}x; "
        f"the {args.models} torch.linalg.solve calls alone vs the whole lmdx fit "
        f"{solve_ratio:.1f}x",
        f"ridge: lmdx lambda = {same['lam']:.6g}, reference lambda = {ref['lam']:.6g} "
        f"(alpha on the N-1 covariance {ref['alpha']:.6g})",
        "group R² (lmdx / reference): "
        + ", ".join(
            f"{a:.5f}/{b:.5f}" if i < k else f"{a:.5f}/—"
            for i, (a, b) in enumerate(itertools.zip_longest(same["r2"], ref["r2"]))
        ),
        f"agreement ({k} of {args.models} targets): max |R²_lmdx − R²_reference| = "
        f"{diffs.max():.2e} (tolerance {TOL_R2:g}) "
        f"— {'within' if ok else 'OUTSIDE'}",
    ]
    if before is not None:
        change = np.abs(np.array(same["r2"]) - np.array(before["r2"]))
        rel = change / np.abs(np.array(before["r2"]))
        same_r2 = bool(rel.max() <= TOL_VERSIONS)
        ok = ok and same_r2
        lines += [
            f"lmdx vs lmdx before at N = {before['n']}: fit {before['fit_median_s']:.1f} s → "
            f"{same['fit_median_s']:.1f} s ({before['fit_median_s'] / same['fit_median_s']:.1f}x"
            f"), peak RSS {gib(before['peak_rss'])} → {gib(same['peak_rss'])} GiB; group R² "
            f"max relative change {rel.max():.1e} (tolerance {TOL_VERSIONS:g}) — "
            f"{'within' if same_r2 else 'OUTSIDE'}",
        ]
    return lines, ok


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--quick",
        action="store_true",
        help="smoke test: 4 models x 64 dims, latent 32, N 5000 (lmdx also 2000)",
    )
    p.add_argument("--models", type=int)
    p.add_argument("--dim", type=int)
    p.add_argument("--latent", type=int)
    p.add_argument("--rows", type=int, help=f"N for the comparison (default {ROWS})")
    p.add_argument(
        "--lmdx-rows",
        type=int,
        nargs="+",
        help=f"N values for lmdx alone (default {LMDX_ROWS}; --rows is added)",
    )
    p.add_argument("--batch", type=int)
    p.add_argument("--rho", type=float, default=RHO)
    p.add_argument("--threads", type=int, default=THREADS)
    p.add_argument("--reps", type=int, default=1, help="timed lmdx fits (median reported)")
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument(
        "--ref-fits",
        type=int,
        default=0,
        help="reference: fit only the first K targets and extrapolate the time of "
        "all m fits as m/K times theirs (0: all; every fit has the same shapes)",
    )
    p.add_argument(
        "--lmdx-before",
        metavar="DIR",
        help="also run the lmdx worker (at N = --rows) with DIR first on PYTHONPATH: DIR holds "
        "another lmdx package (e.g. a copy of an earlier python/lmdx with its built modules), "
        "reported as 'lmdx before' with its fit time, memory and R² against this lmdx's",
    )
    p.add_argument("--markdown", metavar="FILE", help="also write the report as markdown")
    p.add_argument("--json", metavar="FILE", help="also write the raw results as JSON")
    p.add_argument("--worker", choices=("lmdx", "reference"), help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)  # fmt: skip
    q = QUICK if args.quick else {}
    args.models = args.models or q.get("models", MODELS)
    args.dim = args.dim or q.get("dim", DIM)
    args.latent = args.latent or q.get("latent", LATENT)
    args.rows = args.rows or q.get("rows", ROWS)
    args.lmdx_rows = sorted(set(args.lmdx_rows or q.get("lmdx_rows", LMDX_ROWS)) | {args.rows})
    args.batch = args.batch or q.get("batch", BATCH)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        fn = worker_lmdx if args.worker == "lmdx" else worker_reference
        print("RESULT " + json.dumps(fn(args)), flush=True)
        return 0
    header = header_lines(args)
    print("\n".join(header), flush=True)
    started = time.perf_counter()
    lm = [run_worker("lmdx", n, args) for n in args.lmdx_rows]
    before = run_worker("lmdx", args.rows, args, args.lmdx_before) if args.lmdx_before else None
    ref = run_worker("reference", args.rows, args)
    table, ok = report(args, lm, ref, before)
    elapsed = time.perf_counter() - started
    print()
    print("\n".join(table))
    print(f"\ntotal wall time {elapsed:.1f} s")
    if args.markdown:
        with open(args.markdown, "w", encoding="utf-8") as f:
            f.write("\n".join(["#### Machine and settings", ""] + [f"- {h}" for h in header]
                              + ["", "#### Results", ""] + table
                              + ["", f"total wall time {elapsed:.1f} s"]) + "\n")  # fmt: skip
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(
                {"header": header, "lmdx": lm, "lmdx_before": before, "reference": ref}, f, indent=1
            )
    if not ok:
        print("error: lmdx and the reference (or lmdx before) disagree", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
