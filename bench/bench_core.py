"""lmdx's two kernels against the alternatives, on the same data, in one process.

1. Gram accumulation ``G = XᵀX`` of float32 rows: ``lmdx.Moments.update`` (float32
   products, float64 statistics) vs torch fp32 ``X.T @ X``, NumPy fp32 ``X.T @ X``, SciPy
   BLAS ``ssyrk`` (fp32) and ``dsyrk`` (fp64, on a float64 copy of X made untimed).
2. Regularized SPD solve ``A x = B`` in float64 with k = d right-hand sides:
   ``lmdx.spd_solve`` vs ``scipy.linalg.cho_factor + cho_solve`` and
   ``torch.linalg.cholesky + torch.cholesky_solve``.
3. RegMean merge of one d x d linear layer of K = 3 models (α = 0.9):
   ``lmdx.regmean_merge_layer`` vs FusionBench's ``merging_with_regmean_weights`` (fp32,
   explicit inverse) and the time torch's fp64 GEMM needs for the same flop count (the
   "GEMM bound": the merge is GEMMs plus a Cholesky, so this is the time to compare with).

``--paths avx2 baseline`` adds rows for lmdx's other SIMD dispatch paths (the raw core
module of each), run on the same inputs in the same process.

Every method runs at each thread count on identical inputs; its result is checked against
a float64 reference (the run aborts if one disagrees); the table gives the median time,
GFLOP/s, the fraction of this machine's measured FMA peak and lmdx's speedup over it.
See bench/README.md for the conventions and the exact commands.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import lmdx
import numpy as np
import scipy
import scipy.linalg
import threadpoolctl
from lmdx._core import core as lmdx_core
from lmdx._core import load as lmdx_load_core
from lmdx._core import supported_variants as lmdx_supported_paths
from lmdx.moments import DEFAULT_CHUNK_ROWS
from scipy.linalg import blas as scipy_blas

try:
    import torch
except ImportError:  # torch is the strongest alternative, but optional for lmdx itself
    torch = None

GRAM_SIZES = (768, 1024, 3072, 4096)
GRAM_ROWS = (4096, 32768)
SOLVE_SIZES = (768, 3072, 4096)
THREADS = (1, 2)
REPS = 5
PEAK_SECONDS = 0.5

QUICK_GRAM_SIZES = (64, 256)
QUICK_GRAM_ROWS = (2048, 8192)
QUICK_SOLVE_SIZES = (64, 256)
QUICK_REPS = 3
QUICK_PEAK_SECONDS = 0.2

# Agreement with the float64 reference (relative Frobenius norm of the difference).
TOL_GRAM_FP32 = 1e-5  # fp32 products and fp32 accumulation (torch, NumPy, ssyrk)
TOL_GRAM_LMDX = 1e-6  # fp32 products in chunks, fp64 accumulation (DESIGN.md bound)
TOL_GRAM_FP64 = 1e-12  # dsyrk
TOL_SOLVE_DIFF = 1e-8  # ‖x - x_scipy‖_F / ‖x_scipy‖_F
TOL_SOLVE_RESIDUAL = 1e-10  # ‖A x - B‖_F / (‖A‖_F ‖x‖_F + ‖B‖_F)
TOL_MERGE_LMDX = 1e-8  # ‖W - W_ref‖_F / ‖W_ref‖_F, float64 solve
TOL_MERGE_FP32 = 1e-3  # FusionBench: fp32 Grams, explicit fp32 inverse

MERGE_SIZES = (768, 1024, 3072, 4096)
QUICK_MERGE_SIZES = (64, 256)
MERGE_MODELS = 3
MERGE_ALPHA = 0.9

ENV_VARS = (
    "OPENBLAS_CORETYPE",
    "OPENBLAS_L2_SIZE",
    "OPENBLAS_NUM_THREADS",
    "OMP_NUM_THREADS",
    "OMP_WAIT_POLICY",
    "MKL_NUM_THREADS",
    "MKL_ENABLE_INSTRUCTIONS",
    "LMDX_SIMD",
    "LMDX_NUM_THREADS",
)

CONVENTIONS = (
    "Gram flops: N·d·(d+1), the useful work of the symmetric rank-N update (d(d+1)/2 "
    "entries x 2N); a full GEMM X.T @ X does 2·N·d² but is credited only N·d·(d+1).",
    "Solve flops: d³/3 (Cholesky) + 2·d²·k (two triangular solves), k = d right-hand sides.",
    "Merge flops (one d x d layer, K = 3 models): 2·K·d³ (Σ G̃_i W_iᵀ) + d³/3 + 2·d³ (Cholesky "
    "and solves); every merge method is credited these. 'GEMM bound' runs torch fp64 "
    "matmuls of exactly that many flops: its time is what the merge would take at the "
    "GEMM rate this machine achieves (goal: lmdx within 1.3x of it).",
    "Time: median of --reps timed calls after one untimed warm-up, same input for every "
    "method. lmdx Gram time covers Moments(d) (allocating the fp64 accumulator) + update(X); "
    "gram() readout is not timed.",
    "% peak: GFLOP/s over the FMA peak measured by lmdx for the same thread count on its "
    "selected SIMD path (fp32 peak for fp32-product methods, lmdx Gram included; fp64 peak "
    "for dsyrk and the solves).",
    "lmdx speedup = median time of the method / median time of lmdx (> 1: lmdx is faster).",
    "Gram check: ‖G - G_ref‖_F / ‖G_ref‖_F against a float64 XᵀX summed by GEMM over row "
    f"blocks of 1024 (lower triangle for syrk); tolerance {TOL_GRAM_FP32:g} fp32, "
    f"{TOL_GRAM_LMDX:g} lmdx, {TOL_GRAM_FP64:g} "
    "fp64. max dev = max|G - G_ref| / max|G_ref|.",
    f"Solve check: ‖x - x_ref‖_F / ‖x_ref‖_F ≤ {TOL_SOLVE_DIFF:g} with x_ref from SciPy "
    f"cho_factor/cho_solve (untimed run), and residual ‖Ax - B‖_F / (‖A‖_F‖x‖_F + ‖B‖_F) "
    f"≤ {TOL_SOLVE_RESIDUAL:g}.",
)


class DisagreementError(RuntimeError):
    """A method's result is outside the stated tolerance of the reference."""


