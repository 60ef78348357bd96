"""Instruction counts of lmdx's core kernels on fixed inputs: a regression signal that
machine load does not move.

Wall-clock ratios on a shared 2-core machine wander by 10-30 %; the number of
instructions a kernel executes on a fixed input does not. Each kernel runs under
``valgrind --tool=callgrind`` (one thread, ``LMDX_SIMD`` as set or the default variant)
twice: once preparing its inputs and calling it ``--calls`` times, once preparing the
inputs only; the difference, divided by the calls, is the kernel's count. Python's own
work is the same in both runs (``PYTHONHASHSEED=0``), so it cancels.

    python bench/instructions.py                 # table of all kernels
    python bench/instructions.py --json out.json # also write the numbers
    LMDX_SIMD=baseline python bench/instructions.py   # another dispatch path

hardware counters (``perf stat -e instructions``) are not available in this VM, hence
valgrind. Counts depend on the compiler, Eigen version and dispatch path: compare runs
of one build configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

#: kernel -> (description, flop count of one call) for the fixed inputs below.
KERNELS = {
    "gram_f32": ("Moments.update, float32 rows 2048 x 256, one thread", 2048 * 256 * 257),
    "gram_f32_masked": ("Moments.update, 2048 x 256, 30 % rows masked", 0.7 * 2048 * 256 * 257),
    "gram_f64": ("Moments.update, float64 rows 1024 x 128", 1024 * 128 * 129),
    "spd_solve": ("spd_solve, d = 256, 256 right-hand sides", 256**3 / 3 + 2 * 256**3),
    "regmean_layer": ("regmean_merge_layer, K = 3, d_in 256, d_out 192, α 0.9", 0),
    "weighted_average": ("weighted_average, K = 3 tensors of 512 x 512", 3 * 2 * 512 * 512),
}


def _inputs(kernel: str) -> tuple:
    rng = np.random.default_rng(0)
    if kernel.startswith("gram"):
        dtype = np.float64 if kernel == "gram_f64" else np.float32
        n, d = (1024, 128) if kernel == "gram_f64" else (2048, 256)
        x = rng.standard_normal((n, d)).astype(dtype)
        w = (rng.random(n) > 0.3).astype(np.float64) if kernel.endswith("masked") else None
        return x, w
    if kernel == "spd_solve":
        a = rng.standard_normal((512, 256))
        return a.T @ a / 512 + np.eye(256), rng.standard_normal((256, 256))
    if kernel == "regmean_layer":
        grams = []
        for _ in range(3):
            x = rng.standard_normal((512, 256))
            grams.append(x.T @ x)
        weights = [rng.standard_normal((192, 256)).astype(np.float32) for _ in range(3)]
        return grams, weights
    return tuple(rng.standard_normal((512, 512)).astype(np.float32) for _ in range(3))


def _call(kernel: str, args: tuple) -> None:
    import lmdx

    if kernel.startswith("gram"):
        x, w = args
        lmdx.Moments(x.shape[1]).update(x, weights=w, n_threads=1)
    elif kernel == "spd_solve":
        lmdx.spd_solve(*args, n_threads=1)
    elif kernel == "regmean_layer":
        grams, weights = args
        lmdx.regmean_merge_layer(grams, weights, [512.0] * 3, alpha=0.9, n_threads=1)
    else:
        lmdx.weighted_average(list(args), n_threads=1)


def _child(kernel: str, calls: int) -> None:
    import lmdx  # noqa: F401  (imported in both runs)

    args = _inputs(kernel)
    for _ in range(calls):
        _call(kernel, args)


def _count(kernel: str, calls: int) -> int:
    env = dict(os.environ, PYTHONHASHSEED="0", OMP_NUM_THREADS="1", LMDX_NUM_THREADS="1")
    cmd = [
        "valgrind",
        "--tool=callgrind",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        str(Path(__file__).resolve()),
        "--child",
        kernel,
        "--calls",
        str(calls),
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True)
    found = re.search(r"Collected\s*:\s*(\d+)", out.stderr)
    if out.returncode != 0 or found is None:
        sys.exit(f"valgrind failed for {kernel}:\n{out.stderr[-2000:]}")
    return int(found.group(1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kernels", nargs="+", default=list(KERNELS), choices=list(KERNELS))
    ap.add_argument("--calls", type=int, default=10, help="kernel calls in the measured run")
    ap.add_argument("--json", default=None, help="also write the counts here")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return _child(args.child, args.calls)

    import lmdx

    variant = lmdx.config()["simd_path"]
    if variant == "avx512":
        # valgrind (3.19 here) does not emulate AVX-512: under it the CPU reports no
        # AVX-512, so lmdx would load another path (or refuse a forced avx512).
        if os.environ.get("LMDX_SIMD") == "avx512":
            sys.exit("valgrind does not emulate AVX-512: the avx512 path cannot be counted")
        print("note: valgrind does not emulate AVX-512; counting the avx2 path instead")
        os.environ["LMDX_SIMD"] = variant = "avx2"
    print(f"lmdx {lmdx.__version__}, dispatch path {variant}, valgrind callgrind, 1 thread")
    print("| kernel | what | instructions per call | flop / instruction |")
    print("|---|---|---:|---:|")
    results = {}
    for kernel in args.kernels:
        t0 = time.perf_counter()
        with_calls = _count(kernel, args.calls)
        without = _count(kernel, 0)
        per_call = (with_calls - without) / args.calls
        what, flops = KERNELS[kernel]
        results[kernel] = {"instructions": per_call, "flops": flops, "variant": variant}
        ratio = f"{flops / per_call:.2f}" if flops else "–"
        print(
            f"| {kernel} | {what} | {per_call:,.0f} | {ratio} |  "
            f"<!-- {time.perf_counter() - t0:.0f} s -->"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
