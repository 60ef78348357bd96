"""RegMean pipeline: lmdx vs FusionBench, same model, same data, one run.

A BERT-base-sized encoder (``BertModel``, no pooler, random init, fixed seed) and K
"fine-tuned" copies of it (every parameter perturbed by seeded Gaussian noise, ``--noise``
× the tensor's standard deviation: 0.02 by default, the ≈ 2 % deviation real fine-tunes
show; 0.1 is the stress row) each get their own synthetic data: ``--seqs`` sequences
of ``--seq-len`` token ids, padded to ``--seq-len``, with random real lengths so that about
60 % of the positions are real tokens (random ids from the vocabulary between ``[CLS]`` and
``[SEP]``, ``attention_mask`` 1 on real tokens). Batches of ``--batch`` sequences.

Measured per model (every collection runs the whole model under ``torch.no_grad()``):

* ``forward``: the plain forward pass over the model's batches;
* ``FusionBench``: ``fusion_bench.method.regmean.regmean.regmean_merging`` run on the one
  model with a minimal trainer object that yields the batches, so its own forward hook on
  every ``nn.Linear`` (fp32 ``x.T @ x`` over all rows, padding included, running mean)
  is registered and removed exactly as FusionBench does it; its final call to
  ``merging_with_regmean_weights`` is replaced for the timing by one that only keeps the
  Grams (the merge is timed separately);
* ``lmdx (padding excluded)`` / ``lmdx (padding included)``:
  ``lmdx.collect_regmean_stats`` (float64 Grams, one Gram per shared input);
* ``lmdx (padding included, float64 products)``: the same with ``accumulation="float64"``
  (each model once; merged by a third worker; ``--no-float64`` skips it).

Overhead = collection − forward. Every model is collected once by every method (that
gives the Grams for the merge); model 0 is then timed ``--reps − 1`` more times (and
FusionBench ``--fb-reps − 1`` more times). Each figure is the median of those per-model
samples.

Merge: FusionBench's ``merging_with_regmean_weights`` (fp32, ``torch.inverse``) on its
Grams and lmdx's ``merge_models(method="regmean")`` on lmdx's padding-included statistics
(the same system), for each ``--alphas`` value (FusionBench's ``reduce_non_diagonal_ratio``
is lmdx's ``alpha``: off-diagonal entries × α, diagonal kept). Each merge runs in its own
subprocess that rebuilds the models from their seeds and loads the Grams from files
written by the main process; it times ``--reps`` merges and reports its peak RSS during
each merge (Linux: the process's RSS high-water mark ``VmHWM`` is reset through
``/proc/self/clear_refs`` right before the merge and read right after it; where that is
not possible, ``getrusage`` ``ru_maxrss`` over the whole process is reported instead).
Each merge's float32 work (``merge_work.model_flops``: the deviation form's flops of every
RegMean system merged, the same for every method) and its share of the FMA peak measured
at the start of the run (float32; float64 too for ``precision="float64"``); the copies'
measured deviation (min / median / max over the RegMean weights) says what was merged.

Agreement: every merged tensor of FusionBench vs lmdx (``max|a − b| / max|b|``), and, on
``--check`` layers, both against a float64 NumPy reference of
``W_Mᵀ = (Σ G̃_i)⁻¹ Σ G̃_i W_iᵀ`` (Ĝ_i = G_i/n_i, G̃_i = α Ĝ_i + (1−α) diag Ĝ_i) whose
Grams come from the layers' inputs captured in a separate untimed forward pass and
multiplied in float64 (padding included), solved with ``numpy.linalg.solve``.

Installing the peer (FusionBench pins nothing that matters here, but its full dependency
set would upgrade torch/transformers; install it and only its import-time dependencies
without dependency resolution)::

    pip install --no-deps fusion-bench==0.2.33 omegaconf antlr4-python3-runtime==4.9.3 \\
        hydra-core bidict lightning-utilities lightning torchmetrics joblib cloudpickle \\
        datasets dill multiprocess xxhash pyarrow pandas

(``python-dateutil`` and ``tzdata`` for pandas were already present.) Check afterwards
that ``pip list`` still shows the same torch, transformers and numpy.

Run from the repository root: ``python bench/bench_regmean.py --reps 3``.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
from merge_work import (
    deviation,
    deviation_line,
    efficiency,
    measure_peaks,
    merged_errors,
    model_flops,
    peak_line,
    rel_fro,
    rel_max,
)

os.environ.setdefault("TQDM_DISABLE", "1")  # FusionBench's progress bars

CHECK = (
    "encoder.layer.0.attention.self.query",
    "encoder.layer.5.intermediate.dense",
    "encoder.layer.11.attention.output.dense",
    "encoder.layer.11.output.dense",
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- setup


def build_models(args: argparse.Namespace) -> list[Any]:
    """K perturbed copies of one random BERT encoder (deterministic from the seeds)."""
    import torch
    from transformers import BertConfig, BertModel

    cfg = BertConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        intermediate_size=4 * args.hidden,
    )
    torch.manual_seed(args.seed)
    base = BertModel(cfg, add_pooling_layer=False).eval()
    models = []
    for i in range(args.models):
        m = copy.deepcopy(base)
        g = torch.Generator().manual_seed(args.seed * 1000 + 1 + i)
        with torch.no_grad():
            for p in m.parameters():
                scale = float(p.std()) if p.numel() > 1 else 0.0
                scale = scale if scale > 0 else 0.02
                p.add_(torch.randn(p.shape, generator=g) * (args.noise * scale))
        models.append(m.eval())
    del base
    return models


def make_batches(args: argparse.Namespace, i: int, vocab: int) -> list[dict[str, Any]]:
    """Model i's padded batches: random ids, random real lengths (≈ --real-frac real)."""
    import torch

    rng = np.random.default_rng([args.seed, 7, i])
    L = args.seq_len
    lo = max(2, round(2 * args.real_frac * L - L))
    lengths = rng.integers(lo, L + 1, size=args.seqs)
    ids = np.zeros((args.seqs, L), dtype=np.int64)
    mask = np.zeros((args.seqs, L), dtype=np.int64)
    for s, n in enumerate(lengths):
        ids[s, 0] = 101
        ids[s, 1 : n - 1] = rng.integers(1000, vocab, size=n - 2)
        ids[s, n - 1] = 102
        mask[s, :n] = 1
    out = []
    for start in range(0, args.seqs, args.batch):
        out.append(
            {
                "input_ids": torch.from_numpy(ids[start : start + args.batch].copy()),
                "attention_mask": torch.from_numpy(mask[start : start + args.batch].copy()),
            }
        )
    return out


