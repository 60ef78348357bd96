"""The task-matrix methods that factor (TSV-M, ISO-C, ISO-CTS) at BERT-base's matrix shapes:
lmdx's default (float64 Gram eigendecompositions) and its ``precision: float64`` path
(NumPy SVDs) against FusionBench's own implementation.

Per encoder layer of BERT-base, six matrices: query, key, value, attention output
(768 x 768), intermediate (3072 x 768) and output (768 x 3072), ``--layers`` layers (12:
the whole encoder). Base weights are seeded Gaussians of standard deviation 0.02 (BERT's
initialization), each of the K task vectors a seeded Gaussian of ``--noise`` (0.02) times
that: what real fine-tune deltas look like (slowly decaying spectra). In one process,
2 threads (NumPy's BLAS by threadpoolctl where installed, torch's by
``torch.set_num_threads``), wall time, the three runs alternated ``--reps`` times, with a
pause between runs so that one library's spinning threads do not slow the next:

* lmdx's ``tsv_merge`` / ``iso_c_merge`` / ``iso_cts_merge`` (``--method``), default
  (``precision: auto``) and ``precision: float64``, on the float64 task matrices lmdx
  merges;
* FusionBench 0.2.33's own function on float32 torch task vectors, as its merge calls it
  (its per-matrix ``print`` sent to a buffer): TSV-M ``compute_and_sum_svd_mem_reduction``
  (TSVM_utils), ISO-C ``iso_c`` and ISO-CTS ``iso_cts`` (isotropic_merging.iso_utils,
  ``common_space_fraction`` 0.8: torch float32 SVDs, the polar factors by SVD). Where
  fusion_bench does not import, a torch float32 SVD TSV-M written here stands in for
  TSV-M, labelled as such (the ISO methods need FusionBench).

Per shape (one matrix of it: min and median over reps) and for the whole set (every
matrix of every layer in one call each), it prints the times, the ratio lmdx/FusionBench,
the path the default took per matrix (Gram or float64 SVDs, counted in an untimed pass),
and both error measures of each result's merged weight ``W = θ_0 + update`` against
lmdx's float64 one ``W*``: the weight error ``max|E| / max|W*|`` and the output error
``‖E‖_S / ‖W*‖_S`` (``‖A‖²_S = tr(A S Aᵀ)``, ``S`` a seeded Gram of correlated inputs:
a data-free method has no statistics). First, the factorizations' floor at 768².

    python bench/bench_svd_methods.py [--method tsv_m] [--layers 12] [--k 3] [--reps 3]
        [--noise 0.02]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import scipy.linalg
import torch
from lmdx.merge.builtin.isotropic import (
    iso_c_merge,
    iso_c_merge_fast,
    iso_cts_merge,
    iso_cts_merge_fast,
)
from lmdx.merge.builtin.tsv import tsv_merge, tsv_merge_fast

THREADS = 2
PAUSE_S = 0.3
#: name -> (out, in) of each of a BERT-base layer's matrices
SHAPES = {
    "query": (768, 768),
    "key": (768, 768),
    "value": (768, 768),
    "attn out": (768, 768),
    "intermediate": (3072, 768),
    "output": (768, 3072),
}


#: method -> lmdx's fast path alone (None where it falls back to the SVDs)
FAST = {
    "tsv_m": lambda taus: tsv_merge_fast(taus, None),
    "iso_c": iso_c_merge_fast,
    "iso_cts": lambda taus: iso_cts_merge_fast(taus, 0.8),
}
#: method -> lmdx's merge of one tensor's float64 task matrices, given the precision
LMDX = {
    "tsv_m": lambda taus, precision: tsv_merge(taus, None, precision),
    "iso_c": lambda taus, precision: iso_c_merge(taus, precision),
    "iso_cts": lambda taus, precision: iso_cts_merge(taus, 0.8, precision),
}


def fusion_bench_method(
    method: str,
) -> tuple[Callable[[list[dict[str, torch.Tensor]]], dict], str]:
    """FusionBench's ``method`` over task-vector state dicts, or the stand-in, and its
    label."""
    try:
        if method == "tsv_m":
            from fusion_bench.method.task_singular_vector.utils.TSVM_utils import (
                compute_and_sum_svd_mem_reduction,
            )

            def merge(tvs: list[dict[str, torch.Tensor]]) -> dict:
                return compute_and_sum_svd_mem_reduction(tvs, accelerator="cpu")
        else:
            from fusion_bench.method.isotropic_merging import iso_utils

            def merge(tvs: list[dict[str, torch.Tensor]]) -> dict:
                if method == "iso_c":
                    return iso_utils.iso_c(tvs, accelerator="cpu")
                return iso_utils.iso_cts(tvs, 0.8, accelerator="cpu")
    except Exception as exc:  # any import failure: say so, use the stand-in
        print(f"fusion_bench does not import ({type(exc).__name__}: {exc})")
        if method != "tsv_m":
            hint = "no stand-in; install fusion-bench (see bench_regmean.py)"
            raise SystemExit(f"{method}: {hint}") from None
        print("stand-in used")
        return torch_svd_tsvm, "stand-in: torch float32 SVD TSV-M (not FusionBench)"

    def run(task_vectors: list[dict[str, torch.Tensor]]) -> dict:
        with contextlib.redirect_stdout(io.StringIO()):
            return merge(task_vectors)

    import fusion_bench

    return run, f"FusionBench {getattr(fusion_bench, '__version__', '0.2.33')}"


def torch_svd_tsvm(task_vectors: list[dict[str, torch.Tensor]]) -> dict:
    """TSV-M by torch float32 SVDs (the stand-in where FusionBench does not import)."""
    out = {}
    for key in task_vectors[0]:
        taus = [tv[key] for tv in task_vectors]
        k = int(min(taus[0].shape) / len(taus))
        parts = [torch.linalg.svd(t, full_matrices=False) for t in taus]
        u = torch.cat([p[0][:, :k] for p in parts], dim=1)
        s = torch.cat([p[1][:k] for p in parts])
        vh = torch.cat([p[2][:k] for p in parts], dim=0)
        pu, _, pv = torch.linalg.svd(u, full_matrices=False)
        qu, _, qv = torch.linalg.svd(vh, full_matrices=False)
        out[key] = (pu @ pv) @ torch.diag(s) @ (qu @ qv)
    return out


def task_vectors(
    layers: int, k: int, noise: float
) -> tuple[dict[str, np.ndarray], dict[str, list[np.ndarray]]]:
    """name -> the base weight, and name -> the K float64 task matrices (seeded)."""
    rng = np.random.default_rng(0)
    bases, out = {}, {}
    for layer in range(layers):
        for name, shape in SHAPES.items():
            base = 0.02 * rng.standard_normal(shape)
            scale = noise * float(base.std())
            bases[f"{layer}.{name}"] = base
            out[f"{layer}.{name}"] = [
                (scale * rng.standard_normal(shape)).astype(np.float32).astype(np.float64)
                for _ in range(k)
            ]
    return bases, out


def input_gram(width: int) -> np.ndarray:
    """A mean Gram ``S`` of correlated inputs of ``width`` features (``4·width`` seeded rows:
    a decaying spectrum and a mean offset, as activations have): the output error's
    yardstick (a data-free method has no statistics of its own)."""
    rng = np.random.default_rng(width)
    mix = np.linalg.qr(rng.standard_normal((width, width)))[0]
    x = (rng.standard_normal((4 * width, width)) / np.sqrt(1.0 + np.arange(width) / 16)) @ mix
    x += 0.3 * rng.standard_normal(width)
    return x.T @ x / x.shape[0]


def errors(
    got: np.ndarray, update: np.ndarray, base: np.ndarray, gram: np.ndarray
) -> tuple[float, float]:
    """The weight error ``max|E| / max|W*|`` and the output error ``‖E‖_S / ‖W*‖_S``
    (``‖A‖²_S = tr(A S Aᵀ)``, ``A`` ``[out, in]``) of the merged weight ``base + got``
    against ``W* = base + update`` (α 1)."""
    e = np.asarray(got, dtype=np.float64) - update
    w = base + update

    def s_norm(a: np.ndarray) -> float:
        return float(np.sqrt(np.einsum("ij,ij->", a @ gram, a)))

    return float(np.abs(e).max() / np.abs(w).max()), s_norm(e) / s_norm(w)


def simd_line() -> str:
    lmdx_cli = shutil.which("lmdx") or str(Path(sys.executable).with_name("lmdx"))
    try:
        info = subprocess.run([lmdx_cli, "info"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"lmdx info failed: {exc}"
    lines = [line.strip() for line in info.stdout.splitlines() if "simd_path" in line]
    return lines[0] if lines else "lmdx info: no simd_path line"


def timed(
    runs: dict[str, Callable[[], object]], reps: int
) -> tuple[dict[str, list[float]], dict[str, object]]:
    """Each run ``reps`` times, alternated, with a pause between runs; the last results."""
    times: dict[str, list[float]] = {name: [] for name in runs}
    results: dict[str, object] = {}
    for _ in range(reps):
        for name, run in runs.items():
            time.sleep(PAUSE_S)
            start = time.perf_counter()
            results[name] = run()
            times[name].append(time.perf_counter() - start)
    return times, results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--method", choices=sorted(LMDX), default="tsv_m")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--k", type=int, default=3)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--noise", type=float, default=0.02)
    args = parser.parse_args()

    torch.set_num_threads(THREADS)
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(THREADS)
        blas = f"NumPy BLAS {THREADS} threads (threadpoolctl)"
    except ImportError:
        blas = "NumPy BLAS threads as set by OPENBLAS_NUM_THREADS (threadpoolctl missing)"
    fb, label = fusion_bench_method(args.method)
    print(simd_line())
    print(f"torch {torch.__version__} {THREADS} threads; {blas}; numpy {np.__version__}")
    print(
        f"{args.method}; baseline: {label}; K = {args.k}, {args.layers} layers, noise {args.noise}"
    )

    floors(args.k)
    bases, taus = task_vectors(args.layers, args.k, args.noise)
    grams = {w: input_gram(w) for w in {shape[1] for shape in SHAPES.values()}}
    tvs = [
        {n: torch.from_numpy(t[i].astype(np.float32)) for n, t in taus.items()}
        for i in range(args.k)
    ]

    merge = LMDX[args.method]

    def runs(names: list[str]) -> dict[str, Callable[[], object]]:
        return {
            "lmdx auto": lambda: {n: merge(taus[n], "auto") for n in names},
            "lmdx float64": lambda: {n: merge(taus[n], "float64") for n in names},
            "baseline": lambda: fb([{n: tv[n] for n in names} for tv in tvs]),
        }

    print("errors: of the merged weight against lmdx's float64 one, the largest over matrices")
    header = f"{'shape':<28}{'run':<14}{'min s':>9}{'median s':>10}{'weight err':>12}"
    print(header + f"{'output err':>12}")
    groups = {f"{name} {SHAPES[name][0]}x{SHAPES[name][1]}": [f"0.{name}"] for name in SHAPES}
    groups[f"whole set ({len(taus)} matrices)"] = list(taus)
    for label_, names in groups.items():
        times, results = timed(runs(names), args.reps)
        reference = results["lmdx float64"]
        for run in times:
            got = results[run]
            worst = np.max(
                [errors(got[n], reference[n], bases[n], grams[bases[n].shape[1]]) for n in names],
                axis=0,
            )
            best, median = min(times[run]), float(np.median(times[run]))
            line = f"{label_:<28}{run:<14}{best:>9.3f}{median:>10.3f}"
            print(line + f"{worst[0]:>12.1e}{worst[1]:>12.1e}")
        fast = sum(FAST[args.method](taus[n]) is not None for n in names)  # untimed
        base = min(times["baseline"])
        print(
            f"{'':<28}lmdx/baseline: auto {min(times['lmdx auto']) / base:.2f}, "
            f"float64 {min(times['lmdx float64']) / base:.2f} (min times); the default's "
            f"precision: Gram path {fast} of {len(names)}, float64 SVDs {len(names) - fast}"
        )


def floors(k: int) -> None:
    """The factorizations' floor at 768²: float64 ``eigh`` of a Gram (NumPy; SciPy's top
    ``768/K`` alone) against torch's float32 SVD, 2 threads, min of 3."""
    rng = np.random.default_rng(1)
    a = rng.standard_normal((768, 768))
    gram = a.T @ a
    top = [768 - 768 // k, 767]
    ta = torch.from_numpy(a.astype(np.float32))
    cases = {
        "NumPy float64 eigh, all": lambda: np.linalg.eigh(gram),
        f"SciPy float64 eigh, top {768 // k}": lambda: scipy.linalg.eigh(
            gram, subset_by_index=top, driver="evr"
        ),
        "NumPy float64 SVD": lambda: np.linalg.svd(a, full_matrices=False),
        "torch float32 SVD": lambda: torch.linalg.svd(ta, full_matrices=False),
    }
    print("floor at 768x768 (min of 3): ", end="")
    parts = []
    for name, run in cases.items():
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            run()
            best = min(best, time.perf_counter() - start)
        parts.append(f"{name} {1e3 * best:.0f} ms")
    print("; ".join(parts))


if __name__ == "__main__":
    main()