@dataclass
class Method:
    """One way of computing the benchmarked quantity."""

    name: str
    precision: str  # "fp32" or "fp64": which measured peak the rate is compared with
    library: str  # "lmdx", "torch" or "blas": how its thread count is set
    call: Callable[[int], Any]  # n_threads -> result
    tol: float


@dataclass
class Row:
    bench: str
    d: int
    n: int  # Gram: rows N; solve: right-hand sides k
    threads: int
    method: str
    precision: str
    times_s: list[float]
    median_s: float
    gflops: float
    pct_peak: float
    speedup: float = float("nan")
    error: float = float("nan")  # Gram: rel. Frobenius; solve: rel. difference vs reference
    error2: float = float("nan")  # Gram: max dev; solve: relative residual
    tol: float = float("nan")


# --------------------------------------------------------------------------- environment


def cpu_model() -> dict[str, Any]:
    info: dict[str, Any] = {"machine": platform.machine()}
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return info
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key, value = key.strip(), value.strip()
        if key and key not in fields:
            fields[key] = value
    info["model_name"] = fields.get("model name", "?")
    info["logical_cpus"] = text.count("processor\t:")
    info["cores"] = fields.get("cpu cores", "?")
    info["cache_size"] = fields.get("cache size", "?")
    info["mhz"] = fields.get("cpu MHz", "?")
    flags = set(fields.get("flags", "").split())
    wanted = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_bf16")
    info["simd_flags"] = [f for f in wanted if f in flags]
    info["virtualized"] = "hypervisor" in flags
    return info


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def blas_info() -> list[dict[str, Any]]:
    """BLAS libraries loaded in this process (threadpoolctl), with who loaded them."""
    out = []
    for lib in threadpoolctl.threadpool_info():
        if lib.get("user_api") != "blas":
            continue
        path = lib.get("filepath", "")
        out.append(
            {
                "loaded_from": os.path.basename(os.path.dirname(path)),
                "file": os.path.basename(path),
                "internal_api": lib.get("internal_api"),
                "version": lib.get("version"),
                "architecture": lib.get("architecture"),
                "threading_layer": lib.get("threading_layer"),
                "num_threads": lib.get("num_threads"),
            }
        )
    return out


def build_blas(module: Any) -> str:
    """The BLAS a package was built against, from its show_config (NumPy/SciPy >= 1.25)."""
    try:
        deps = module.show_config(mode="dicts")["Build Dependencies"]["blas"]
    except Exception:  # older versions print instead of returning a dict
        return "?"
    return f"{deps.get('name', '?')} {deps.get('version', '?')}"


def torch_info() -> dict[str, Any]:
    if torch is None:
        return {"available": False}
    shown = torch.__config__.show()
    blas = next(
        (p.split("=", 1)[1] for p in shown.replace(",", " ").split() if p.startswith("BLAS_INFO=")),
        "?",
    )
    mkl = next((line.strip(" -") for line in shown.splitlines() if "Math Kernel" in line), None)
    return {
        "available": True,
        "version": torch.__version__,
        "blas": blas,
        "mkl": mkl,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "default_threads": torch.get_num_threads(),
    }


def measure_peaks(threads: Sequence[int], seconds: float) -> dict[int, dict[str, float]]:
    """Best of three FMA-loop measurements per precision and thread count."""
    peaks = {}
    for t in threads:
        peaks[t] = {
            prec: max(
                lmdx_core.measure_peak_gflops(
                    double_precision=prec == "fp64", n_threads=t, seconds=seconds
                )
                for _ in range(3)
            )
            for prec in ("fp32", "fp64")
        }
    return peaks


