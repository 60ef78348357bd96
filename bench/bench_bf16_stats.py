"""RegMean statistics of bfloat16 activations at Llama-3.1-8B widths: the Gram kernels.

Two parts, in one process, on the same inputs:

1. **The Gram alone** (``--only gram``): bfloat16 rows X (``--tokens`` × d, Gaussian with
   an offset, as activations) for d ∈ ``--dims`` (4096: the q/k/v, o and gate/up inputs;
   14336: the down projection's), accumulated by

   * ``lmdx bf16 dot``: ``lmdx.Moments(d).update(X)`` on the bf16 dot-product kernel
     (AVX512_BF16; skipped where the CPU has none);
   * ``lmdx widen``: the same call with the kernel lmdx used before it (bfloat16 widened to
     float32 while packing; ``LMDX_DISABLE_CPU_FEATURES=avx512bf16``, switched in-process);
   * ``torch fp32 blocks``: lmdx's torch collector path (:class:`lmdx.stats.torch_gram.
     TorchGram`, float32 matmuls of 256-row blocks summed in float64), what a GPU runs;
   * ``torch bf16 X.T@X``: one bfloat16 matmul with a bfloat16 result, what the
     research scripts keep (speed only: its error is that of bfloat16).

   Each: median time, GFLOP/s (``N·d·(d+1)``, the symmetric update's useful work), % of
   this machine's bf16 and fp32 peaks (the core's register-resident loops,
   ``measure_bf16_peak_gflops`` / ``measure_peak_gflops``), and the relative Frobenius
   error against a float64 Gram of the same bfloat16 values (on ``--check-cols`` columns).

2. **Collection on a decoder** (``--only collect``): a Llama decoder with 8B widths (hidden
   4096, MLP 14336, 32/8 heads of 128; ``--layers`` layers, a 1,024-token vocabulary, no
   head; random weights) in bfloat16, on ``--tokens`` tokens in sequences of ``--seq``:
   the forward pass alone, and :func:`lmdx.stats.collect.collect_regmean_stats` with each
   lmdx Gram path (its forward included; ``--torch-collect`` adds the torch path), so
   ``overhead = collect / forward - 1``. The accumulators' first touch (8·d² bytes per
   input group: 2 GB per layer) and the one-sequence probe are part of every collection;
   use enough tokens that they do not dominate.

Repetitions alternate between the methods (``--reps``, medians). Threads: ``--threads``
for lmdx and torch alike. ``--clock cpu`` times the process's CPU seconds instead of wall
seconds: with ``--threads 1`` a figure that other work on a shared machine barely moves
(with more threads it also counts threads waiting for each other).

    python bench/bench_bf16_stats.py                       # both parts, ~3 min on 2 cores
    python bench/bench_bf16_stats.py --only gram --dims 4096 14336 --tokens 4096
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import lmdx
import lmdx._core as dispatch
import numpy as np
import torch
from lmdx.stats.collect import collect_regmean_stats
from lmdx.stats.torch_gram import TorchGram

CONFIG = {"hidden": 4096, "intermediate": 14336, "heads": 32, "kv_heads": 8}


@contextlib.contextmanager
def widened() -> Iterator[None]:
    """bfloat16 rows on the widening kernel while inside (as on a CPU without AVX512_BF16)."""
    old = os.environ.get("LMDX_DISABLE_CPU_FEATURES")
    os.environ["LMDX_DISABLE_CPU_FEATURES"] = "avx512bf16"
    dispatch.bf16_dot.cache_clear()
    try:
        yield
    finally:
        if old is None:
            del os.environ["LMDX_DISABLE_CPU_FEATURES"]
        else:
            os.environ["LMDX_DISABLE_CPU_FEATURES"] = old
        dispatch.bf16_dot.cache_clear()


def machine_line(threads: int, peaks: dict[str, float]) -> str:
    fields = {}
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    cfg = lmdx.config()
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return (
        f"*Machine: {fields.get('model name', platform.processor())} (family "
        f"{fields.get('cpu family', '?')} model {fields.get('model', '?')}), "
        f"{os.cpu_count()} CPUs, lmdx {cfg['version']} `{cfg['simd_path']}` path, Gram paths "
        f"{cfg['gram_paths']}; {threads} threads; peaks measured now: bf16 dot "
        f"{peaks['bf16']:.1f}, fp32 FMA {peaks['fp32']:.1f} GFLOP/s (best of 3); torch "
        f"{torch.__version__}; load average {load}.*"
    )


def measure_peaks(threads: int) -> dict[str, float]:
    """The core's register-resident bf16 dot and fp32 FMA loops, best of 3, in GFLOP/s of
    the ``--clock``: with ``cpu``, the rate the core reports (over wall time) is scaled by
    wall / CPU seconds of the call, so time the process did not run is not counted."""
    core = dispatch.core

    def rate(fn: Callable[[], float]) -> float:
        wall, cpu = time.perf_counter(), time.process_time()
        gflops = fn()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        return gflops * (1.0 if clock is time.perf_counter else wall * threads / cpu)

    return {
        "bf16": max(
            rate(lambda: core.measure_bf16_peak_gflops(n_threads=threads, seconds=0.5))
            for _ in range(3)
        ),
        "fp32": max(
            rate(
                lambda: core.measure_peak_gflops(
                    double_precision=False, n_threads=threads, seconds=0.5
                )
            )
            for _ in range(3)
        ),
    }


clock: Callable[[], float] = time.perf_counter  # --clock cpu: process CPU seconds per thread


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    """Seconds ``fn()`` takes on the ``--clock`` (wall, or this process's CPU time), and
    its result."""
    start = clock()
    out = fn()
    return clock() - start, out


# --------------------------------------------------------------------------- Gram alone


def gram_methods(threads: int) -> dict[str, Callable[[torch.Tensor], tuple[float, Any]]]:
    """Method name -> a function of X returning (seconds, result). An accumulator is made,
    and its memory touched by one row, before the clock starts: what is timed is adding
    the other rows, as collection does batch after batch."""

    def lmdx_update(x: torch.Tensor) -> tuple[float, Any]:
        m = lmdx.Moments(x.shape[1])
        m.update(x[:1], n_threads=threads)
        return timed(lambda: m.update(x[1:], n_threads=threads))

    def widen(x: torch.Tensor) -> tuple[float, Any]:
        with widened():
            return lmdx_update(x)

    def torch_blocks(x: torch.Tensor) -> tuple[float, Any]:
        acc = TorchGram(x.shape[1], "cpu")
        acc.update(x[:1])
        seconds, _ = timed(lambda: acc.update(x[1:]))
        return seconds, acc

    def torch_bf16(x: torch.Tensor) -> tuple[float, Any]:
        return timed(lambda: x.T @ x)

    methods: dict[str, Callable[[torch.Tensor], tuple[float, Any]]] = {}
    if dispatch.bf16_dot():
        methods["lmdx bf16 dot"] = lmdx_update
    methods["lmdx widen"] = widen
    methods["torch fp32 blocks"] = torch_blocks
    methods["torch bf16 X.T@X"] = torch_bf16
    return methods


def gram_of(result: Any, cols: int) -> np.ndarray:
    """The first ``cols`` columns of a method's Gram, as float64."""
    if isinstance(result, torch.Tensor):
        return result[:, :cols].double().numpy()
    return result.gram()[:, :cols]


def run_gram(args: argparse.Namespace, peaks: dict[str, float]) -> list[str]:
    rows_out = [
        "| d | N | method | median ms | GFLOP/s | % bf16 peak | % fp32 peak | × lmdx widen "
        "| rel. err (F) |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(rows_out), flush=True)
    methods = gram_methods(args.threads)
    rng = np.random.default_rng(args.seed)
    for d in args.dims:
        x = torch.from_numpy(0.5 + rng.standard_normal((args.tokens, d), dtype=np.float32)).to(
            torch.bfloat16
        )
        cols = min(d, args.check_cols)
        x64 = x.double().numpy()
        reference = x64.T @ x64[:, :cols]
        times: dict[str, list[float]] = {name: [] for name in methods}
        errors: dict[str, float] = {}
        for name, fn in methods.items():  # warm-up, and the error
            errors[name] = float(
                np.linalg.norm(gram_of(fn(x)[1], cols) - reference) / np.linalg.norm(reference)
            )
        for _ in range(args.reps):
            for name, fn in methods.items():
                time.sleep(args.settle)
                times[name].append(fn(x)[0])
        flops = (args.tokens - 1) * d * (d + 1)  # the rows timed (torch bf16: all, ~ the same)
        base = statistics.median(times["lmdx widen"])
        for name in methods:
            t = statistics.median(times[name])
            gflops = flops / t * 1e-9
            rows_out.append(
                f"| {d} | {args.tokens} | {name} | {t * 1e3:.1f} | {gflops:.1f} | "
                f"{100 * gflops / peaks['bf16']:.1f} | {100 * gflops / peaks['fp32']:.1f} | "
                f"{base / t:.2f}× | {errors[name]:.1e} |"
            )
            print(rows_out[-1], flush=True)
    return rows_out


# --------------------------------------------------------------------------- collection


def decoder(layers: int) -> Any:
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(
        hidden_size=CONFIG["hidden"],
        intermediate_size=CONFIG["intermediate"],
        num_attention_heads=CONFIG["heads"],
        num_key_value_heads=CONFIG["kv_heads"],
        num_hidden_layers=layers,
        vocab_size=1024,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    return LlamaModel(config).to(torch.bfloat16).eval()


def gram_flops_per_token(model: Any) -> float:
    """Useful Gram flops per token: d(d+1) per input group (q/k/v, o, gate/up, down)."""
    h, m = CONFIG["hidden"], CONFIG["intermediate"]
    return float(model.config.num_hidden_layers * (3 * h * (h + 1) + m * (m + 1)))


def run_collect(args: argparse.Namespace, peaks: dict[str, float]) -> list[str]:
    model = decoder(args.layers)
    gen = torch.Generator().manual_seed(args.seed)
    n_seq = max(1, args.tokens // args.seq)
    batches = [
        {
            "input_ids": torch.randint(0, 1024, (1, args.seq), generator=gen),
            "attention_mask": torch.ones(1, args.seq, dtype=torch.long),
        }
        for _ in range(n_seq)
    ]
    tokens = n_seq * args.seq

    def forward() -> None:
        with torch.no_grad():
            for b in batches:
                model(**b)

    def collect(backend: str | None) -> Any:
        return collect_regmean_stats(
            model, batches, progress=False, n_threads=args.threads, backend=backend
        )

    variants: dict[str, Callable[[], Any]] = {"forward alone": forward}
    if dispatch.bf16_dot():
        variants["collect: lmdx bf16 dot"] = lambda: collect(None)

    def collect_widened() -> Any:
        with widened():
            return collect(None)

    variants["collect: lmdx widen"] = collect_widened
    if args.torch_collect:
        variants["collect: torch fp32 blocks"] = lambda: collect("torch")
    for fn in variants.values():  # warm-up
        fn()
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.reps):
        for name, fn in variants.items():
            time.sleep(args.settle)
            times[name].append(timed(fn)[0])
    fwd = statistics.median(times["forward alone"])
    gram_flops = gram_flops_per_token(model) * tokens
    out = [
        f"{args.layers} decoder layer(s) at 8B widths, bfloat16, {tokens} tokens "
        f"({n_seq} × {args.seq}); Gram work {gram_flops / 1e9:.1f} GFLOP",
        "",
        "| run | median s | tokens/s | overhead over the forward | Gram GFLOP/s "
        "(time over the forward) | % bf16 peak |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    print("\n".join(out), flush=True)
    for name in variants:
        t = statistics.median(times[name])
        if name == "forward alone":
            out.append(f"| {name} | {t:.2f} | {tokens / t:.0f} | — | — | — |")
        else:
            extra = max(t - fwd, 1e-9)
            rate = gram_flops / extra * 1e-9
            out.append(
                f"| {name} | {t:.2f} | {tokens / t:.0f} | {extra / fwd:.2f}× | {rate:.1f} | "
                f"{100 * rate / peaks['bf16']:.1f} |"
            )
        print(out[-1], flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", choices=("gram", "collect"), default=None)
    p.add_argument("--dims", type=int, nargs="+", default=[4096, 14336])
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--seq", type=int, default=512, help="tokens per sequence (collection)")
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--check-cols", type=int, default=256)
    p.add_argument("--settle", type=float, default=0.2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    p.add_argument(
        "--torch-collect",
        action="store_true",
        help="also collect with backend='torch' (the GPU path, on the CPU: slow there)",
    )
    args = p.parse_args(argv)
    if args.clock == "cpu":  # CPU seconds per thread: the wall time of an unloaded machine
        global clock
        threads = args.threads
        clock = lambda: time.process_time() / threads  # noqa: E731

    torch.set_num_threads(args.threads)
    peaks = measure_peaks(args.threads)
    print(machine_line(args.threads, peaks))
    print("command: python " + " ".join(sys.argv))
    if args.only in (None, "gram"):
        run_gram(args, peaks)
    if args.only in (None, "collect"):
        run_collect(args, peaks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
