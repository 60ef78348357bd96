"""The method leaderboard: every lmdx merge method on the real example's four tasks, each
method's hyperparameters chosen on the validation split, scored once on test.

The tasks, the fine-tuned models (one per task, from the pre-trained all-MiniLM-L6-v2),
their statistics and the scoring are the real example's (``examples/regmean_real.py``,
imported: its options are this script's, and its cache of fine-tuned models and statistics
is shared). Then, for every method, each point of a small grid of its hyperparameters
(:data:`GRIDS`: λ / α, density, ridge, ...) is merged and scored on the **validation
split** (texts of the same corpora as the training texts, disjoint from training and test,
never trained on); the point with the best mean validation accuracy (the first of equals,
in grid order) is scored on the **test split**, once. Printed per method: the chosen
point, mean validation and test accuracy, test accuracy per task, the % of the
specialists (mean over tasks of merged / fine-tuned accuracy on the task's own test
split) and the chosen merge's wall and CPU seconds. ``wudi``'s ridge grid is also scored
on test point by point (marked as a measurement, not used to choose): the exact
unregularised closed form (ridge 0) against the ridged ones.

    python bench/bench_methods.py                      # the example's 2-layer fine-tunes
    python bench/bench_methods.py --layers 6 --train 800 --lr 1e-4   # all six layers
    python bench/bench_methods.py --methods ties tsv_m wudi --json leaderboard.json

``slerp`` is left out: it merges two models, these are four (``karcher`` is its
multi-model form).

**On your own folders** (``--folders``): K fine-tuned sequence classifiers (Hugging Face
folders with their tokenizers and labels), the pre-trained folder they came from
(``--base``), and per model a labelled validation and test file (``.jsonl`` or ``.csv``
with a text and a label field; labels as the model's ``label2id`` names them, or their
ids); with ``--stats-files`` (``lmdx stats`` Gram files, one per model) RegMean too::

    python bench/bench_methods.py --folders ft/a ft/b ft/c --base pretrained \
        --val-files a-val.jsonl b-val.jsonl c-val.jsonl \
        --test-files a-test.jsonl b-test.jsonl c-test.jsonl \
        --stats-files a.safetensors b.safetensors c.safetensors --max-length 128

Fisher and RegMean++ need the training data at hand and are left out there.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time
from itertools import product
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import regmean_real as example  # the example: its tasks, models and scoring


def _points(**axes: list[Any]) -> list[dict[str, Any]]:
    """The grid of every combination of the axes' values."""
    keys = list(axes)
    return [dict(zip(keys, values, strict=True)) for values in product(*axes.values())]