def collect_meta(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "cpu": cpu_model(),
        "available_cpus": available_cpus(),
        "load_average": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "env": {name: os.environ.get(name) for name in ENV_VARS},
        "lmdx": lmdx.config(),
        "python": platform.python_version(),
        "numpy": {"version": np.__version__, "built_with": build_blas(np)},
        "scipy": {"version": scipy.__version__, "built_with": build_blas(scipy)},
        "threadpoolctl": threadpoolctl.__version__,
        "blas_loaded": blas_info(),
        "torch": torch_info(),
        "settings": {
            "gram_sizes": args.sizes,
            "gram_rows": args.rows,
            "solve_sizes": args.solve_sizes,
            "merge_sizes": args.merge_sizes,
            "paths": args.paths,
            "threads": args.threads,
            "reps": args.reps,
            "lmdx_chunk_rows": DEFAULT_CHUNK_ROWS,
            "seed": args.seed,
        },
    }


def header_lines(meta: dict[str, Any], peaks: dict[int, dict[str, float]]) -> list[str]:
    cpu = meta["cpu"]
    lm = meta["lmdx"]
    lines = [
        f"date: {meta['date']}",
        f"command: {meta['command']}",
        f"cpu: {cpu.get('model_name', '?')} ({cpu.get('machine')}), "
        f"{cpu.get('logical_cpus', '?')} logical CPUs ({cpu.get('cores', '?')} cores/socket), "
        f"{meta['available_cpus']} available, virtualized {cpu.get('virtualized', '?')}, "
        f"cache {cpu.get('cache_size', '?')}, SIMD flags {' '.join(cpu.get('simd_flags', []))}",
        f"load average at start: {meta['load_average']}",
        f"lmdx {lm['version']}: SIMD path {lm['simd_path']} (forced: {lm['simd_forced']}; "
        f"built {','.join(lm['built_paths'])}; supported {','.join(lm['supported_paths'])}), "
        f"OpenMP {lm['openmp']}, default threads {lm['default_threads']}, "
        f"Eigen {lm['eigen']} [{lm['eigen_simd']}], {lm['compiler']}, "
        f"Moments chunk_rows {meta['settings']['lmdx_chunk_rows']}",
        f"python {meta['python']}, numpy {meta['numpy']['version']} "
        f"(built with {meta['numpy']['built_with']}), scipy {meta['scipy']['version']} "
        f"(built with {meta['scipy']['built_with']}), threadpoolctl {meta['threadpoolctl']}",
    ]
    for lib in meta["blas_loaded"]:
        lines.append(
            f"BLAS loaded from {lib['loaded_from']}/{lib['file']}: {lib['internal_api']} "
            f"{lib['version']}, architecture {lib['architecture']}, "
            f"threading {lib['threading_layer']}"
        )
    ti = meta["torch"]
    if ti["available"]:
        lines.append(
            f"torch {ti['version']}: BLAS {ti['blas']} ({ti['mkl'] or 'no MKL'}), "
            f"CPU capability {ti['cpu_capability']}"
        )
    else:
        lines.append("torch: not installed, torch methods skipped")
    env = ", ".join(f"{k}={v if v is not None else '<unset>'}" for k, v in meta["env"].items())
    lines.append(f"environment: {env}")
    for t, p in peaks.items():
        lines.append(
            f"measured FMA peak, {t} thread(s), lmdx {lm['simd_path']} path: "
            f"fp32 {p['fp32']:.1f} GFLOP/s, fp64 {p['fp64']:.1f} GFLOP/s"
        )
    return lines


# ------------------------------------------------------------------------------ timing


@contextlib.contextmanager
def thread_limit(library: str, n_threads: int) -> Iterator[None]:
    """Limit the threads of ``library`` (lmdx takes n_threads per call)."""
    if library == "torch":
        previous = torch.get_num_threads()
        torch.set_num_threads(n_threads)
        try:
            yield
        finally:
            torch.set_num_threads(previous)
    elif library == "blas":
        # user_api="blas" limits NumPy's and SciPy's OpenBLAS only, not the OpenMP runtimes
        # that lmdx and torch use.
        with threadpoolctl.threadpool_limits(limits=n_threads, user_api="blas"):
            yield
    else:
        yield


def time_method(
    method: Method, n_threads: int, reps: int, settle_s: float
) -> tuple[Any, list[float]]:
    """One untimed warm-up, then ``reps`` timed calls; returns the last result and times."""
    # Idle worker threads of the previous library (OpenBLAS spins ~0.1 s after a call)
    # would otherwise compete with this one's warm-up for the same cores.
    time.sleep(settle_s)
    times: list[float] = []
    with thread_limit(method.library, n_threads):
        result = method.call(n_threads)
        for _ in range(reps):
            start = time.perf_counter()
            result = method.call(n_threads)
            times.append(time.perf_counter() - start)
    return result, times