# --------------------------------------------------------------------------- collection


def run_forward(model: Any, batches: list[dict[str, Any]]) -> None:
    import torch

    with torch.no_grad():
        for b in batches:
            model(**b)


class _Trainer:
    """The three members of a HF Trainer that FusionBench's ``regmean_merging`` uses."""

    def __init__(self, batches: list[dict[str, Any]]) -> None:
        self._batches = batches
        self._train_batch_size = int(batches[0]["input_ids"].shape[0])

    def get_train_dataloader(self) -> list[dict[str, Any]]:
        return self._batches

    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        return inputs


def fb_collect(model: Any, batches: list[dict[str, Any]], n_examples: int) -> dict[str, Any]:
    """FusionBench's Gram collection for one model: its hooks, its loop; merge skipped."""
    import fusion_bench.method.regmean.regmean as fbr

    captured: dict[str, Any] = {}
    original = fbr.merging_with_regmean_weights

    def keep(
        models_to_merge_param_dict: Any,
        models_to_merge_regmean_weights_list: Any,
        reduce_non_diagonal_ratio: float = 1.0,
        **_: Any,
    ) -> dict[str, Any]:
        captured["grams"] = models_to_merge_regmean_weights_list[0]
        return {}

    fbr.merging_with_regmean_weights = keep
    try:
        fbr.regmean_merging(
            models_to_merge=[model],
            trainers=[_Trainer(batches)],
            exclude_param_names_regex=[],
            nums_regmean_examples=[n_examples],
            reduce_non_diagonal_ratio=1.0,
        )
    finally:
        fbr.merging_with_regmean_weights = original
    return captured["grams"]


def lmdx_collect(
    model: Any,
    batches: list[dict[str, Any]],
    include_padding: bool,
    threads: int,
    precision: str = "mixed",
) -> Any:
    from lmdx import collect_regmean_stats

    return collect_regmean_stats(
        model,
        batches,
        include_padding=include_padding,
        progress=False,
        n_threads=threads,
        description="bench_regmean synthetic",
        accumulation=precision,
    )


def capture_inputs(
    model: Any, batches: list[dict[str, Any]], names: list[str]
) -> dict[str, tuple[np.ndarray, int]]:
    """float64 Gram Σ x xᵀ and row count of each named module's input (padding included)."""
    import torch

    mods = dict(model.named_modules())
    grams: dict[str, Any] = {}
    counts: dict[str, int] = defaultdict(int)

    def hook(name: str) -> Any:
        def fn(module: Any, args: tuple[Any, ...]) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1]).numpy().astype(np.float64)
            g = x.T @ x
            grams[name] = g if name not in grams else grams[name] + g
            counts[name] += x.shape[0]

        return fn

    handles = [mods[n].register_forward_pre_hook(hook(n)) for n in names]
    try:
        with torch.no_grad():
            for b in batches:
                model(**b)
    finally:
        for h in handles:
            h.remove()
    return {n: (grams[n], counts[n]) for n in names}


def timed(fn: Any, *args: Any) -> tuple[float, Any]:
    gc.collect()
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


# --------------------------------------------------------------------------- merge worker


