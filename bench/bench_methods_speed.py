"""What a user gets: every method lmdx shares with FusionBench, lmdx's default call against
FusionBench's own implementation on the same models, in one run, on the same threads.

The models: K = 3 copies of a randomly initialized ``BertModel`` of BERT-base's widths
(hidden 768, intermediate 3072, vocabulary 30522) with ``--layers`` encoder layers, each
parameter perturbed by seeded Gaussian noise of ``--noise`` (0.02) times its standard
deviation: fine-tunes 2 % from their base, the size real ones deviate by. The data
methods' statistics are collected once (untimed) on the same synthetic token batches
(``--seqs`` sequences of ``--seq-len`` real tokens, no padding, so that both libraries
see the same rows): lmdx's Grams (``collect_regmean_stats``) and Fisher diagonals
(``collect_fisher``, predicted labels, on ``BertForSequenceClassification`` copies),
handed to FusionBench as the running means it collects (divided by the counts).

Per method, timed by wall clock, the two alternated ``--reps`` times (min and median):

* lmdx: :func:`lmdx.merge_models` as a user calls it, defaults (RegMean: the per-task cost
  estimate on, ``alpha`` 0.9; ``progress=False``, ``n_threads=--threads``);
* FusionBench 0.2.33: its algorithm's ``run`` on a model pool of the same modules
  (simple average, task arithmetic λ 0.3, TIES λ 1 threshold 20 ``mean``, TSV-M α 1,
  ISO-C α 1, ISO-CTS α 1 common fraction 0.8, WUDI with its default 400 Adam steps,
  SVC after task arithmetic α 0.1), RegMean's ``merging_with_regmean_weights`` (α 0.9)
  and Fisher's ``merging_with_fisher_weights`` (not normalised, as lmdx's formula) on the
  same statistics (its ``run`` needs a trainer and a dataset of each task), and RegMean++
  through its ``RegMeanAlgorithmPlusPlus`` loop with BERT hooks written here (FusionBench
  ships CLIP's only) over the same batches; every copy of a model pool made untimed.

Where the methods are the same formula, the agreement of the two merged models is
printed: the largest, over the 2-D weights, of ``‖W_lmdx − W_fb‖_F / ‖W_fb − θ_base‖_F``
(relative to the merged update). TIES keeps the top 20 % per tensor in lmdx and over the
whole flattened model in FusionBench, and lmdx's WUDI is its closed form (ridge 0.1), not
the Adam iterations: those rows differ by design and say so.

``--llm`` adds one 8B-shaped layer (Llama 3 8B's MLP: 4096 × 14336, K = 3, ``--llm-reps``
reps) for the methods that factor matrices (TSV-M, ISO-C, ISO-CTS, SVC).

    python bench/bench_methods_speed.py [--layers 2] [--reps 3] [--threads 2] [--llm]
        [--methods regmean tsv_m ...]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import io
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

K = 3
PAUSE_S = 0.3
ALPHA = 0.9  # RegMean's off-diagonal scaling for transformers (the paper's)

#: the embedding tables (not linear layers)
EMBEDDINGS = [f"embeddings.{n}_embeddings.weight" for n in ("word", "position", "token_type")]
#: method -> lmdx's name and options (defaults otherwise)
LMDX = {
    "average": ("average", {}),
    "task_arithmetic": ("task_arithmetic", {}),
    "ties": ("ties", {}),
    "tsv_m": ("tsv_m", {}),
    "iso_c": ("iso_c", {}),
    "iso_cts": ("iso_cts", {}),
    "wudi": ("wudi", {}),
    "svc": ("task_arithmetic+svc", {}),
    "regmean": ("regmean", {"alpha": ALPHA}),
    "regmean_plusplus": ("regmean_plusplus", {"alpha": ALPHA}),
    "fisher": ("fisher", {}),
}
#: the methods that factor matrices: the ones --llm times on an 8B-shaped layer
FACTORING = ("tsv_m", "iso_c", "iso_cts", "svc")
#: rows whose two answers are not the same formula, and why
DIFFERENT = {
    "ties": "top-k per tensor (lmdx) vs over the whole model (FusionBench)",
    "wudi": "closed form, ridge 0.1 (lmdx) vs 400 Adam steps (FusionBench)",
}


def fb_algorithm(method: str) -> Any:
    """FusionBench's algorithm object for a data-free method, its config's values."""
    import fusion_bench.method as fm
    from fusion_bench.method.singular_value_calibration.task_arithmetic import (
        SingularValueCalibrationArithmeticTask,
    )

    return {
        "average": lambda: fm.SimpleAverageAlgorithm(),
        "task_arithmetic": lambda: fm.TaskArithmeticAlgorithm(scaling_factor=0.3),
        "ties": lambda: fm.TiesMergingAlgorithm(
            scaling_factor=1.0, threshold=20, remove_keys=[], merge_func="mean"
        ),
        "tsv_m": lambda: fm.TaskSingularVectorMerging(alpha=1.0),
        "iso_c": lambda: fm.IsotropicMergingInCommonSubspace(scaling_factor=1.0),
        "iso_cts": lambda: fm.IsotropicMergingInCommonAndTaskSubspace(
            scaling_factor=1.0, common_space_fraction=0.8
        ),
        # lmdx's WUDI solves linear layers only; FusionBench's every 2-D tensor, and its
        # products for the word embeddings (K x 30522², 11 GB) do not fit in 24 GB
        "wudi": lambda: fm.WUDIMerging(iter_num=400, exclude_keys=EMBEDDINGS),
        "svc": lambda: SingularValueCalibrationArithmeticTask(scaling_factor=0.3, alpha=0.1),
    }[method]()


def perturbed(base: torch.nn.Module, noise: float, seed: int) -> list[torch.nn.Module]:
    """K copies of ``base``, each parameter plus seeded N(0, (noise · its std)²)."""
    out = []
    for i in range(K):
        m = copy.deepcopy(base)
        g = torch.Generator().manual_seed(seed * 1000 + 1 + i)
        with torch.no_grad():
            for p in m.parameters():
                scale = float(p.std()) if p.numel() > 1 else 0.0
                p.add_(torch.randn(p.shape, generator=g) * (noise * (scale or 0.02)))
        out.append(m.eval())
    return out


def bert(args: argparse.Namespace, classifier: bool = False) -> torch.nn.Module:
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    cfg = BertConfig(
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 64),
        intermediate_size=4 * args.hidden,
        num_labels=4,
    )
    torch.manual_seed(args.seed)
    if classifier:
        return BertForSequenceClassification(cfg).eval()
    return BertModel(cfg, add_pooling_layer=False).eval()


def batches(args: argparse.Namespace, i: int, vocab: int) -> list[dict[str, torch.Tensor]]:
    """Model i's batches: random ids, every sequence --seq-len real tokens."""
    rng = np.random.default_rng([args.seed, 7, i])
    ids = rng.integers(1000, vocab, size=(args.seqs, args.seq_len))
    ids[:, 0], ids[:, -1] = 101, 102
    out = []
    for s in range(0, args.seqs, args.batch):
        chunk = torch.from_numpy(ids[s : s + args.batch].copy())
        out.append({"input_ids": chunk, "attention_mask": torch.ones_like(chunk)})
    return out