def make_row(
    bench: str,
    d: int,
    n: int,
    t: int,
    method: Method,
    times: list[float],
    flops: float,
    peaks: dict[int, dict[str, float]],
) -> Row:
    median = statistics.median(times)
    gflops = flops / median * 1e-9
    return Row(
        bench=bench,
        d=d,
        n=n,
        threads=t,
        method=method.name,
        precision=method.precision,
        times_s=times,
        median_s=median,
        gflops=gflops,
        pct_peak=100.0 * gflops / peaks[t][method.precision],
        tol=method.tol,
    )


def set_speedups(rows: list[Row]) -> None:
    lmdx_time = next(r.median_s for r in rows if r.method.startswith("lmdx"))
    for r in rows:
        r.speedup = r.median_s / lmdx_time


def run_case(
    bench: str,
    shape: tuple[int, int, int],
    methods: Sequence[Method],
    flops: float,
    args: argparse.Namespace,
    peaks: dict[int, dict[str, float]],
    check: Callable[[Method, Any, Row], None],
) -> list[Row]:
    """Time every method at one (d, n, threads); ``check(method, result, row)`` fills the
    row's agreement columns and raises DisagreementError when the result is off."""
    d, n, t = shape
    case: list[Row] = []
    for method in methods:
        result, times = time_method(method, t, args.reps, args.settle)
        row = make_row(bench, d, n, t, method, times, flops, peaks)
        check(method, result, row)
        del result
        case.append(row)
    set_speedups(case)
    return case


# -------------------------------------------------------------------------------- Gram


def path_cores(paths: Sequence[str]) -> list[tuple[str, Any]]:
    """(label, raw core module) for each extra dispatch path asked for."""
    selected = lmdx.config()["simd_path"]
    return [(p, lmdx_load_core(p)) for p in paths if p != selected]


def gram_methods(
    x32: np.ndarray, x64: np.ndarray, cores: Sequence[tuple[str, Any]] = ()
) -> list[Method]:
    d = x32.shape[1]
    # BLAS is column-major: the C-contiguous (N, d) array X is, without a copy, the
    # Fortran-contiguous (d, N) array X.T. So ?syrk gets a = X.T with trans=0 and computes
    # a·aᵀ = XᵀX. Passing X itself with trans=1 is the same product, but f2py first copies
    # the C-ordered X into Fortran order (N·d elements, inside the timed call), which no
    # caller needs to pay. lower=1: the lower triangle of the (Fortran-ordered) result.
    x32_f, x64_f = x32.T, x64.T
    methods = [
        Method(
            "lmdx Moments.update",
            "fp32",
            "lmdx",
            lambda t: lmdx.Moments(d).update(x32, n_threads=t),
            TOL_GRAM_LMDX,
        ),
    ]
    for label, mod in cores:
        methods.append(
            Method(
                f"lmdx[{label}] Moments.update",
                "fp32",
                "lmdx",
                lambda t, mod=mod: _raw_update(mod, x32, t),
                TOL_GRAM_LMDX,
            )
        )
    if torch is not None:
        xt = torch.from_numpy(x32)  # shares memory with x32
        methods.append(Method("torch X.T@X", "fp32", "torch", lambda t: xt.T @ xt, TOL_GRAM_FP32))
    methods += [
        # NumPy's matmul itself recognises aᵀa and calls ?syrk, then mirrors the triangle.
        Method("numpy X.T@X", "fp32", "blas", lambda t: x32.T @ x32, TOL_GRAM_FP32),
        Method(
            "scipy ssyrk",
            "fp32",
            "blas",
            lambda t: scipy_blas.ssyrk(1.0, x32_f, trans=0, lower=1),
            TOL_GRAM_FP32,
        ),
        Method(
            "scipy dsyrk (fp64 X)",
            "fp64",
            "blas",
            lambda t: scipy_blas.dsyrk(1.0, x64_f, trans=0, lower=1),
            TOL_GRAM_FP64,
        ),
    ]
    return methods


def _raw_update(mod: Any, x32: np.ndarray, t: int) -> Any:
    m = mod.Moments(dim=x32.shape[1], chunk_rows=DEFAULT_CHUNK_ROWS)
    m.update(x=x32, weights=None, n_threads=t, bfloat16=False)
    return m


def gram_result(method: Method, result: Any) -> tuple[np.ndarray, bool]:
    """The method's Gram as an ndarray and whether only its lower triangle is valid."""
    if method.library == "lmdx":
        return np.asarray(result.gram()), False
    if method.library == "torch":
        return result.numpy(), False
    return np.asarray(result), "syrk" in method.name


def reference_gram(x64: np.ndarray, block: int = 1024) -> np.ndarray:
    """Float64 XᵀX (untimed) by a different route than the methods: row blocks, each a GEMM
    of a transposed block with a copy of itself (NumPy only turns aᵀa on one buffer into
    ?syrk), so the summation order differs from dsyrk's."""
    ref = np.zeros((x64.shape[1], x64.shape[1]))
    for r in range(0, x64.shape[0], block):
        xb = x64[r : r + block]
        ref += xb.T @ xb.copy()
    return ref


