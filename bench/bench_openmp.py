"""lmdx next to torch in one process: OpenMP runtimes, speed and fork.

    python bench/bench_openmp.py [--threads 2] [--repeat 7] [--rounds 1]

Runs four processes: lmdx alone, torch alone, and both imported in each order (torch
first, lmdx first). Each process times an lmdx Gram (``Moments.update``), an lmdx RegMean
merge of one layer and a torch float32 matmul, interleaved when both are there, each with
the same thread count; checks every result against NumPy float64; lists the OpenMP
runtime files the process mapped; and, where both ran, forks and runs both again in the
child (torch with ``torch.set_num_threads(1)``, torch's own rule for forked workers),
which must finish within a minute. Prints the best times (the least disturbed by other
load) and their ratio to the process that ran that library alone; exits non-zero on a
wrong result or a hung child (no timing threshold: the ratios are for the record,
bench/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROLES = ("lmdx-only", "torch-only", "torch-first", "lmdx-first")


def runtimes() -> list[str]:
    with open("/proc/self/maps") as maps:
        paths = {line.split()[-1] for line in maps if "omp" in line.split()[-1].rsplit("/", 1)[-1]}
    return sorted(paths)


def role(name: str, threads: int, repeat: int) -> dict:
    if name in ("torch-only", "torch-first"):
        import torch
    if name in ("lmdx-only", "torch-first", "lmdx-first"):
        import lmdx
    if name == "lmdx-first":
        import torch
    use_lmdx, use_torch = name != "torch-only", name != "lmdx-only"
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40_000, 256)).astype(np.float32)
    d = 384
    grams = [(lambda a: a.T @ a / 2000)(rng.standard_normal((2000, d))) for _ in range(2)]
    weights = [rng.standard_normal((d, d)) for _ in range(2)]
    a = rng.standard_normal((768, 768)).astype(np.float32)

    ops = {}
    if use_lmdx:
        ops["lmdx gram"] = lambda: lmdx.Moments(256).update(x, n_threads=threads).gram()
        ops["lmdx merge"] = lambda: (
            lmdx.regmean_merge_layer(
                grams, weights, [1.0, 1.0], precision="float64", n_threads=threads
            ).weight
        )
    if use_torch:
        torch.set_num_threads(threads)
        ta = torch.from_numpy(a)
        ops["torch matmul"] = lambda: (ta @ ta @ ta).numpy()

    def check(results: dict) -> dict:
        errors = {}
        if "lmdx gram" in results:
            ref = x.astype(np.float64).T @ x.astype(np.float64)
            errors["lmdx gram"] = float(np.abs(results["lmdx gram"] - ref).max() / ref.max())
        if "lmdx merge" in results:
            ref = np.linalg.solve(
                sum(grams), sum(g @ w.T for g, w in zip(grams, weights, strict=True))
            ).T
            errors["lmdx merge"] = float(np.abs(results["lmdx merge"] - ref).max())
        if "torch matmul" in results:
            a64 = a.astype(np.float64)
            ref = a64 @ a64 @ a64
            errors["torch matmul"] = float(np.abs(results["torch matmul"] - ref).max() / ref.max())
        return errors

    results = {op: fn() for op, fn in ops.items()}  # warm up, and the results checked
    times: dict[str, list[float]] = {op: [] for op in ops}
    for _ in range(repeat):
        for op, fn in ops.items():  # interleaved: each library runs right after the other
            start = time.perf_counter()
            fn()
            times[op].append(time.perf_counter() - start)
    # Within one process (the same load for both): each library's call right after a call
    # of the other library (whose OpenMP threads may still be awake) against right after a
    # call of its own.
    ab: dict[str, list[float]] = {}
    if use_lmdx and use_torch:
        for _ in range(repeat):
            for op, other in (("lmdx gram", "torch matmul"), ("torch matmul", "lmdx gram")):
                for before in (op, other):
                    ops[before]()
                    start = time.perf_counter()
                    ops[op]()
                    key = f"{op} after {'itself' if before == op else 'the other'}"
                    ab.setdefault(key, []).append(1e3 * (time.perf_counter() - start))
    out = {
        "role": name,
        "after_ms": ab,
        "runtimes": runtimes(),
        "times_ms": {op: [1e3 * x for x in t] for op, t in times.items()},
        "errors": check(results),
    }
    if use_lmdx and use_torch:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(read)
            torch.set_num_threads(1)
            child = check({op: fn() for op, fn in ops.items()})
            os.write(write, json.dumps(child).encode())
            os._exit(0)
        os.close(write)
        deadline = time.monotonic() + 60
        out["fork"] = "hung"
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                out["fork"] = "ok" if status == 0 else f"exit status {status}"
                out["fork_errors"] = json.loads(os.read(read, 100_000).decode() or "{}")
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
    return out


BOUNDS = {"lmdx gram": 1e-6, "lmdx merge": 1e-9, "torch matmul": 1e-5}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=1, help="run the four processes R times")
    parser.add_argument("--role", choices=ROLES, help="run one process only (prints JSON)")
    args = parser.parse_args()
    if args.role:
        print(json.dumps(role(args.role, args.threads, args.repeat)))
        return
    runs: dict[str, dict] = {}
    for _ in range(args.rounds):  # round robin, so a change of load hits every process alike
        for name in ROLES:
            proc = subprocess.run(
                [sys.executable, __file__, "--role", name, "--threads", str(args.threads),
                 "--repeat", str(args.repeat)],
                capture_output=True, text=True, timeout=600,
            )  # fmt: skip
            if proc.returncode != 0:
                sys.exit(f"bench_openmp: {name} failed: {proc.stderr[-2000:]}")
            run = json.loads(proc.stdout.splitlines()[-1])
            if name in runs:  # the worst result and fork outcome, all the times
                kept = runs[name]
                for key in ("times_ms", "after_ms"):
                    for op, t in run[key].items():
                        kept[key][op] += t
                for key in ("errors", "fork_errors"):
                    for op, err in run.get(key, {}).items():
                        kept.setdefault(key, {})[op] = max(kept.get(key, {}).get(op, 0.0), err)
                if run.get("fork", "ok") != "ok":
                    kept["fork"] = run["fork"]
            else:
                runs[name] = run
    for run in runs.values():
        run["best_ms"] = {op: min(t) for op, t in run["times_ms"].items()}
    alone = {**runs["lmdx-only"]["best_ms"], **runs["torch-only"]["best_ms"]}
    failed = []
    print(
        f"threads {args.threads}, best of {args.rounds} x {args.repeat} calls; "
        "(ratio to the process that ran that library alone)"
    )
    print(f"| process | OpenMP runtimes mapped | {' | '.join(alone)} | fork after both ran |")
    print(f"|---|---|{'---|' * len(alone)}---|")
    for name, run in runs.items():
        cells = []
        for op in alone:
            if op in run["best_ms"]:
                ms = run["best_ms"][op]
                cells.append(f"{ms:.1f} ms ({ms / alone[op]:.2f})")
            else:
                cells.append("-")
            for errors in (run["errors"], run.get("fork_errors", {})):
                if op in errors and not errors[op] <= BOUNDS[op]:
                    failed.append(f"{name} {op}: error {errors[op]:.1e}")
        libs = ", ".join(os.path.relpath(p, sys.prefix) for p in run["runtimes"]) or "-"
        print(f"| {name} | {libs} | {' | '.join(cells)} | {run.get('fork', '-')} |")
        if run.get("fork") not in (None, "ok"):
            failed.append(f"{name}: forked child {run['fork']}")
    print("\nin one process: a call right after the other library's / right after its own (best)")
    print("| process | lmdx gram | torch matmul |\n|---|---|---|")
    for name in ("torch-first", "lmdx-first"):
        best = {k: min(t) for k, t in runs[name]["after_ms"].items()}
        cells = [
            f"{best[f'{op} after the other']:.1f} / {best[f'{op} after itself']:.1f} ms "
            f"({best[f'{op} after the other'] / best[f'{op} after itself']:.2f})"
            for op in ("lmdx gram", "torch matmul")
        ]
        print(f"| {name} | {' | '.join(cells)} |")
    if failed:
        sys.exit("bench_openmp: FAILED: " + "; ".join(failed))
    print("bench_openmp: every result within its bound of NumPy float64; no forked child hung")


if __name__ == "__main__":
    main()