_ALPHA = [1.0]  # the α the worker's merge closures use


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def _reset_hwm() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def merge_worker(args: argparse.Namespace) -> None:
    """Subprocess: rebuild the models, load the Grams, merge at every α, save the results."""
    import torch

    torch.set_num_threads(args.threads)
    impl, workdir = args.worker, Path(args.workdir)
    solver: dict[str, Any] = {}
    models = build_models(args)
    if impl == "fusionbench":
        from fusion_bench.method.regmean.regmean import merging_with_regmean_weights

        grams = [
            torch.load(workdir / f"fb_grams_{i}.pt", weights_only=True) for i in range(args.models)
        ]
        params: dict[str, list[Any]] = defaultdict(list)
        for m in models:
            for name, p in m.named_parameters():
                params[name].append(p)

        def run() -> dict[str, Any]:
            with torch.no_grad():  # as regmean_merging calls it
                return merging_with_regmean_weights(
                    models_to_merge_param_dict=params,
                    models_to_merge_regmean_weights_list=grams,
                    reduce_non_diagonal_ratio=_ALPHA[0],
                )
    else:
        from lmdx import Statistics, merge_models

        prefix = "lmdx_incl64" if impl == "lmdx64" else "lmdx_incl"
        precision = "float64" if impl == "lmdx_f64" else "auto"

        def run() -> dict[str, Any]:
            stats = [
                Statistics.load(workdir / f"{prefix}_{i}.safetensors") for i in range(args.models)
            ]
            res = merge_models(
                models,
                method="regmean",
                stats=stats,
                alpha=_ALPHA[0],
                precision=precision,
                progress=False,
                n_threads=args.threads,
                cost=False,  # the peer measures no per-task cost: time the same work
            )
            layers = res.report.get("layers", {})
            solver["regularized"] = sorted(
                n for n, v in layers.items() if v.get("ridge", 0) > 0 or v.get("attempts", 1) > 1
            )
            solver["layers"] = len(layers)
            precisions: dict[str, int] = {}
            for v in layers.values():
                if v.get("shared_with") is None:
                    precisions[v.get("precision", "?")] = (
                        precisions.get(v.get("precision", "?"), 0) + 1
                    )
            solver["precision"] = precisions
            solver["max_output_error_estimate"] = max(
                (float(v.get("output_error_estimate", 0.0)) for v in layers.values()), default=0.0
            )
            return res.state_dict

    for alpha in args.alphas:
        merge_alpha(args, impl, alpha, workdir, run, solver)


def merge_alpha(
    args: argparse.Namespace,
    impl: str,
    alpha: float,
    workdir: Path,
    run: Any,
    solver: dict[str, Any],
) -> None:
    """Time --merge-reps merges at one α (``run`` reads α from ``_ALPHA``); keep the first."""
    _ALPHA[0] = alpha
    times, peaks, before, method = [], [], [], "VmHWM reset"
    solver.clear()
    for r in range(args.merge_reps):
        gc.collect()
        rss0 = _status_kib("VmRSS")
        ok = _reset_hwm()
        if not ok:
            method = "ru_maxrss (whole process)"
        t0 = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - t0)
        peak = _status_kib("VmHWM") if ok else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        peaks.append(peak)
        before.append(rss0)
        if r == 0:
            from safetensors.torch import save_file

            save_file(
                {k: v.detach().float().contiguous() for k, v in out.items()},
                str(workdir / f"merged_{impl}_{alpha}.safetensors"),
            )
        del out
    json.dump(
        {
            "times": times,
            "peak_kib": peaks,
            "rss_before_kib": before,
            "rss_method": method,
            "solver": dict(solver),
        },
        open(workdir / f"merge_{impl}_{alpha}.json", "w"),
    )


def run_merges(
    args: argparse.Namespace, impl: str, workdir: Path, lmdx_path: str | None = None
) -> dict[float, dict[str, Any]]:
    """One worker subprocess per implementation; it merges at every α in turn. With
    ``lmdx_path``, the worker imports lmdx from that folder (another build of it)."""
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--worker",
        impl,
        "--workdir",
        str(workdir),
        "--alphas",
        *map(repr, args.alphas),
    ]
    for k in ("merge_reps", "models", "layers", "hidden", "threads", "seed", "noise"):
        cmd += [f"--{k.replace('_', '-')}", str(getattr(args, k))]
    log(f"merges {impl} alphas={args.alphas} ...")
    env = None
    if lmdx_path is not None:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [lmdx_path, env.get("PYTHONPATH")]))
    subprocess.run(cmd, check=True, env=env)
    return {a: json.load(open(workdir / f"merge_{impl}_{a}.json")) for a in args.alphas}


# --------------------------------------------------------------------------- reference


def reference_merge(
    grams: list[np.ndarray], counts: list[int], weights: list[np.ndarray], alpha: float
) -> tuple[np.ndarray, float]:
    a = np.zeros_like(grams[0])
    b = np.zeros((grams[0].shape[0], weights[0].shape[0]))
    for g, n, w in zip(grams, counts, weights, strict=True):
        gh = g / n
        gt = alpha * gh
        gt[np.diag_indices_from(gt)] = np.diag(gh)
        a += gt
        b += gt @ w.T
    return np.linalg.solve(a, b).T, float(np.linalg.cond(a))