def gram_errors(g: np.ndarray, ref: np.ndarray, lower_only: bool) -> tuple[float, float]:
    diff = g.astype(np.float64) - ref
    ref_part = ref
    if lower_only:
        diff = np.tril(diff)
        ref_part = np.tril(ref)
    rel_frob = float(np.linalg.norm(diff) / np.linalg.norm(ref_part))
    max_dev = float(np.abs(diff).max() / np.abs(ref_part).max())
    return rel_frob, max_dev


def check_gram(ref: np.ndarray, method: Method, result: Any, row: Row) -> None:
    g, lower_only = gram_result(method, result)
    row.error, row.error2 = gram_errors(g, ref, lower_only)
    if not row.error <= method.tol:
        raise DisagreementError(
            f"Gram d={row.d} N={row.n} threads={row.threads}: {method.name} differs from the "
            f"float64 reference by {row.error:.3g} (relative Frobenius), tolerance "
            f"{method.tol:g}"
        )


def bench_gram(
    args: argparse.Namespace, peaks: dict[int, dict[str, float]], log: Callable[[str], None]
) -> list[Row]:
    rng = np.random.default_rng(args.seed)
    rows_out: list[Row] = []
    n_max = max(args.rows)
    for d in args.sizes:
        # One draw per d; the first N rows of it (a contiguous view) for each N.
        x32_all = rng.standard_normal((n_max, d), dtype=np.float32)
        x64_all = x32_all.astype(np.float64)
        for n in args.rows:
            x32, x64 = x32_all[:n], x64_all[:n]
            ref = reference_gram(x64)
            flops = float(n) * d * (d + 1)
            methods = gram_methods(x32, x64, path_cores(args.paths))
            check = functools.partial(check_gram, ref)
            for t in args.threads:
                case = run_case("gram", (d, n, t), methods, flops, args, peaks, check)
                for row in case:
                    log(format_row(row))
                rows_out += case
            del ref
        del x32_all, x64_all
    return rows_out


# ------------------------------------------------------------------------------- solve


def solve_methods(
    a: np.ndarray, b: np.ndarray, cores: Sequence[tuple[str, Any]] = ()
) -> list[Method]:
    def lmdx_solve(t: int) -> np.ndarray:
        x, info = lmdx.spd_solve(a, b, n_threads=t)
        if info.escalated:
            raise DisagreementError("lmdx.spd_solve had to regularize a well-conditioned system")
        return np.asarray(x)

    def raw_solve(mod: Any, t: int) -> np.ndarray:
        x, _ = mod.spd_solve(
            a=a, b=b, alpha=1.0, ridge=0.0, allow_regularization=False, name="system", n_threads=t
        )
        return np.asarray(x)

    def scipy_solve(t: int) -> np.ndarray:
        factor = scipy.linalg.cho_factor(a, lower=True)
        return scipy.linalg.cho_solve(factor, b)

    methods = [
        Method("lmdx spd_solve", "fp64", "lmdx", lmdx_solve, TOL_SOLVE_DIFF),
    ]
    methods += [
        Method(
            f"lmdx[{label}] spd_solve",
            "fp64",
            "lmdx",
            lambda t, mod=mod: raw_solve(mod, t),
            TOL_SOLVE_DIFF,
        )
        for label, mod in cores
    ]
    methods.append(
        Method("scipy cho_factor+cho_solve", "fp64", "blas", scipy_solve, TOL_SOLVE_DIFF)
    )
    if torch is not None:
        at, bt = torch.from_numpy(a), torch.from_numpy(b)

        def torch_solve(t: int) -> np.ndarray:
            return torch.cholesky_solve(bt, torch.linalg.cholesky(at)).numpy()

        methods.append(
            Method("torch cholesky+cholesky_solve", "fp64", "torch", torch_solve, TOL_SOLVE_DIFF)
        )
    return methods


def check_solve(
    a: np.ndarray, b: np.ndarray, x_ref: np.ndarray, method: Method, sol: Any, row: Row
) -> None:
    row.error = float(np.linalg.norm(sol - x_ref) / np.linalg.norm(x_ref))
    row.error2 = float(
        np.linalg.norm(a @ sol - b) / (np.linalg.norm(a) * np.linalg.norm(sol) + np.linalg.norm(b))
    )
    if not (row.error <= TOL_SOLVE_DIFF and row.error2 <= TOL_SOLVE_RESIDUAL):
        raise DisagreementError(
            f"solve d={row.d} k={row.n} threads={row.threads}: {method.name} relative "
            f"difference {row.error:.3g} (tolerance {TOL_SOLVE_DIFF:g}), relative residual "
            f"{row.error2:.3g} (tolerance {TOL_SOLVE_RESIDUAL:g})"
        )