#: method -> the hyperparameter points tried on validation (the method's defaults first)
GRIDS: dict[str, list[dict[str, Any]]] = {
    "average": [{}],
    "fisher": [{}],
    "regmean": _points(alpha=[0.9, 1.0]),
    "regmean_plusplus": [{"alpha": 0.9}],
    "task_arithmetic": _points(scaling=[0.3, 0.5, 0.7, 1.0]),
    "ties": _points(density=[0.2, 0.5], scaling=[1.0, 0.7, 0.5]),
    "dare": _points(density=[0.5], scaling=[0.3, 0.5, 0.7]),
    "dare_ties": _points(density=[0.5], scaling=[1.0, 0.7]),
    "breadcrumbs": _points(scaling=[0.3, 0.5, 0.7]),
    "breadcrumbs_ties": _points(scaling=[1.0, 0.7]),
    "della": _points(scaling=[1.0, 0.7]),
    "della_linear": _points(scaling=[0.3, 0.5, 0.7]),
    "model_stock": [{}],
    "karcher": [{}],
    "tsv_m": _points(scaling=[1.0, 0.7, 1.3]),
    "iso_c": _points(scaling=[1.0, 0.7, 1.3, 1.6]),
    "iso_cts": _points(scaling=[1.0, 0.7, 1.3, 1.6]),
    "wudi": [
        {},  # solver spectral, flow_time 1300 (SWUDI's)
        {"flow_time": 300.0},
        {"flow_time": 5000.0},
        {"top_fraction": 0.65},
        *({"solver": "ridge", "ridge": r} for r in (0.1, 0.0, 0.01, 1.0)),
    ],
    "ties+svc": _points(svc_alpha=[0.1, 1.0]),
    "tsv_m+svc": _points(svc_alpha=[0.1, 1.0]),
    "regmean+svc": _points(alpha=[0.9], svc_alpha=[0.1, 1.0]),
    # RegMean with a prior toward a data-free anchor (lmdx.merge.builtin.regmean_prior)
    "regmean_prior": [
        *_points(
            alpha=[0.9],
            prior=["tsv_m", "ties", "wudi", "task_arithmetic"],
            prior_strength=[0.1, 0.3, 1.0, 3.0],
        ),
        *(
            {"alpha": 0.9, "prior": "tsv_m", "prior_strength": {"*.attention.*": a, "*": f}}
            for a, f in ((0.1, 1.0), (1.0, 0.1))
        ),
    ],
}
#: leaderboard rows that are a method with some of its options: row -> the method
ROW_METHOD = {"regmean_prior": "regmean"}
#: methods that merge the task vectors against the pre-trained model
NEEDS_BASE = {
    m for m in GRIDS if m not in {"average", "fisher", "regmean", "regmean_plusplus", "karcher"}
}
#: methods whose every grid point is also scored on test (a measurement, not a choice)
MEASURED_ON_TEST = {"wudi", "regmean_prior"}


class OwnFolders:
    """The leaderboard's inputs from the user's own folders (see the module): the models,
    the base, the statistics if given, and scoring on the labelled files."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        from lmdx import Statistics
        from lmdx.data.files import read_data
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        k = len(args.folders)
        for option in ("val_files", "test_files", "stats_files"):
            given = getattr(args, option)
            if given and len(given) != k:
                flag = "--" + option.replace("_", "-")
                raise SystemExit(f"{flag}: one per folder ({k}), got {len(given)}")
        if not args.val_files or not args.test_files:
            raise SystemExit("--folders: give --val-files and --test-files, one per folder")
        torch.set_num_threads(args.threads or torch.get_num_threads())
        self.args = args
        self.experts = [
            AutoModelForSequenceClassification.from_pretrained(d).eval() for d in args.folders
        ]
        self.tokenizers = [AutoTokenizer.from_pretrained(d) for d in args.folders]
        self.templates = [copy.deepcopy(m) for m in self.experts]
        self.limit: dict[str, int] = {}  # split -> score its first n texts
        self.pretrained = args.base
        self.pretrained_heads: list[Any] = []
        self.grams = [Statistics.load(f) for f in args.stats_files] if args.stats_files else None
        self.fishers = None
        self.tasks = [SimpleNamespace(name=str(d), short=Path(d).name) for d in args.folders]
        self.data: dict[str, list[tuple[list[str], np.ndarray]]] = {}
        for split, files in (("val", args.val_files), ("test", args.test_files)):
            self.data[split] = []
            for model, spec in zip(self.experts, files, strict=True):
                texts, labels, _ = read_data(
                    spec, text_field=args.text_field, label_field=args.label_field
                )
                if labels is None:
                    raise SystemExit(f"{spec}: no {args.label_field!r} label on every text")
                self.data[split].append((texts, label_ids(labels, model.config, spec)))

    def score_task(self, i: int, state: dict[str, Any], split: str = "test") -> float:
        """Accuracy of model ``i``'s architecture with ``state`` on its ``split`` file."""
        import torch

        model, tokenizer = self.templates[i], self.tokenizers[i]
        model.load_state_dict(state, strict=True)
        texts, labels = self.data[split][i]
        n = self.limit.get(split, len(texts))
        texts, labels = texts[:n], labels[:n]
        correct = 0
        for start in range(0, len(texts), 32):
            batch = tokenizer(
                texts[start : start + 32],
                padding=True,
                truncation=True,
                max_length=self.args.max_length,
                return_tensors="pt",
            )
            with torch.no_grad():
                predicted = model(**batch).logits.argmax(-1).numpy()
            correct += int((predicted == labels[start : start + 32]).sum())
        return correct / len(texts)

    def score(self, states: list[dict[str, Any]], split: str = "test") -> list[float]:
        return [self.score_task(i, state, split) for i, state in enumerate(states)]