def pool(base: torch.nn.Module, models: list[torch.nn.Module]) -> dict[str, torch.nn.Module]:
    """Fresh copies for a FusionBench model pool (its runs may write into the first model)."""
    return {"_pretrained_": copy.deepcopy(base)} | {
        f"task{i}": copy.deepcopy(m) for i, m in enumerate(models)
    }


def quiet(fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` with its prints and progress bars sent to a buffer."""

    def run() -> Any:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            return fn()

    return run


def state(obj: Any) -> dict[str, torch.Tensor]:
    if isinstance(obj, torch.nn.Module):
        return {k: v.detach() for k, v in obj.state_dict().items()}
    return {k: torch.as_tensor(v).detach() for k, v in obj.items()}


def agreement(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], base: dict[str, torch.Tensor]
) -> tuple[float, int]:
    """max over the common 2-D weights of ‖a − b‖_F / ‖b − base‖_F, and how many."""
    worst, n = 0.0, 0
    for name, x in a.items():
        key = name if name in b else name.removeprefix("bert.")
        if key not in b or name not in base or x.ndim != 2 or x.shape[0] > 20000:
            continue  # the word embeddings: no task matrix of interest, and slow here
        x64, y64 = x.double(), b[key].double()
        ref = float(torch.linalg.norm(y64 - base[name].double()))
        if ref > 0:
            worst = max(worst, float(torch.linalg.norm(x64 - y64)) / ref)
            n += 1
    return worst, n


def timed(fns: dict[str, Callable[[], Any]], reps: int) -> tuple[dict[str, list[float]], dict]:
    """Each function ``reps`` times, alternated, a pause and a collection between runs."""
    times: dict[str, list[float]] = defaultdict(list)
    last: dict[str, Any] = {}
    for _ in range(reps):
        for name, fn in fns.items():
            gc.collect()
            time.sleep(PAUSE_S)
            t = time.perf_counter()
            last[name] = fn()
            times[name].append(time.perf_counter() - t)
    return times, last


def lmdx_call(models: list, method: str, threads: int, **kw: Any) -> Callable[[], Any]:
    import lmdx

    name, options = LMDX[method]

    def run() -> Any:
        return lmdx.merge_models(
            models, name, progress=False, n_threads=threads, **options, **kw
        ).state_dict

    return run


def data_free(args: argparse.Namespace, base: torch.nn.Module, models: list, method: str):
    """The two calls for a data-free method; the pools are made before each FusionBench run."""
    kw = {} if method == "average" else {"base": base}
    pools: list[dict] = []

    def fb() -> Any:
        from fusion_bench.modelpool import BaseModelPool

        return quiet(lambda: fb_algorithm(method).run(BaseModelPool(pools.pop())))()

    def prepare() -> None:
        pools.append(pool(base, models))

    return lmdx_call(models, method, args.threads, **kw), fb, prepare


def regmean_pair(args: argparse.Namespace, base: torch.nn.Module, models: list):
    from fusion_bench.method.regmean.regmean import merging_with_regmean_weights
    from lmdx import collect_regmean_stats

    stats = [
        collect_regmean_stats(m, batches(args, i, 30522), progress=False, n_threads=args.threads)
        for i, m in enumerate(models)
    ]
    fb_grams = []
    for s in stats:
        grams = {}
        for module in s.modules:
            g = s.gram(module) / s.count(module)
            grams[module] = torch.from_numpy(g.astype(np.float32))
        fb_grams.append(grams)
    params: dict[str, list] = defaultdict(list)
    for m in models:
        for name, p in m.named_parameters():
            params[name].append(p)

    def fb() -> Any:
        with torch.no_grad():  # as its regmean_merging calls it
            return merging_with_regmean_weights(params, fb_grams, reduce_non_diagonal_ratio=ALPHA)

    return lmdx_call(models, "regmean", args.threads, stats=stats), fb


def fisher_pair(args: argparse.Namespace):
    from fusion_bench.method.fisher_merging.fisher_merging import merging_with_fisher_weights
    from lmdx import collect_fisher

    base = bert(args, classifier=True)
    models = perturbed(base, args.noise, args.seed)
    stats = [
        collect_fisher(m, batches(args, i, 30522)[: max(1, args.fisher_batches)], progress=False)
        for i, m in enumerate(models)
    ]
    params: dict[str, list] = defaultdict(list)
    for m in models:
        for name, p in m.named_parameters():
            params[name].append(p.detach())
    weights = [  # FusionBench's Fisher: mean squared gradients, as lmdx's merge takes them
        {n: torch.from_numpy((s.fisher(n) / s.count()).astype(np.float32)) for n in params}
        for s in stats
    ]

    def fb() -> Any:
        with torch.no_grad():
            return merging_with_fisher_weights(
                params,
                weights,
                fisher_scaling_coefficients=torch.ones(K),
                normalize_fisher_weight=False,
                minimal_fisher_weight=1e-8,  # lmdx's fisher_eps
            )

    return base, models, lmdx_call(models, "fisher", args.threads, stats=stats), fb


def regmean_plusplus_pair(args: argparse.Namespace, base: torch.nn.Module, models: list):
    from fb_bert_regmean_plusplus import bert_regmean_plusplus

    data = [batches(args, i, 30522) for i in range(K)]
    names = [f"task{i}" for i in range(K)]
    pools: list[dict] = []

    by_task = dict(zip(names, data, strict=True))

    def fb() -> Any:
        return quiet(lambda: bert_regmean_plusplus(pools.pop(), by_task, ALPHA))()

    def prepare() -> None:
        pools.append(pool(base, models))

    return lmdx_call(models, "regmean_plusplus", args.threads, data=data), fb, prepare


def llm_layer(args: argparse.Namespace) -> tuple[torch.nn.Module, list]:
    """One 4096 x 14336 linear layer (no bias), base N(0, 0.02²), K copies 2 % apart."""
    torch.manual_seed(args.seed)
    base = torch.nn.Sequential(torch.nn.Linear(14336, 4096, bias=False))
    with torch.no_grad():
        base[0].weight.normal_(0.0, 0.02)
    return base, perturbed(base, args.noise, args.seed)


def row(method: str, times: dict[str, list[float]], agree: tuple[float, int] | None) -> str:
    lm, fb = min(times["lmdx"]), min(times["fusionbench"])
    med = f"{statistics.median(times['lmdx']):.2f} / {statistics.median(times['fusionbench']):.2f}"
    if agree is None:
        note = ""
    elif method in DIFFERENT:
        note = f"differ by design: {DIFFERENT[method]} ({agree[0]:.1e})"
    else:
        note = f"{agree[0]:.1e} over {agree[1]} weights"
    return f"| {method} | {lm:.2f} | {fb:.2f} | **{fb / lm:.2f}×** | {med} | {note} |"


def machine_line(threads: int) -> str:
    import lmdx
    from bench_svd_methods import simd_line

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    load = os.getloadavg()[0]
    return (
        f"lmdx {lmdx.__version__}, {simd_line()}; {cpu}; {threads} threads; "
        f"torch {torch.__version__}; load {load:.2f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", choices=list(LMDX), default=list(LMDX))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--noise", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seqs", type=int, default=256)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--fisher-batches", type=int, default=2)
    parser.add_argument("--llm", action="store_true")
    parser.add_argument("--llm-reps", type=int, default=1)
    parser.add_argument("--llm-only", action="store_true", help="the 8B-shaped layer alone")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    torch.set_num_threads(args.threads)
    import fusion_bench

    print(machine_line(args.threads))
    print(
        f"FusionBench {getattr(fusion_bench, '__version__', '0.2.33')}; BERT-base widths, "
        f"{args.layers} layers, hidden {args.hidden}, K = {K}, noise {args.noise}, "
        f"{args.reps} reps (seconds: min; median lmdx / FusionBench)"
    )
    head = "| method | lmdx default (s) | FusionBench (s) | FusionBench / lmdx | median |"
    lines = [head + " agreement |", "|---|---:|---:|---:|---|---|"]
    base = bert(args)
    models = perturbed(base, args.noise, args.seed)
    base_state = state(base)
    for method in [] if args.llm_only else args.methods:
        prepare: Callable[[], None] | None = None
        if method == "regmean":
            lm, fb = regmean_pair(args, base, models)
            ref = base_state
        elif method == "fisher":
            fbase, _, lm, fb = fisher_pair(args)
            ref = state(fbase)
        elif method == "regmean_plusplus":
            lm, fb, prepare = regmean_plusplus_pair(args, base, models)
            ref = base_state
        else:
            lm, fb, prepare = data_free(args, base, models, method)
            ref = base_state
        times, last = timed_pair(lm, fb, prepare, args.reps)
        agree = agreement(state(last["lmdx"]), state(last["fusionbench"]), ref)
        lines.append(row(method, times, agree))
        print(lines[-1], flush=True)
    if args.llm or args.llm_only:
        lbase, lmodels = llm_layer(args)
        lref = state(lbase)
        lines.append("| *one 4096 × 14336 layer, K = 3* | | | | | |")
        for method in [m for m in args.methods if m in FACTORING]:
            lm, fb, prepare = data_free(args, lbase, lmodels, method)
            times, last = timed_pair(lm, fb, prepare, args.llm_reps)
            agree = agreement(state(last["lmdx"]), state(last["fusionbench"]), lref)
            lines.append(row(method, times, agree))
            print(lines[-1], flush=True)
    print("\n".join(["", *lines]))


def timed_pair(
    lm: Callable[[], Any], fb: Callable[[], Any], prepare: Callable[[], None] | None, reps: int
) -> tuple[dict[str, list[float]], dict]:
    """lmdx and FusionBench alternated; FusionBench's fresh model pool made untimed."""
    if prepare is not None:
        for _ in range(reps):
            prepare()
    return timed({"lmdx": lm, "fusionbench": fb}, reps)


if __name__ == "__main__":
    main()
