"""Start-up of the ``lmdx`` commands: wall time of a whole command in a fresh interpreter,
and whether it imported torch and transformers, against what those imports cost alone.

The inputs are tiny (two BERT classifiers of hidden size 16, their Gram statistics, one of
them in two parts), so the times are start-up: interpreter, imports, parsing, the little
work. Each command runs ``--repeat`` times (interleaved with the other installation's
when ``--old`` is given: ``PYTHONPATH`` of another lmdx, e.g. a ``git archive`` of an
older commit with the compiled modules copied in); the median is printed::

    python bench/bench_startup.py [--repeat 7] [--old /path/to/old/python]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RUNNER = """
import json, runpy, sys
report, *argv = sys.argv[1:]
sys.argv = ["lmdx", *argv]
code = 0
try:
    runpy.run_module("lmdx", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"ml_dtypes", "torch", "transformers"})
json.dump({"code": code, "heavy": heavy}, open(report, "w"))
"""

COMMANDS = {
    "lmdx --help": ["--help"],
    "lmdx info": ["info"],
    "lmdx stats show": ["stats", "show", "s0.safetensors"],
    "lmdx stats add": ["stats", "add", "p0.safetensors", "p1.safetensors", "--out", "sum"],
    "lmdx merge --dry-run": ["merge", "merge.yaml", "--out", "merged", "--dry-run"],
    "lmdx merge (streaming)": ["merge", "merge.yaml", "--out", "merged", "--no-progress"],
    "lmdx stats (collect)": ["stats", "m0", "texts.txt", "--out", "new", "--no-progress"],
}
REFERENCES = {
    "python -c pass": "pass",
    "import numpy": "import numpy",
    "import torch": "import torch",
    "import transformers; BertModel": "import transformers; transformers.BertModel",
}


def build(root: Path) -> None:
    import torch
    from lmdx.stats.collect import collect_regmean_stats
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import BertConfig, BertForSequenceClassification, PreTrainedTokenizerFast

    words = "the a cat dog sat on mat ran fast slow big small red blue".split()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", *words]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    cfg = BertConfig(
        vocab_size=len(vocab),
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=64,
    )
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(4, len(vocab), (16, 10), generator=gen)
    batches = [{"input_ids": ids[i : i + 8], "attention_mask": torch.ones(8, 10)} for i in (0, 8)]
    for i in range(2):
        torch.manual_seed(i)
        model = BertForSequenceClassification(cfg).eval()
        model.save_pretrained(root / f"m{i}")
        tokenizer.save_pretrained(root / f"m{i}")
        collect_regmean_stats(model, batches, progress=False).save(root / f"s{i}.safetensors")
        if i == 0:
            for j, part in enumerate(batches):
                stats = collect_regmean_stats(model, [part], progress=False)
                stats.save(root / f"p{j}.safetensors")
    (root / "texts.txt").write_text("the cat sat on the mat\na big red dog ran fast\n" * 4)
    (root / "merge.yaml").write_text(
        "method: regmean\nmodels:\n"
        "  - {path: m0, stats: s0.safetensors}\n  - {path: m1, stats: s1.safetensors}\n"
        "heads: {patterns: ['classifier.*'], policy: keep}\n"
    )


def run(root: Path, pythonpath: str, argv: list[str]) -> tuple[float, list[str]]:
    for out in ("sum", "merged", "new"):
        target = root / out
        if target.is_dir():
            shutil.rmtree(target)
        target.unlink(missing_ok=True)
    report = root / "report.json"
    env = {**os.environ, "PYTHONPATH": pythonpath, "PYTHONWARNINGS": "ignore"}
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", RUNNER, str(report), *argv],
        cwd=root,
        env=env,
        capture_output=True,
        check=True,
    )
    seconds = time.perf_counter() - t0
    result = json.loads(report.read_text())
    if result["code"] != 0:
        raise SystemExit(f"{argv}: exit code {result['code']}")
    return seconds, list(result["heavy"])


def reference(code: str) -> float:
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--old", default=None, help="PYTHONPATH of another lmdx to compare")
    args = parser.parse_args()
    new = str(Path(__file__).resolve().parents[1] / "python")
    trees = {"new": os.environ.get("PYTHONPATH", new)}
    if args.old:
        trees = {"old": args.old, **trees}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        build(root)
        times: dict[str, dict[str, list[float]]] = {c: {t: [] for t in trees} for c in COMMANDS}
        heavy: dict[str, dict[str, list[str]]] = {c: {} for c in COMMANDS}
        refs: dict[str, list[float]] = {r: [] for r in REFERENCES}
        for _ in range(args.repeat):
            for name, argv in COMMANDS.items():
                for tree, path in trees.items():
                    seconds, imported = run(root, path, argv)
                    times[name][tree].append(seconds)
                    heavy[name][tree] = imported
            for name, code in REFERENCES.items():
                refs[name].append(reference(code))
    cols = " | ".join(f"{t} (median of {args.repeat})" for t in trees)
    print(f"| command | {cols} |{' old/new |' if args.old else ''} imports (new) |")
    print("|---|" + "---|" * len(trees) + ("---|" if args.old else "") + "---|")
    for name in COMMANDS:
        med = {t: statistics.median(times[name][t]) for t in trees}
        ratio = f" {med['old'] / med['new']:.2f} |" if args.old else ""
        cells = " | ".join(f"{med[t]:.2f} s" for t in trees)
        print(f"| `{name}` | {cells} |{ratio} {', '.join(heavy[name]['new']) or '-'} |")
    for name in REFERENCES:
        blank = " |" * (len(trees) - 1) + (" |" if args.old else "")
        print(f"| `{name}` (reference) | {statistics.median(refs[name]):.2f} s |{blank} |")


if __name__ == "__main__":
    main()
