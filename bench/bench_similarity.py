"""Representation similarity of every pair of models: lmdx's streamed moments vs the
full-matrix NumPy computation and minibatch CKA, on the same embeddings.

Synthetic "models": m embedding models (default widths 256, 384, 512) sharing a 64-dim
latent: model j's row is ``L A_j + σ_j E_j + c_j`` (``L``, ``E_j`` standard normal, float32),
generated in seeded batches so every method sees the same numbers.

Methods:

* ``lmdx``: the batches stream (float32) into :class:`lmdx.lmd.SplitMoments` with the norm
  sums debiased CKA needs (``norms=True``); then every cheap measure (CKA, debiased CKA,
  CCA, SVCCA, PWCCA, Procrustes) of every pair from the moments. The same stream without
  the norm sums times the joint Gram alone, so the extra accumulators' cost is their
  difference.
* ``full``: the N × D matrix in memory (float64 copy of the same float32 numbers), every
  measure from the centred data: CKA and debiased CKA from the feature-space products and
  the squared row norms, CCA/SVCCA/PWCCA from QR and SVD of the centred data, Procrustes
  from the nuclear norm of XᵀY. Values are compared with lmdx's (max abs difference).
* ``minibatch``: minibatch CKA as streaming CKA packages compute it: per batch of k rows the
  unbiased HSIC of the k × k U-centred linear Grams, averaged over batches, then
  ``mean HSIC_xy / √(mean HSIC_xx · mean HSIC_yy)``; for several k, against the full-data
  CKA and debiased CKA.

Memory: with ``--rss-rows N1 N2 …`` lmdx streams N rows in a subprocess each (batches made
on the fly) and reports its peak RSS (``VmHWM``) and the RSS after imports; the full
method would hold N × D float32 (plus its float64 copy).

Run: ``python bench/bench_similarity.py`` (defaults below) or ``--quick``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import subprocess
import sys
import time
from typing import Any

import numpy as np

DIMS = (256, 384, 512)
LATENT = 64
ROWS = 20_000
RSS_ROWS = (20_000, 200_000)
BATCH = 1_000
MINIBATCHES = (16, 64, 256, 1024)
THREADS = 2
SEED = 0


def batches(dims: tuple[int, ...], rows: int, batch: int, seed: int):
    """Seeded float32 batches (list of m arrays (n_b, d_j)) covering ``rows`` rows."""
    rng = np.random.default_rng([seed, 0])
    maps = [rng.standard_normal((LATENT, d)).astype(np.float32) / 8.0 for d in dims]
    noise = np.linspace(0.3, 1.5, len(dims)).astype(np.float32)
    offset = [rng.standard_normal(d).astype(np.float32) for d in dims]
    for b, lo in enumerate(range(0, rows, batch)):
        n = min(batch, rows - lo)
        r = np.random.default_rng([seed, 1, b])
        lat = r.standard_normal((n, LATENT), dtype=np.float32)
        yield [
            lat @ a + s * r.standard_normal((n, d), dtype=np.float32) + c
            for a, s, c, d in zip(maps, noise, offset, dims, strict=True)
        ]


def stream(dims, rows, batch, seed, threads, *, norms: bool):
    from lmdx.lmd import SplitMoments

    sm = SplitMoments([f"m{j}" for j in range(len(dims))], dims, norms=norms)
    t_gen = 0.0
    start = time.perf_counter()
    gen = batches(dims, rows, batch, seed)
    while True:
        t0 = time.perf_counter()
        part = next(gen, None)
        t_gen += time.perf_counter() - t0
        if part is None:
            break
        sm.add(part, n_threads=threads)
    return sm, time.perf_counter() - start - t_gen


# ---------------------------------------------------------------- full-matrix reference


def full_measures(xs: list[np.ndarray], fraction: float = 0.99) -> dict[str, np.ndarray]:
    m = len(xs)
    n = len(xs[0])
    cs = [x - x.mean(0) for x in xs]
    sq = [np.einsum("ti,ti->t", c, c) for c in cs]
    qr = []
    for c in cs:
        u, s, _ = np.linalg.svd(c, full_matrices=False)
        keep = s**2 > 1e-10 * s[0] ** 2
        qr.append((u[:, keep], s[keep]))
    out = {k: np.full((m, m), np.nan) for k in ("cka", "debiased_cka", "cca_mean", "svcca")}
    out["pwcca"] = np.full((m, m), np.nan)
    out["procrustes"] = np.full((m, m), np.nan)

    def h(i: int, j: int) -> float:
        cov = cs[i].T @ cs[j] / n
        tr_i, tr_j = sq[i].sum() / n, sq[j].sum() / n
        return float(
            (cov**2).sum() + tr_i * tr_j / ((n - 1) * (n - 2)) - sq[i] @ sq[j] / n / (n - 2)
        )

    for i, j in itertools.combinations(range(m), 2):
        cross = cs[i].T @ cs[j]
        fi = np.linalg.norm(cs[i].T @ cs[i])
        fj = np.linalg.norm(cs[j].T @ cs[j])
        out["cka"][i, j] = out["cka"][j, i] = (cross**2).sum() / (fi * fj)
        out["debiased_cka"][i, j] = out["debiased_cka"][j, i] = h(i, j) / math.sqrt(
            h(i, i) * h(j, j)
        )
        a, rho, bt = np.linalg.svd(qr[i][0].T @ qr[j][0], full_matrices=False)
        out["cca_mean"][i, j] = out["cca_mean"][j, i] = rho.mean()
        for (p, q), vecs in (((i, j), a), ((j, i), bt.T)):
            alpha = np.abs((qr[p][0] @ vecs[:, : len(rho)]).T @ cs[p]).sum(axis=1)
            out["pwcca"][p, q] = alpha @ rho / alpha.sum()
        lead = []
        for u, s in (qr[i], qr[j]):
            cum = np.cumsum(s**2)
            lead.append(u[:, : int(np.argmax(cum >= fraction * cum[-1])) + 1])
        out["svcca"][i, j] = out["svcca"][j, i] = np.linalg.svd(
            lead[0].T @ lead[1], compute_uv=False
        ).mean()
        nuc = np.linalg.svd(cross, compute_uv=False).sum()
        d2 = 2 - 2 * nuc / (np.linalg.norm(cs[i]) * np.linalg.norm(cs[j]))
        out["procrustes"][i, j] = out["procrustes"][j, i] = d2
    return out


# ---------------------------------------------------------------- minibatch CKA


def _u_centre(k: np.ndarray) -> np.ndarray:
    n = len(k)
    k = k.copy()
    np.fill_diagonal(k, 0.0)
    rows = k.sum(0) / (n - 2)
    rows -= rows.sum() / (2 * (n - 1))
    k -= rows[:, None] + rows[None, :]
    np.fill_diagonal(k, 0.0)
    return k


def minibatch_cka(x: np.ndarray, y: np.ndarray, k: int) -> float:
    """Average of per-batch unbiased HSICs of the linear Grams (batches of k rows)."""
    hxy = hxx = hyy = 0.0
    for lo in range(0, len(x) - k + 1, k):
        kx = _u_centre(x[lo : lo + k] @ x[lo : lo + k].T)
        ky = _u_centre(y[lo : lo + k] @ y[lo : lo + k].T)
        hxy += float((kx * ky).sum())
        hxx += float((kx * kx).sum())
        hyy += float((ky * ky).sum())
    return hxy / math.sqrt(hxx * hyy)


# ---------------------------------------------------------------- runs


def rss_worker(args: argparse.Namespace) -> dict[str, Any]:
    import lmdx  # noqa: F401  (imports before the baseline)
    from lmdx.lmd.similarity import CHEAP_MEASURES, moments_similarity

    base = status_bytes("VmRSS")
    start = time.perf_counter()
    sm, _ = stream(args.dims, args.worker_rows, args.batch, args.seed, args.threads, norms=True)
    res = moments_similarity(sm, CHEAP_MEASURES)
    return {
        "rows": args.worker_rows,
        "seconds": time.perf_counter() - start,
        "baseline_rss": base,
        "peak_rss": status_bytes("VmHWM"),
        "cka01": float(res.tables["cka"][0, 1]),
    }


def status_bytes(key: str) -> int:
    """VmRSS / VmHWM of this process. (VmHWM starts afresh at exec; getrusage's ru_maxrss
    would carry the forking parent's RSS.)"""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(f"{key}:"))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dims", type=lambda s: tuple(int(v) for v in s.split(",")), default=DIMS)
    p.add_argument("--rows", type=int, default=ROWS)
    p.add_argument("--rss-rows", type=int, nargs="*", default=list(RSS_ROWS))
    p.add_argument("--batch", type=int, default=BATCH)
    p.add_argument("--minibatches", type=int, nargs="*", default=list(MINIBATCHES))
    p.add_argument("--threads", type=int, default=THREADS)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    p.add_argument("--worker-rows", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.dims, args.rows, args.rss_rows, args.minibatches = (
            (32, 48),
            2_000,
            [1_000, 4_000],
            [16, 128],
        )
    if args.worker_rows:
        print(json.dumps(rss_worker(args)))
        return 0

    import lmdx
    import threadpoolctl
    from lmdx.lmd.similarity import CHEAP_MEASURES, moments_similarity

    threadpoolctl.threadpool_limits(args.threads)
    names = [f"m{j}" for j in range(len(args.dims))]
    print(
        f"machine: {lmdx.config()['simd_path']} path, {os.cpu_count()} CPUs, load {os.getloadavg()}"
    )
    print(
        f"data: {len(args.dims)} models of widths {args.dims} (D = {sum(args.dims)}), "
        f"N = {args.rows}, batches of {args.batch}, float32, {args.threads} threads"
    )

    stream(args.dims, 4 * args.batch, args.batch, args.seed + 1, args.threads, norms=True)  # warm
    t_gram = t_all = math.inf
    for _ in range(2):  # alternated, best of two (shared machines)
        _, t = stream(args.dims, args.rows, args.batch, args.seed, args.threads, norms=False)
        t_gram = min(t_gram, t)
        sm, t = stream(args.dims, args.rows, args.batch, args.seed, args.threads, norms=True)
        t_all = min(t_all, t)
    t0 = time.perf_counter()
    res = moments_similarity(sm, CHEAP_MEASURES)
    t_measures = time.perf_counter() - t0

    xs = [
        np.concatenate(parts)
        for parts in zip(*batches(args.dims, args.rows, args.batch, args.seed), strict=True)
    ]
    t0 = time.perf_counter()
    full = full_measures([x.astype(np.float64) for x in xs])
    t_full = time.perf_counter() - t0

    print("\n| step | seconds |\n|---|---|")
    print(f"| lmdx: stream, joint Gram only | {t_gram:.2f} |")
    extra = 100 * (t_all / t_gram - 1)
    print(f"| lmdx: stream, joint Gram + norm sums | {t_all:.2f} (norm sums {extra:+.0f} %) |")
    print(f"| lmdx: all cheap measures from the moments | {t_measures:.3f} |")
    print(f"| full matrix (float64 NumPy, data in memory): same measures | {t_full:.2f} |")

    print("\n| measure | pairs | max abs difference lmdx − full |\n|---|---|---|")
    for key, table in full.items():
        ours = res.tables[key]
        mask = ~np.eye(len(names), dtype=bool)
        print(f"| {key} | {mask.sum()} | {np.nanmax(np.abs(ours[mask] - table[mask])):.1e} |")

    x, y = (a.astype(np.float64) for a in xs[:2])
    print(
        f"\nminibatch CKA of m0/m1 (per-batch unbiased HSIC, averaged); full data: CKA "
        f"{res.tables['cka'][0, 1]:.4f}, debiased CKA {res.tables['debiased_cka'][0, 1]:.4f}"
    )
    print("| batch rows | minibatch CKA | seconds |\n|---|---|---|")
    for k in args.minibatches:
        t0 = time.perf_counter()
        value = minibatch_cka(x, y, k)
        print(f"| {k} | {value:.4f} | {time.perf_counter() - t0:.2f} |")

    print("\n| N | lmdx seconds | peak RSS MiB | RSS after imports MiB | full N x D float32 MiB |")
    print("|---|---|---|---|---|")
    for rows in args.rss_rows:
        cmd = [sys.executable, __file__, "--worker-rows", str(rows), "--dims",
               ",".join(map(str, args.dims)), "--batch", str(args.batch), "--threads",
               str(args.threads), "--seed", str(args.seed)]  # fmt: skip
        r = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        full_mib = rows * sum(args.dims) * 4 / 2**20
        print(
            f"| {rows} | {r['seconds']:.1f} | {r['peak_rss'] / 2**20:.0f} | "
            f"{r['baseline_rss'] / 2**20:.0f} | {full_mib:.0f} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