def label_ids(labels: list[Any], config: Any, spec: str) -> np.ndarray:
    """Labels as the model's ids: names from its ``label2id``, or ids themselves."""
    names = {str(name): int(i) for name, i in (config.label2id or {}).items()}
    out = []
    for label in labels:
        text = str(label)
        if text in names:
            out.append(names[text])
        elif text.isdigit() and int(text) < config.num_labels:
            out.append(int(text))
        else:
            raise SystemExit(
                f"{spec}: label {label!r} is neither a label of the model "
                f"({', '.join(sorted(names))}) nor an id below {config.num_labels}"
            )
    return np.asarray(out)


def texts_scored(prep: Any, split: str) -> list[int]:
    """Per task, the texts of ``split`` scored."""
    if isinstance(prep, OwnFolders):
        sizes = [len(texts) for texts, _ in prep.data[split]]
    else:
        sizes = [len(t.labels[split]) for t in prep.tasks]
    return [min(n, prep.limit.get(split, n)) for n in sizes]


def standard_error(accuracies: list[float], sizes: list[int]) -> float:
    """The standard error of the mean of per-task accuracies, each a binomial proportion
    over its ``sizes`` texts (tasks independent): √(Σ a(1 − a)/n) / tasks."""
    var = sum(a * (1 - a) / n for a, n in zip(accuracies, sizes, strict=True))
    return float(np.sqrt(var) / len(accuracies))


def available(prep: Any, method: str) -> str | None:
    """Why row ``method`` cannot run on these inputs, or None."""
    head = ROW_METHOD.get(method, method).split("+")[0]
    if isinstance(prep, OwnFolders):
        if head in ("fisher", "regmean_plusplus"):
            return "needs the training data (run examples/regmean_real.py's pipeline)"
        if head == "regmean" and prep.grams is None:
            return "needs --stats-files"
        if method in NEEDS_BASE and prep.pretrained is None:
            return "needs --base"
    return None


def merge_kwargs(prep: Any, method: str) -> dict[str, Any]:
    """What row ``method`` needs besides its hyperparameters: statistics, data or the base."""
    head = ROW_METHOD.get(method, method).split("+")[0]
    kw: dict[str, Any] = {"base": prep.pretrained} if method in NEEDS_BASE else {}
    if head == "fisher":
        kw["stats"] = prep.fishers
    elif head == "regmean":
        kw["stats"] = prep.grams
    elif head == "regmean_plusplus":
        kw["data"] = prep.statistics_texts()
        kw["tokenizer"] = prep.tokenizer
        kw["max_length"] = prep.args.max_length
        kw["batch_size"] = 32
    return kw


def merged_states(
    prep: Any, method: str, point: dict[str, Any]
) -> tuple[list[dict[str, Any]], float, float]:
    """The merged model (one state dict per task, with its head) and its wall and CPU s."""
    from lmdx import merge_models

    kw = merge_kwargs(prep, method)
    labels = [t.name for t in prep.tasks]
    wall, cpu = time.perf_counter(), time.process_time()
    res = merge_models(
        prep.experts,
        ROW_METHOD.get(method, method),
        heads=example.HEADS,
        labels=labels,
        progress=False,
        **kw,
        **point,
    )
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return [res.model_state(i) for i in range(len(prep.tasks))], wall, cpu


def _label(point: dict[str, Any]) -> str:
    def said(v: Any) -> str:
        if isinstance(v, dict):
            return "{" + ", ".join(f"{p} {said(x)}" for p, x in v.items()) + "}"
        return f"{v:g}" if isinstance(v, (int, float)) else str(v)

    return ", ".join(f"{k} {said(v)}" for k, v in point.items()) or "defaults"


