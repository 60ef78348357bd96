"""The long fuzz run for release checks: thousands of corrupted statistics files, sharded
statistics folders, checkpoints, checkpoint indexes and merge configs (the cases of
tests/fuzz/fuzz_cases.py) and of drawn calls of lmdx.merge_state_dicts (every data-free
method and +svc, options, dtypes, awkward shapes, NaN and Inf: tests/fuzz/door_cases.py),
each under a time limit, the whole run under a memory limit.

    .venv/bin/python scripts/fuzz.py --cases 10000      # lmdx installed in .venv (pip install .)

Prints the outcomes per target (merged, or the lmdx error raised) and every bad outcome
(another exception, a partial output, a modified input, a merge different from the clean
one, a case past the time limit, memory past the limit); exits 1 if there was one.
"""

from __future__ import annotations

import argparse
import collections
import json
import resource
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "fuzz"))

import door_cases as D
import fuzz_cases as F

#: Every target: the files' (fuzz_cases) and the in-memory door's arguments (door_cases).
TARGETS = (*F.TARGETS, "state_dicts", "cost")


class CaseTimeout(Exception):
    """A case ran past --time-limit."""


def _alarm(signum: int, frame: Any) -> None:
    raise CaseTimeout


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cases", type=int, default=10_000, help="cases in all (spread over targets)")
    p.add_argument("--seed", type=int, default=0, help="first seed (cases use seed, seed+1, ...)")
    p.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS))
    p.add_argument("--time-limit", type=int, default=60, help="seconds per case")
    p.add_argument("--memory-limit", type=float, default=2.0, help="GB above the start")
    p.add_argument("--json", metavar="FILE", help="also write the counts as JSON")
    args = p.parse_args()

    root = Path(tempfile.mkdtemp(prefix="lmdx-fuzz-"))
    ws = F.Workspace(root)
    limit = _vm_bytes() + int(args.memory_limit * 1e9)
    resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    signal.signal(signal.SIGALRM, _alarm)
    counts: dict[str, collections.Counter[str]] = {t: collections.Counter() for t in args.targets}
    bad: list[str] = []
    t0 = time.perf_counter()
    for i in range(args.cases):
        target = args.targets[i % len(args.targets)]
        seed = args.seed + i // len(args.targets)
        signal.alarm(args.time_limit)
        try:
            if target == "state_dicts":
                outcome = D.run_door_case(seed)
            elif target == "cost":
                outcome = D.run_cost_case(ws, seed)
            else:
                outcome = F.run_case(ws, target, seed)
        except CaseTimeout:
            outcome = "BAD"
            bad.append(f"{target} seed {seed}: ran past {args.time_limit} s")
        except MemoryError:
            outcome = "BAD"
            bad.append(f"{target} seed {seed}: memory past the limit")
        except AssertionError as exc:
            outcome = "BAD"
            bad.append(str(exc))
        finally:
            signal.alarm(0)
        counts[target][outcome] += 1
        if (i + 1) % 500 == 0:
            print(f"{i + 1} cases, {len(bad)} bad, {time.perf_counter() - t0:.0f} s", flush=True)
    seconds = time.perf_counter() - t0
    print(f"\n{args.cases} cases in {seconds:.0f} s; {len(bad)} bad outcomes")
    for target, c in counts.items():
        shown = ", ".join(f"{k} {v}" for k, v in c.most_common())
        print(f"  {target:17s} {sum(c.values()):6d}  {shown}")
    for line in bad[:50]:
        print("BAD:", line)
    if args.json:
        summary = {"cases": args.cases, "seconds": seconds, "bad": bad, "counts": counts}
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
