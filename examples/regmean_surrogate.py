"""RegMean when some models bring no statistics: the real example's four fine-tuned
all-MiniLM-L6-v2 classifiers merged as their statistics are taken away, one model at a time.

Every merge is RegMean (α 0.9) of the same four models with ``surrogate=True``: a model
given no statistics stands in with a Gram made from its task vector against the
pre-trained encoder, scaled to the trace of the real ones (:mod:`lmdx.merge.surrogate`).
Rows, each scored on every task's test split with that task's own head:

* ``4 real``: every model with its statistics (the real example's ``regmean α=0.9``);
* ``without <tasks>``: the models of those tasks without statistics, removed in the tasks'
  order (bbc, rt, r8, tweets) and then in reverse, down to one model with statistics;
* ``4 surrogate``: no real statistics at all. lmdx's merge needs one model's statistics
  (they set the scale and the layers solved), so this row solves each layer with
  :func:`lmdx.regmean_merge_layer` on the four surrogate Grams at one common scale (any
  common scale gives the same merge), the real statistics naming the layers only;
* ``wudi``: the data-free method on the same kind of surrogate Gram (its ridge toward task
  arithmetic, α 1), for reference.

It reuses the real example's cached fine-tunes and statistics (``examples/regmean_real.py``
trains and collects them on a first run; this script does the same where they are
missing) and takes its options (``--tasks``, ``--stats``, ``--cache``, ...).

Run:  python examples/regmean_surrogate.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import regmean_real as example  # the tasks, fine-tuned models, statistics and scoring

ALPHA = 0.9


def all_surrogate(prep: Any, labels: list[str]) -> Any:
    """The state dict of RegMean on four surrogate Grams: every group of the statistics'
    layers solved by :func:`lmdx.regmean_merge_layer` on ``scaled_surrogate`` of each
    model's task vectors (trace 1, count 1), every other tensor averaged."""
    import torch
    from lmdx import merge_models, regmean_merge_layer
    from lmdx.merge.surrogate import scaled_surrogate

    averaged = merge_models(
        prep.experts, "average", heads=example.HEADS, labels=labels, progress=False, cost=False
    )
    state = dict(averaged.state_dict)
    base = prep.pretrained.state_dict()
    models = [m.state_dict() for m in prep.experts]
    like = prep.grams[0]
    groups: dict[str, list[str]] = {}
    for module, info in like.modules.items():
        groups.setdefault(str(info["group"]), []).append(module)
    for members in groups.values():
        names = [str(like.modules[m]["weight"]) for m in members]
        if any(n.startswith("classifier.") for n in names):
            continue
        weights, grams = [], []
        for model in models:
            taus = [(model[n] - base[n]).double().numpy() for n in names]
            grams.append(scaled_surrogate(taus, 1.0))
            weights.append(np.concatenate([model[n].double().numpy() for n in names], axis=0))
        res = regmean_merge_layer(grams, weights, [1.0] * len(models), alpha=ALPHA)
        row = 0
        for n in names:
            size = base[n].shape[0]
            state[n] = torch.from_numpy(np.asarray(res.weight[row : row + size])).to(base[n].dtype)
            row += size
    averaged.state_dict.clear()
    averaged.state_dict.update(state)
    return averaged


def main() -> None:
    args = example.arg_parser(__doc__.splitlines()[0]).parse_args()
    from lmdx import merge_models

    prep = example.prepare(args)
    tasks, k = prep.tasks, len(prep.tasks)
    labels = [t.name for t in tasks]
    short = [t.short for t in tasks]
    rows: list[tuple[str, Any]] = []

    def regmean(missing: list[int]) -> Any:
        stats = [None if i in missing else prep.grams[i] for i in range(k)]
        return merge_models(
            prep.experts,
            "regmean",
            stats=stats,
            base=prep.pretrained,
            surrogate=True,
            alpha=ALPHA,
            heads=example.HEADS,
            labels=labels,
            progress=False,
            cost=False,
        )

    rows.append((f"{k} real", regmean([])))
    for order in (list(range(k)), list(range(k))[::-1]):
        for m in range(1, k):
            missing = order[:m]
            rows.append((f"without {'+'.join(short[i] for i in missing)}", regmean(missing)))
    rows.append((f"{k} surrogate", all_surrogate(prep, labels)))
    rows.append(
        (
            "wudi (data-free)",
            merge_models(
                prep.experts,
                "wudi",
                base=prep.pretrained,
                heads=example.HEADS,
                labels=labels,
                progress=False,
                cost=False,
            ),
        )
    )
    print()
    print(
        f"Test accuracy (%), {args.test} texts per task, each with its own head; RegMean "
        f"α={ALPHA:g}; statistics: {args.stats} training texts per task where given."
    )
    header = f"{'merge':<26}" + "".join(f"{s:>8}" for s in short) + f"{'mean':>8}"
    print(header)
    print("-" * len(header))
    for name, res in rows:
        t = time.perf_counter()
        accs = prep.score([res.model_state(i) for i in range(k)])
        cells = "".join(f"{100 * a:>8.1f}" for a in accs)
        print(f"{name:<26}{cells}{100 * float(np.mean(accs)):>8.1f}", flush=True)
        example.log(f"  scored {name} in {time.perf_counter() - t:.0f} s")


if __name__ == "__main__":
    main()