def leaderboard(prep: Any, methods: list[str], points: int | None = None) -> dict[str, Any]:
    """Every method's grid (its first ``points``) on validation, its best point on test (see
    the module)."""
    tasks = prep.tasks
    expert_states = [m.state_dict() for m in prep.experts]
    heads = [{n: v for n, v in s.items() if n.startswith("classifier.")} for s in expert_states]
    own = [prep.score_task(j, {**expert_states[j], **heads[j]}) for j in range(len(tasks))]
    frozen: list[float] = []
    if prep.pretrained_heads:  # the example's heads trained on the frozen pre-trained encoder
        body = prep.pretrained.state_dict()
        body = {n: v for n, v in body.items() if not n.startswith("classifier.")}
        frozen = prep.score([{**body, **h} for h in prep.pretrained_heads])
    example.log(
        f"specialists on their own test split: {[round(100 * a, 1) for a in own]}, mean "
        f"{100 * np.mean(own):.1f}"
        + (f"; frozen encoder + trained head: mean {100 * np.mean(frozen):.1f}" if frozen else "")
    )
    rows: dict[str, Any] = {}
    skipped: dict[str, str] = {}
    for method in methods:
        why = available(prep, method)
        if why is not None:
            skipped[method] = why
            example.log(f"{method}: left out, {why}")
            continue
        tried = []
        best: tuple[float, dict[str, Any], Any, float, float] | None = None
        for point in GRIDS[method][:points]:
            searched = time.perf_counter()
            states, wall, cpu = merged_states(prep, method, point)
            val = float(np.mean(prep.score(states, "val")))
            searched = time.perf_counter() - searched
            entry: dict[str, Any] = {
                "point": point,
                "val": val,
                "wall_s": wall,
                "cpu_s": cpu,
                "search_s": searched,
            }
            if method in MEASURED_ON_TEST:
                entry["test"] = prep.score(states, "test")
            tried.append(entry)
            example.log(
                f"{method} [{_label(point)}]: val {100 * val:.1f}, merge {wall:.1f} s "
                f"({cpu:.1f} s CPU)"
                + (f"; test {100 * np.mean(entry['test']):.1f}" if "test" in entry else "")
            )
            if best is None or val > best[0]:
                best = (val, point, states, wall, cpu)
            del states
        assert best is not None
        val, point, states, wall, cpu = best
        test = prep.score(states, "test")
        rows[method] = {
            "point": point,
            "val": val,
            "test": test,
            "test_mean": float(np.mean(test)),
            "test_se": standard_error(test, texts_scored(prep, "test")),
            "search_s": sum(e["search_s"] for e in tried),
            "of_specialists": float(np.mean(np.divide(test, own))),
            "wall_s": wall,
            "cpu_s": cpu,
            "tried": tried,
        }
        example.log(f"{method}: chose [{_label(point)}], test {100 * np.mean(test):.1f}")
    return {"own": own, "frozen_head": frozen, "rows": rows, "skipped": skipped}