def bench_solve(
    args: argparse.Namespace, peaks: dict[int, dict[str, float]], log: Callable[[str], None]
) -> list[Row]:
    rng = np.random.default_rng(args.seed + 1)
    rows_out: list[Row] = []
    for d in args.solve_sizes:
        k = d
        # A = XᵀX/m + I with m = 2d Gaussian rows: eigenvalues in about [1.09, 3.9].
        m = 2 * d
        x = rng.standard_normal((m, d))
        a = x.T @ x / m + np.eye(d)
        del x
        b = rng.standard_normal((d, k))
        x_ref = scipy.linalg.cho_solve(scipy.linalg.cho_factor(a, lower=True), b)
        flops = d**3 / 3.0 + 2.0 * d * d * k
        methods = solve_methods(a, b, path_cores(args.paths))
        check = functools.partial(check_solve, a, b, x_ref)
        for t in args.threads:
            case = run_case("solve", (d, k, t), methods, flops, args, peaks, check)
            for row in case:
                log(format_row(row))
            rows_out += case
    return rows_out


# ------------------------------------------------------------------------------- merge


def merge_inputs(
    rng: np.random.Generator, d: int
) -> tuple[list[np.ndarray], list[float], list[np.ndarray]]:
    """K Grams of 2d Gaussian rows with per-feature scales (float64), their counts, and K
    float32 weights (d_out = d_in = d)."""
    grams, counts, weights = [], [], []
    for _ in range(MERGE_MODELS):
        x = rng.standard_normal((2 * d, d), dtype=np.float32) * rng.uniform(0.5, 2.0, d).astype(
            np.float32
        )
        grams.append(x.T.astype(np.float64) @ x.astype(np.float64))
        counts.append(float(2 * d))
        weights.append(rng.standard_normal((d, d), dtype=np.float32))
    return grams, counts, weights


def reference_merge(
    grams: list[np.ndarray], counts: list[float], weights: list[np.ndarray], alpha: float
) -> np.ndarray:
    """Jin et al. (2023) in float64: (Σ G̃_i)⁻¹ Σ G̃_i W_iᵀ with G̃ = α Ĝ + (1−α) diag(Ĝ)."""
    lhs = 0.0
    rhs = 0.0
    for g, n, w in zip(grams, counts, weights, strict=True):
        g_hat = g / n
        g_tilde = alpha * g_hat + (1.0 - alpha) * np.diag(np.diag(g_hat))
        lhs = lhs + g_tilde
        rhs = rhs + g_tilde @ w.astype(np.float64).T
    return scipy.linalg.solve(lhs, rhs, assume_a="pos").T