# --------------------------------------------------------------------------- report


def machine() -> dict[str, Any]:
    import lmdx
    import torch
    import transformers

    cpu, flags = platform.processor() or "?", set()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    except OSError:
        pass
    try:
        from importlib.metadata import version

        fb = version("fusion-bench")
    except Exception:
        fb = "?"
    cfg = lmdx.config()
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "avx2": "avx2" in flags,
        "avx512f": "avx512f" in flags,
        "lmdx": cfg.get("version"),
        "lmdx_simd": cfg.get("simd_path"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "numpy": np.__version__,
        "fusion_bench": fb,
        "python": platform.python_version(),
        "load_average": list(os.getloadavg()),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
    }


def fmt_t(x: float) -> str:
    return f"{x:.2f} s" if x >= 0.1 else f"{x * 1e3:.1f} ms"


def med(xs: list[float]) -> float:
    return float(statistics.median(xs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--reps",
        type=int,
        default=3,
        help="forward / lmdx collections of model 0 (models 1.. once)",
    )
    ap.add_argument(
        "--fb-reps",
        type=int,
        default=1,
        help="FusionBench collections of model 0 (models 1.. once)",
    )
    ap.add_argument("--merge-reps", type=int, default=2, help="timed merges per α and method")
    ap.add_argument("--seqs", type=int, default=64, help="sequences per model")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--real-frac", type=float, default=0.6, help="mean fraction of real tokens")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--models", type=int, default=3, help="K models to merge")
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--hidden", type=int, default=768)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument(
        "--alphas",
        type=float,
        nargs="+",
        default=[0.1, 1.0],
        help="α = FusionBench's reduce_non_diagonal_ratio (its config default "
        "0.1) and plain RegMean 1.0",
    )
    ap.add_argument(
        "--no-float64",
        dest="float64",
        action="store_false",
        help="skip the lmdx precision='float64' collection and its merge",
    )
    ap.add_argument("--noise", type=float, default=0.02, help="copies' noise × std (0.1: stress)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", nargs="*", default=None, help="modules for the float64 reference")
    ap.add_argument("--workdir", default=None, help="scratch folder (default: a temp folder)")
    ap.add_argument("--markdown", default=None, help="also write the report here")
    ap.add_argument("--json", default=None, help="also write raw results here")
    # internal: merge worker
    ap.add_argument(
        "--worker",
        choices=("fusionbench", "lmdx", "lmdx_base", "lmdx64", "lmdx_f64"),
        help=argparse.SUPPRESS,
    )
    args = ap.parse_args()
    if args.worker:
        merge_worker(args)
        return

    import torch

    torch.set_num_threads(args.threads)
    import fusion_bench.method.regmean.regmean  # noqa: F401  (fail early if missing)
    import lmdx.stats.collect  # noqa: F401

    t_start = time.perf_counter()
    info = machine()
    log(f"machine: {info}")
    peaks = measure_peaks(args.threads)
    log(peak_line(peaks, args.threads))
    tmp = None
    if args.workdir is None:
        tmp = tempfile.TemporaryDirectory(prefix="bench_regmean_")
        workdir = Path(tmp.name)
    else:
        workdir = Path(args.workdir)
        workdir.mkdir(parents=True, exist_ok=True)

    models = build_models(args)
    vocab = models[0].config.vocab_size
    data = [make_batches(args, i, vocab) for i in range(args.models)]
    names_linear = [n for n, m in models[0].named_modules() if isinstance(m, torch.nn.Linear)]
    check = [c for c in (args.check if args.check is not None else CHECK) if c in names_linear]
    real = [int(sum(int(b["attention_mask"].sum()) for b in d)) for d in data]
    params = [dict(m.named_parameters()) for m in models]
    deviations = [deviation([p[n + ".weight"].detach() for p in params]) for n in names_linear]
    del params
    padded = args.seqs * args.seq_len
    log(
        f"{args.models} models, {len(names_linear)} linear modules; real tokens per model "
        f"{real} of {padded}"
    )

    samples: dict[str, list[float]] = defaultdict(list)
    per_model: dict[str, list[float]] = defaultdict(list)
    ref_in: list[dict[str, tuple[np.ndarray, int]]] = []
    gram_check: list[dict[str, float]] = []

    # a short untimed warm-up (allocator, thread pools)
    run_forward(models[0], data[0][:1])

    # pass A: every model once by every method
    def sample(key: str, t: float) -> None:
        samples[key].append(t)
        per_model[key].append(t)

    for i, (m, d) in enumerate(zip(models, data, strict=True)):
        t, _ = timed(run_forward, m, d)
        sample("forward", t)
        t, g = timed(fb_collect, m, d, args.seqs)
        sample("fusionbench", t)
        t, sx = timed(lmdx_collect, m, d, False, args.threads)
        sample("lmdx_excl", t)
        t, si = timed(lmdx_collect, m, d, True, args.threads)
        sample("lmdx_incl", t)
        s64 = None
        if args.float64:
            t, s64 = timed(lmdx_collect, m, d, True, args.threads, "float64")
            sample("lmdx_incl64", t)
        log(
            f"model {i}: forward {per_model['forward'][-1]:.2f}s  FusionBench "
            f"{per_model['fusionbench'][-1]:.2f}s  lmdx excl {per_model['lmdx_excl'][-1]:.2f}s"
            f"  lmdx incl {per_model['lmdx_incl'][-1]:.2f}s"
            + (f"  lmdx incl float64 {per_model['lmdx_incl64'][-1]:.2f}s" if args.float64 else "")
        )
        ref = capture_inputs(m, d, check)  # untimed, independent float64 Grams
        ref_in.append(ref)
        # Gram sanity: all three against the float64 reference Gram (padding included)
        gc_row = {}
        for c in check:
            gref, n = ref[c]
            gc_row[f"{c}|fusionbench"] = rel_fro(g[c].double().numpy() * n, gref)
            gc_row[f"{c}|lmdx_incl"] = rel_fro(si.gram(c), gref)
            if s64 is not None:
                gc_row[f"{c}|lmdx_incl64"] = rel_fro(s64.gram(c), gref)
            gc_row[f"{c}|count_incl"] = si.count(c)
            gc_row[f"{c}|count_excl"] = sx.count(c)
            gc_row[f"{c}|count_ref"] = n
        gram_check.append(gc_row)
        torch.save({k: v.contiguous() for k, v in g.items()}, workdir / f"fb_grams_{i}.pt")
        si.save(workdir / f"lmdx_incl_{i}.safetensors")
        if s64 is not None:
            s64.save(workdir / f"lmdx_incl64_{i}.safetensors")
        if i == 0:
            groups_lmdx = len(si.groups)
            fb_bytes = sum(v.numel() * v.element_size() for v in g.values())
            lmdx_file_bytes = os.path.getsize(workdir / f"lmdx_incl_{i}.safetensors")
        del g, sx, si, s64
        gc.collect()

    # extra repetitions on model 0
    m0, d0 = models[0], data[0]
    for r in range(1, max(args.reps, args.fb_reps)):
        if r < args.reps:
            samples["forward"].append(timed(run_forward, m0, d0)[0])
        if r < args.fb_reps:
            samples["fusionbench"].append(timed(fb_collect, m0, d0, args.seqs)[0])
        if r < args.reps:
            samples["lmdx_excl"].append(timed(lmdx_collect, m0, d0, False, args.threads)[0])
            samples["lmdx_incl"].append(timed(lmdx_collect, m0, d0, True, args.threads)[0])
        log(
            f"model 0 rep {r}: "
            + ", ".join(
                f"{k} {v[-1]:.2f}s"
                for k, v in samples.items()
                if len(v) > len(per_model[k]) + r - 1
            )
        )

    from lmdx.files.identity import model_identity

    t_hash = timed(model_identity, m0)[0]

    weights = {
        c: [dict(mm.named_parameters())[c + ".weight"].detach().double().numpy() for mm in models]
        for c in check
    }
    del models, data, m0, d0
    gc.collect()
    if args.merge_reps == 0:  # the statistics alone (bench_regmean_merge.py reuses them)
        print(f"statistics in {workdir}; no merges (--merge-reps 0)")
        return

    # merges
    merges: dict[str, dict[str, Any]] = {}
    agreement: dict[str, dict[str, Any]] = {}
    from lmdx import Statistics
    from safetensors.numpy import load_file

    fb_all = run_merges(args, "fusionbench", workdir)
    lx_all = run_merges(args, "lmdx", workdir)
    l64_all = run_merges(args, "lmdx64", workdir) if args.float64 else None
    f64_all = run_merges(args, "lmdx_f64", workdir)
    layer_stats = [
        Statistics.load(workdir / f"lmdx_incl_{i}.safetensors") for i in range(args.models)
    ]
    accuracy: dict[str, dict[str, Any]] = {}
    for alpha in args.alphas:
        merges[f"fusionbench|{alpha}"], merges[f"lmdx|{alpha}"] = fb_all[alpha], lx_all[alpha]
        a_fb = load_file(str(workdir / f"merged_fusionbench_{alpha}.safetensors"))
        a_lx = load_file(str(workdir / f"merged_lmdx_{alpha}.safetensors"))
        flops = model_flops(layer_stats[0], a_lx, args.models)  # the same at every α
        merges[f"lmdx_f64|{alpha}"] = f64_all[alpha]
        a_f64 = load_file(str(workdir / f"merged_lmdx_f64_{alpha}.safetensors"))
        accuracy[str(alpha)] = {
            impl: merged_errors(merged, a_f64, layer_stats, alpha)
            for impl, merged in (("fusionbench", a_fb), ("lmdx", a_lx))
        }
        a_64 = None
        if l64_all is not None:
            merges[f"lmdx64|{alpha}"] = l64_all[alpha]
            a_64 = load_file(str(workdir / f"merged_lmdx64_{alpha}.safetensors"))
        per_tensor = {}
        for name, v in a_lx.items():
            if name not in a_fb:
                continue
            per_tensor[name] = rel_max(a_fb[name].astype(np.float64), v.astype(np.float64))
        missing = sorted(set(a_fb) ^ set(a_lx))
        lin = {
            k: v
            for k, v in per_tensor.items()
            if k[: -len(".weight")] in names_linear and k.endswith(".weight")
        }
        other = {k: v for k, v in per_tensor.items() if k not in lin}
        refs = {}
        for c in check:
            grams = [ri[c][0] for ri in ref_in]
            counts = [ri[c][1] for ri in ref_in]
            wref, cond = reference_merge(grams, counts, weights[c], alpha)
            key = c + ".weight"
            from lmdx import regmean_merge_layer

            w_solver = regmean_merge_layer(
                grams, weights[c], counts, alpha=alpha, n_threads=args.threads, name=c
            ).weight
            refs[c] = {
                "cond": cond,
                "fusionbench_max": rel_max(a_fb[key].astype(np.float64), wref),
                "fusionbench_fro": rel_fro(a_fb[key].astype(np.float64), wref),
                "lmdx_max": rel_max(a_lx[key].astype(np.float64), wref),
                "lmdx_fro": rel_fro(a_lx[key].astype(np.float64), wref),
                "solver_max": rel_max(w_solver, wref),
                "solver_fro": rel_fro(w_solver, wref),
                "lmdx64_max": rel_max(a_64[key].astype(np.float64), wref) if a_64 else None,
                "lmdx64_fro": rel_fro(a_64[key].astype(np.float64), wref) if a_64 else None,
                # lmdx output is float32: its rounding alone
                "fp32_rounding_max": rel_max(wref.astype(np.float32).astype(np.float64), wref),
            }
        worst = sorted(lin.items(), key=lambda kv: -kv[1])[:3]
        agreement[str(alpha)] = {
            "linear_max": max(lin.values()),
            "linear_median": med(list(lin.values())),
            "linear_worst": worst,
            "other_max": max(other.values()) if other else None,
            "n_linear": len(lin),
            "n_other": len(other),
            "names_differ": missing,
            "reference": refs,
        }
        for impl in ("fusionbench", "lmdx", "lmdx64", "lmdx_f64"):
            (workdir / f"merged_{impl}_{alpha}.safetensors").unlink(missing_ok=True)
        del a_fb, a_lx, a_64, a_f64
    total = time.perf_counter() - t_start

    # ----------------------------------------------------------------------- report
    fw = med(samples["forward"])
    col = {
        k: med(samples[k])
        for k in ("fusionbench", "lmdx_excl", "lmdx_incl", "lmdx_incl64")
        if samples.get(k)
    }
    ov = {k: v - fw for k, v in col.items()}
    K = args.models
    lines: list[str] = []
    P = lines.append
    P("### RegMean pipeline vs FusionBench (`bench_regmean.py`)")
    P("")
    P(
        f"`{' '.join(['python', 'bench/bench_regmean.py', *sys.argv[1:]])}` — {info['date']}, "
        f"total {total / 60:.1f} min"
    )
    P("")
    P(
        f"* machine: {info['cpu']}, {info['cores']} cores, AVX2 {info['avx2']}, AVX-512 "
        f"{info['avx512f']}; lmdx {info['lmdx']} ({info['lmdx_simd']} path), torch "
        f"{info['torch']}, transformers {info['transformers']}, NumPy {info['numpy']}, "
        f"fusion-bench {info['fusion_bench']}; {args.threads} threads for all (torch "
        f"`set_num_threads`, lmdx `n_threads`); load average at start "
        f"{[round(x, 2) for x in info['load_average']]}, at end "
        f"{[round(x, 2) for x in os.getloadavg()]}; {peak_line(peaks, args.threads)}"
    )
    P(
        f"* model: BertModel (no pooler), hidden {args.hidden}, {args.layers} layers, "
        f"intermediate {4 * args.hidden}, {len(names_linear)} `nn.Linear` (lmdx: "
        f"{groups_lmdx} distinct input Grams per model, q/k/v share one); K = {K} copies, "
        f"noise {args.noise} × tensor std; {deviation_line(deviations)}"
    )
    P(
        f"* data per model: {args.seqs} sequences × {args.seq_len} = {padded} positions, real "
        f"tokens {real} ({100 * np.mean(real) / padded:.1f} %), batches of {args.batch}"
    )
    P(
        "* collection samples: "
        + ", ".join(f"{k} {len(v)}" for k, v in samples.items())
        + " (every model once, then model 0 again; float64 products: each model once); medians"
    )
    P("")
    P("**Collection, per model**")
    P("")
    P(
        "| method | time | overhead over forward | overhead / forward "
        "| FusionBench overhead / this |"
    )
    P("|---|---|---|---|---|")
    P(f"| forward only (`torch.no_grad`) | {fmt_t(fw)} | | | |")
    labels = {
        "fusionbench": "FusionBench hook (fp32 `x.T@x`, padding incl.)",
        "lmdx_excl": "lmdx `collect_regmean_stats` (padding excluded)",
        "lmdx_incl": "lmdx `collect_regmean_stats(include_padding=True)`",
        "lmdx_incl64": 'lmdx `(include_padding=True, accumulation="float64")`',
    }
    for k, lab in labels.items():
        if k not in col:
            continue
        ratio = ov["fusionbench"] / ov[k] if ov[k] > 0 else float("inf")
        P(f"| {lab} | {fmt_t(col[k])} | {fmt_t(ov[k])} | {ov[k] / fw:.2f}× | {ratio:.2f}× |")
    P("")
    P(
        "Per model (pass A), s: "
        + "; ".join(f"{k} " + ", ".join(f"{x:.1f}" for x in per_model[k]) for k in per_model)
    )
    P(
        f"lmdx's collection includes one probe forward of one sequence and a content hash of "
        f"the weights (`model_identity`: {fmt_t(t_hash)} for one model)."
    )
    P("")
    P(
        f"**Merge** (K = {K}, whole model; one worker subprocess per method; median of "
        f"{args.merge_reps}; float32 work of the merge {flops / 1e9:.1f} GFLOP: the deviation "
        "form's flops of every RegMean system, the same for every method)"
    )
    P("")
    P("| α | method | time | FusionBench / this | of the measured peak | RSS before → peak (Δ) |")
    P("|---|---|---|---|---|---|")
    gib = lambda k: k / 2**20  # noqa: E731
    mlabels = {
        "fusionbench": "FusionBench `merging_with_regmean_weights`",
        "lmdx": "lmdx `merge_models` (precision auto)",
        "lmdx_f64": 'lmdx `merge_models` (precision="float64")',
        "lmdx64": "lmdx `merge_models` (float64-product statistics)",
    }
    for alpha in args.alphas:
        tf = med(merges[f"fusionbench|{alpha}"]["times"])
        for impl, lab in mlabels.items():
            if f"{impl}|{alpha}" not in merges:
                continue
            mm = merges[f"{impl}|{alpha}"]
            t = med(mm["times"])
            P(
                f"| {alpha} | {lab} | {fmt_t(t)} | {tf / t:.2f}× | "
                f"{efficiency(flops, t, peaks, impl == 'lmdx_f64')} | "
                f"{gib(mm['rss_before_kib'][0]):.2f} → {gib(max(mm['peak_kib'])):.2f} GiB "
                f"(+{gib(max(mm['peak_kib']) - mm['rss_before_kib'][0]):.2f}) |"
            )
    P("")
    P(
        "Merge times: "
        + "; ".join(f"{k} " + ", ".join(f"{x:.2f}" for x in v["times"]) for k, v in merges.items())
        + " s."
    )
    for key, mm in merges.items():
        if key.startswith("lmdx"):
            sv = mm.get("solver", {})
            P(
                f"{key}: {sv.get('layers')} layers solved, regularized (ridge added): "
                f"{sv.get('regularized') or 'none'}; systems per precision: "
                f"{sv.get('precision') or 'not reported'}; largest certified output error "
                f"{sv.get('max_output_error_estimate', 0.0):.1e}."
            )
    P(
        f"Peak RSS: {merges[next(iter(merges))]['rss_method']} — the worker's RSS high-water "
        "mark during the merge call alone; 'before' = its RSS just before (models, and for "
        "FusionBench its Grams, already in memory; lmdx reads its statistics files lazily "
        "inside the merge)."
    )
    P("")
    P(
        "End to end (K collections + one merge, padding included for both, "
        f"α = {args.alphas[0]}): FusionBench "
        f"{K * col['fusionbench'] + med(merges[f'fusionbench|{args.alphas[0]}']['times']):.1f} s, "
        f"lmdx {K * col['lmdx_incl'] + med(merges[f'lmdx|{args.alphas[0]}']['times']):.1f} s; "
        "overhead only (collection − forward, + merge): FusionBench "
        f"{K * ov['fusionbench'] + med(merges[f'fusionbench|{args.alphas[0]}']['times']):.1f} s, "
        f"lmdx {K * ov['lmdx_incl'] + med(merges[f'lmdx|{args.alphas[0]}']['times']):.1f} s."
    )
    P("")
    P(
        "**Merge accuracy** against lmdx's float64 merge (the float64 formula; every merged "
        f"RegMean weight, {K} models' statistics, padding included). weight = "
        "max\\|E\\|/max\\|W\\|, output = ‖E‖_S/‖W‖_S with S = Σ G̃_i, ‖A‖²_S = tr(A S Aᵀ); "
        "every output is stored in float32 (the models' dtype), whose rounding alone is "
        "≈ 3e-8 (output) here:"
    )
    P("")
    P(
        "| α | method | weight: max | median | output: max | median | time | "
        "FusionBench / this | systems per precision |"
    )
    P("|---|---|---|---|---|---|---|---|---|")
    for alpha in args.alphas:
        tf = med(merges[f"fusionbench|{alpha}"]["times"])
        for impl in ("fusionbench", "lmdx", "lmdx_f64"):
            acc = accuracy[str(alpha)].get(impl)
            t = med(merges[f"{impl}|{alpha}"]["times"])
            sv = merges[f"{impl}|{alpha}"].get("solver", {})
            cells = (
                f"{acc['weight_max']:.1e} | {acc['weight_median']:.1e} | "
                f"{acc['output_max']:.1e} | {acc['output_median']:.1e}"
                if acc
                else "(reference) | | |"
            )
            P(
                f"| {alpha} | {mlabels[impl]} | {cells} | {fmt_t(t)} | {tf / t:.2f}× | "
                f"{sv.get('precision', '—')} |"
            )
    P("")
    P("**Agreement**")
    P("")
    P(
        "Grams vs the float64 Gram of the captured inputs (‖·‖_F relative, model 0): "
        + "; ".join(
            f"`{c}` FB {gram_check[0][f'{c}|fusionbench']:.1e}, lmdx "
            f"{gram_check[0][f'{c}|lmdx_incl']:.1e}"
            + (
                f", lmdx float64 products {gram_check[0][f'{c}|lmdx_incl64']:.1e}"
                if f"{c}|lmdx_incl64" in gram_check[0]
                else ""
            )
            for c in check
        )
        + f". Rows: included {gram_check[0][f'{check[0]}|count_incl']:.0f}, excluded "
        f"{gram_check[0][f'{check[0]}|count_excl']:.0f} (model 0)."
    )
    P("")
    P(
        "| α | FB vs lmdx, RegMean weights: max (median) of max\\|a−b\\|/max\\|b\\| | "
        "worst tensor | other tensors (averaged): max |"
    )
    P("|---|---|---|---|")
    for alpha in args.alphas:
        a = agreement[str(alpha)]
        P(
            f"| {alpha} | {a['linear_max']:.1e} ({a['linear_median']:.1e}) over {a['n_linear']} | "
            f"`{a['linear_worst'][0][0]}` | "
            f"{a['other_max']:.1e} over {a['n_other']} |"
        )
    P("")
    P(
        "float64 reference `W_Mᵀ = (Σ G̃_i)⁻¹ Σ G̃_i W_iᵀ` (max\\|W−W_ref\\|/max\\|W_ref\\|; "
        "‖·‖_F relative in brackets). FusionBench and lmdx: their whole pipelines (own Grams, "
        "own solve, float32 output); 'lmdx solver': `lmdx.regmean_merge_layer` on the "
        "reference's own float64 Grams (float64 output), i.e. the solve alone; 'fp32' = "
        "rounding W_ref itself to float32:"
    )
    P("")
    P(
        "| α | layer | cond(Σ G̃) | FusionBench | lmdx | lmdx, float64 products | "
        "lmdx solver | fp32 |"
    )
    P("|---|---|---|---|---|---|---|---|")
    for alpha in args.alphas:
        for c, r in agreement[str(alpha)]["reference"].items():
            l64 = (
                f"{r['lmdx64_max']:.1e} ({r['lmdx64_fro']:.1e})"
                if r["lmdx64_max"] is not None
                else "—"
            )
            P(
                f"| {alpha} | `{c}` | {r['cond']:.1e} | {r['fusionbench_max']:.1e} "
                f"({r['fusionbench_fro']:.1e}) | {r['lmdx_max']:.1e} ({r['lmdx_fro']:.1e}) | "
                f"{l64} | {r['solver_max']:.1e} ({r['solver_fro']:.1e}) | "
                f"{r['fp32_rounding_max']:.1e} |"
            )
    P("")
    report = "\n".join(lines)
    print(report)
    if args.markdown:
        Path(args.markdown).write_text(report + "\n")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "machine": info,
                    "samples": samples,
                    "per_model": per_model,
                    "merges": merges,
                    "agreement": agreement,
                    "accuracy": accuracy,
                    "gram_check": gram_check,
                    "real_tokens": real,
                    "model_identity_s": t_hash,
                    "fb_gram_bytes": fb_bytes,
                    "lmdx_stats_file_bytes": lmdx_file_bytes,
                    "total_s": total,
                    "peaks_gflops": peaks,
                    "merge_flops": flops,
                    "deviations": deviations,
                },
                indent=1,
                default=str,
            )
        )
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