def print_table(prep: Any, result: dict[str, Any], title: str) -> None:
    tasks, own = prep.tasks, result["own"]
    print()
    print(title)
    sizes = texts_scored(prep, "val")
    print(
        f"Validation: {sizes} texts per task (one text moves the mean by at most "
        f"{100 / (len(sizes) * min(sizes)):.3f} points); standard errors: binomial, per task."
    )
    cols = " | ".join(t.short for t in tasks)
    print(f"| method | chosen on validation | val mean | {cols} | test mean ± s.e. "
          f"| % of specialists | merge s (CPU s) | search: points, s |")  # fmt: skip
    print("|" + "---|" * (len(tasks) + 7))
    print(
        "| specialists (own task) | | | "
        + " | ".join(f"{100 * a:.1f}" for a in own)
        + f" | {100 * np.mean(own):.1f} | 100 | | |"
    )
    frozen = result["frozen_head"]
    if frozen:
        print(
            "| frozen encoder + trained head | | | "
            + " | ".join(f"{100 * a:.1f}" for a in frozen)
            + f" | {100 * np.mean(frozen):.1f} | {100 * np.mean(np.divide(frozen, own)):.1f} | | |"
        )
    ranked = sorted(result["rows"].items(), key=lambda kv: -kv[1]["test_mean"])
    for method, row in ranked:
        print(
            f"| `{method}` | {_label(row['point'])} | {100 * row['val']:.1f} | "
            + " | ".join(f"{100 * a:.1f}" for a in row["test"])
            + f" | **{100 * row['test_mean']:.1f}** ± {100 * row['test_se']:.1f} | "
            f"{100 * row['of_specialists']:.1f} | {row['wall_s']:.1f} ({row['cpu_s']:.1f}) | "
            f"{len(row['tried'])}, {row['search_s']:.0f} |"
        )
    for method, why in result["skipped"].items():
        print(f"`{method}` left out: {why}")
    for method in MEASURED_ON_TEST & set(result["rows"]):
        print(f"\n`{method}`, every point (chosen on validation; test measured, not used):")
        for entry in result["rows"][method]["tried"]:
            print(
                f"  {_label(entry['point'])}: val {100 * entry['val']:.1f}, "
                f"test {100 * np.mean(entry['test']):.1f}"
            )


def main(argv: list[str] | None = None) -> None:
    parser = example.arg_parser(__doc__.splitlines()[0])
    parser.add_argument(
        "--methods", nargs="+", default=list(GRIDS), choices=list(GRIDS), metavar="METHOD"
    )
    parser.add_argument("--json", default=None, help="also write the results to this file")
    parser.add_argument(
        "--points", type=int, default=None, help="only the first N points of each grid"
    )
    parser.add_argument(
        "--score-limit",
        nargs=2,
        type=int,
        default=None,
        metavar=("VAL", "TEST"),
        help="score the first VAL validation and TEST test texts per task (the splits are "
        "shuffled) instead of all: a smaller, faster, noisier leaderboard",
    )
    own = parser.add_argument_group("your own folders (instead of the example's tasks)")
    own.add_argument("--folders", nargs="+", default=None, metavar="DIR")
    own.add_argument("--base", default=None, metavar="DIR", help="the pre-trained folder")
    own.add_argument("--val-files", nargs="+", default=None, metavar="FILE")
    own.add_argument("--test-files", nargs="+", default=None, metavar="FILE")
    own.add_argument("--stats-files", nargs="+", default=None, metavar="FILE")
    own.add_argument("--text-field", default="text")
    own.add_argument("--label-field", default="label")
    args = parser.parse_args(argv)
    import torch

    prep: Any
    if args.folders:
        prep = OwnFolders(args)
        title = f"{len(args.folders)} models; validation {args.val_files}, test {args.test_files}."
    else:
        prep = example.prepare(args)
        title = (
            f"Fine-tuned: top {args.layers} layers + pooler + head, {args.train} texts, "
            f"{args.epochs} epochs, lr {args.lr:g}; statistics {args.stats} texts per task; "
            f"validation {args.val}, test {args.test} texts per task."
        )
    if args.score_limit:
        prep.limit.update(val=args.score_limit[0], test=args.score_limit[1])
        title += f" Scored on the first {args.score_limit[0]} / {args.score_limit[1]} of them."
    example.log(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch and lmdx "
        f"threads {torch.get_num_threads()}; load {os.getloadavg()}"
    )
    from threadpoolctl import threadpool_limits

    with threadpool_limits(limits=torch.get_num_threads()):  # NumPy's BLAS too (the SVDs)
        result = leaderboard(prep, args.methods, args.points)
    example.log(f"load {os.getloadavg()}")
    print_table(prep, result, title)
    if args.json:
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        Path(args.json).write_text(json.dumps({"settings": settings, **result}, indent=1) + "\n")


if __name__ == "__main__":
    main()