def merge_methods(
    grams: list[np.ndarray],
    counts: list[float],
    weights: list[np.ndarray],
    cores: Sequence[tuple[str, Any]] = (),
) -> list[Method]:
    alpha = MERGE_ALPHA
    methods = [
        Method(
            "lmdx regmean_merge_layer",
            "fp64",
            "lmdx",
            lambda t: (
                lmdx.regmean_merge_layer(grams, weights, counts, alpha=alpha, n_threads=t).weight
            ),
            TOL_MERGE_LMDX,
        )
    ]
    methods += [
        Method(
            f"lmdx[{label}] regmean_merge_layer",
            "fp64",
            "lmdx",
            lambda t, mod=mod: mod.regmean_merge_layer(
                grams=grams,
                weights=weights,
                counts=counts,
                alpha=alpha,
                coefficients=None,
                layout="linear",
                precision="float64",
                noise_floor=0.0,
                ridge=0.0,
                allow_regularization=True,
                name="layer",
                n_threads=t,
            )[0],
            TOL_MERGE_LMDX,
        )
        for label, mod in cores
    ]
    if torch is None:
        return methods
    try:
        from fusion_bench.method.regmean.regmean import merging_with_regmean_weights
    except ImportError:
        merging_with_regmean_weights = None
    if merging_with_regmean_weights is not None:
        # FusionBench keeps Ĝ_i = G_i / n_i ("regmean weights") and the weights as fp32
        # tensors; converted before timing.
        fb_params = {"layer.weight": [torch.from_numpy(w) for w in weights]}
        fb_grams = [
            {"layer": torch.from_numpy((g / n).astype(np.float32))}
            for g, n in zip(grams, counts, strict=True)
        ]

        def fusionbench(t: int) -> np.ndarray:
            with torch.no_grad():
                out = merging_with_regmean_weights(
                    models_to_merge_param_dict=fb_params,
                    models_to_merge_regmean_weights_list=fb_grams,
                    reduce_non_diagonal_ratio=alpha,
                )
            return out["layer.weight"].numpy()

        methods.append(
            Method("fusionbench regmean (fp32)", "fp32", "torch", fusionbench, TOL_MERGE_FP32)
        )
    d = grams[0].shape[0]
    g_t = torch.from_numpy(grams[0])
    w_t = torch.from_numpy(weights[0].astype(np.float64)).T.contiguous()
    w_sixth = w_t[:, : max(1, d // 6)].contiguous()

    def gemm_bound(t: int) -> None:
        # (K + 1) GEMMs d x d x d (2(K+1)d³ flops) + one of d x d x d/6 (≈ d³/3 flops).
        for _ in range(MERGE_MODELS + 1):
            g_t @ w_t
        g_t @ w_sixth

    methods.append(Method("GEMM bound (torch fp64)", "fp64", "torch", gemm_bound, float("nan")))
    return methods


def check_merge(ref: np.ndarray, method: Method, result: Any, row: Row) -> None:
    if result is None:  # the GEMM bound computes no merge
        return
    row.error = float(np.linalg.norm(np.asarray(result) - ref) / np.linalg.norm(ref))
    if not row.error <= method.tol:
        raise DisagreementError(
            f"merge d={row.d} threads={row.threads}: {method.name} differs from the float64 "
            f"formula by {row.error:.3g} (relative Frobenius), tolerance {method.tol:g}"
        )


def bench_merge(
    args: argparse.Namespace, peaks: dict[int, dict[str, float]], log: Callable[[str], None]
) -> list[Row]:
    rng = np.random.default_rng(args.seed + 2)
    rows_out: list[Row] = []
    for d in args.merge_sizes:
        grams, counts, weights = merge_inputs(rng, d)
        ref = reference_merge(grams, counts, weights, MERGE_ALPHA)
        k = MERGE_MODELS
        flops = 2.0 * k * d**3 + d**3 / 3.0 + 2.0 * d**3
        methods = merge_methods(grams, counts, weights, path_cores(args.paths))
        check = functools.partial(check_merge, ref)
        for t in args.threads:
            case = run_case("merge", (d, k, t), methods, flops, args, peaks, check)
            bound = next(r for r in case if r.method.startswith("GEMM bound")) if torch else None
            for row in case:
                if bound is not None:
                    row.error2 = row.median_s / bound.median_s
                log(format_row(row))
            rows_out += case
        del grams, weights, ref
    return rows_out


# ------------------------------------------------------------------------------ output

TABLE_HEAD = {
    "gram": (
        "    d      N thr  method                         prec   median ms    GFLOP/s  %peak"
        "  lmdx speedup  rel.err(F)  max dev"
    ),
    "solve": (
        "    d      k thr  method                         prec   median ms    GFLOP/s  %peak"
        "  lmdx speedup  rel.diff    residual"
    ),
    "merge": (
        "    d      K thr  method                         prec   median ms    GFLOP/s  %peak"
        "  lmdx speedup  rel.err(F)  x GEMM bound"
    ),
}


def format_row(r: Row) -> str:
    speedup = "—" if r.method.startswith("lmdx") else f"{r.speedup:.2f}x"
    return (
        f"{r.d:5d} {r.n:6d} {r.threads:3d}  {r.method:<30s} {r.precision:<5s}"
        f"{r.median_s * 1e3:11.2f} {r.gflops:10.1f} {r.pct_peak:6.1f}"
        f"  {speedup:>12s}  {r.error:9.2e}  {r.error2:9.2e}"
    )


def agreement_summary(bench: str, rows: list[Row]) -> str:
    """The largest deviation from the reference per method, all within tolerance."""
    worst: dict[str, Row] = {}
    for r in rows:
        if np.isnan(r.tol):
            continue  # the GEMM bound computes no merge
        if r.method not in worst or r.error > worst[r.method].error:
            worst[r.method] = r
    what = "rel. difference" if bench == "solve" else "rel. Frobenius error vs fp64 reference"
    parts = [f"{m} {r.error:.2e} (tol {r.tol:g})" for m, r in worst.items()]
    return f"agreement, max {what} over all cases: " + "; ".join(parts) + " — all within"


MD_HEAD = {
    "gram": "| d | N | threads | method | prec | median ms | GFLOP/s | % peak | lmdx speedup "
    "| rel. err (F) | max dev |",
    "solve": "| d | k | threads | method | prec | median ms | GFLOP/s | % peak | lmdx speedup "
    "| rel. diff | residual |",
    "merge": "| d | K | threads | method | prec | median ms | GFLOP/s | % peak | lmdx speedup "
    "| rel. err (F) | time / GEMM bound |",
}


def markdown_row(r: Row) -> str:
    speedup = "—" if r.method.startswith("lmdx") else f"{r.speedup:.2f}x"
    method = f"**{r.method}**" if r.method.startswith("lmdx") else r.method
    return (
        f"| {r.d} | {r.n} | {r.threads} | {method} | {r.precision} | {r.median_s * 1e3:.2f} "
        f"| {r.gflops:.1f} | {r.pct_peak:.1f} | {speedup} | {r.error:.1e} | {r.error2:.1e} |"
    )


def write_markdown(path: str, header: list[str], results: dict[str, list[Row]]) -> None:
    titles = {
        "gram": "Gram accumulation XᵀX (float32 rows)",
        "solve": "SPD solve A x = B (float64, k = d)",
        "merge": "RegMean merge of one d x d layer, K = 3, α = 0.9",
    }
    lines = ["### Machine and libraries", ""]
    lines += [f"- {line}" for line in header]
    lines += ["", "### Conventions", ""]
    lines += [f"- {c}" for c in CONVENTIONS]
    for bench, rows in results.items():
        if not rows:
            continue
        lines += ["", f"### {titles[bench]}", "", MD_HEAD[bench]]
        lines.append("|" + "---|" * (MD_HEAD[bench].count("|") - 1))
        lines += [markdown_row(r) for r in rows]
        lines += ["", agreement_summary(bench, rows)]
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


# -------------------------------------------------------------------------------- main


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Benchmark lmdx's Gram accumulation, SPD solve and RegMean merge against "
        "torch, NumPy, SciPy and FusionBench on the same inputs, with ratios and fraction of "
        "machine peak."
    )
    p.add_argument("--only", choices=("gram", "solve", "merge"), help="run one benchmark only")
    p.add_argument("--sizes", type=int, nargs="+", help=f"Gram dims d (default {GRAM_SIZES})")
    p.add_argument("--rows", type=int, nargs="+", help=f"Gram rows N (default {GRAM_ROWS})")
    p.add_argument(
        "--solve-sizes",
        type=int,
        nargs="+",
        help=f"solve dims d = k (default: --sizes if given, else {SOLVE_SIZES})",
    )
    p.add_argument(
        "--merge-sizes",
        type=int,
        nargs="+",
        help=f"merge layer dims d (default: --sizes if given, else {MERGE_SIZES})",
    )
    p.add_argument(
        "--paths",
        nargs="+",
        default=[],
        choices=("avx512", "avx2", "baseline"),
        help="also run lmdx's other SIMD dispatch paths (raw core modules) on the same inputs",
    )
    p.add_argument("--threads", type=int, nargs="+", help=f"thread counts (default {THREADS})")
    p.add_argument("--reps", type=int, help=f"timed repetitions after a warm-up (default {REPS})")
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"smoke test: d {QUICK_GRAM_SIZES}, N {QUICK_GRAM_ROWS}, solve d "
        f"{QUICK_SOLVE_SIZES}, {QUICK_REPS} reps (explicit options still override)",
    )
    p.add_argument("--peak-seconds", type=float, help="seconds per peak measurement")
    p.add_argument("--settle", type=float, default=0.2, help="pause before each method (s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--markdown", metavar="FILE", help="also write the report as markdown")
    p.add_argument("--json", metavar="FILE", help="also write all raw numbers as JSON")
    args = p.parse_args(argv)
    solve_default = QUICK_SOLVE_SIZES if args.quick else SOLVE_SIZES
    args.solve_sizes = args.solve_sizes or args.sizes or list(solve_default)
    merge_default = QUICK_MERGE_SIZES if args.quick else MERGE_SIZES
    args.merge_sizes = args.merge_sizes or args.sizes or list(merge_default)
    args.sizes = args.sizes or list(QUICK_GRAM_SIZES if args.quick else GRAM_SIZES)
    args.rows = args.rows or list(QUICK_GRAM_ROWS if args.quick else GRAM_ROWS)
    args.threads = args.threads or list(THREADS)
    args.reps = args.reps or (QUICK_REPS if args.quick else REPS)
    args.peak_seconds = args.peak_seconds or (QUICK_PEAK_SECONDS if args.quick else PEAK_SECONDS)
    unsupported = [p for p in args.paths if p not in lmdx_supported_paths()]
    if unsupported:
        p.error(f"--paths: {', '.join(unsupported)} cannot run on this CPU/installation")
    for name in ("sizes", "rows", "solve_sizes", "merge_sizes", "threads"):
        if min(getattr(args, name)) < 1:
            p.error(f"--{name.replace('_', '-')}: values must be >= 1")
    if args.reps < 1:
        p.error("--reps: must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()

    def log(line: str = "") -> None:
        print(line, flush=True)

    meta = collect_meta(args)
    if max(args.threads) > meta["available_cpus"]:
        log(
            f"warning: --threads {max(args.threads)} exceeds the {meta['available_cpus']} "
            "CPUs available to this process; those rows measure oversubscription."
        )
    peaks = measure_peaks(args.threads, args.peak_seconds)
    header = header_lines(meta, peaks)
    log("\n".join(header))
    log()
    log("\n".join(f"* {c}" for c in CONVENTIONS))

    results: dict[str, list[Row]] = {"gram": [], "solve": [], "merge": []}
    try:
        for bench, fn in (("gram", bench_gram), ("solve", bench_solve), ("merge", bench_merge)):
            if args.only not in (None, bench):
                continue
            log()
            log(TABLE_HEAD[bench])
            results[bench] = fn(args, peaks, log)
            log(agreement_summary(bench, results[bench]))
    except DisagreementError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1

    elapsed = time.perf_counter() - started
    log()
    log(f"total wall time {elapsed:.1f} s")
    if args.markdown:
        write_markdown(args.markdown, [*header, f"total wall time {elapsed:.1f} s"], results)
        log(f"markdown written to {args.markdown}")
    if args.json:
        payload = {
            "meta": meta,
            "peaks_gflops": {str(t): p for t, p in peaks.items()},
            "conventions": list(CONVENTIONS),
            "wall_time_s": elapsed,
            "results": {b: [asdict(r) for r in rows] for b, rows in results.items()},
        }
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(payload, f, indent=1)
        log(f"json written to {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
