"""The workspace of the ``lmdx stats`` / ``lmdx merge`` command-line tests: K tiny BERT
classifiers saved to disk, texts (whole, in two parts, labelled) and each model's
statistics written by ``lmdx stats``; and a helper they share (the others: hf_models.py)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from lmdx.cli import main
from tiny_bert import random_texts, save_classifiers

K = 3
MODULE = "bert.encoder.layer.1.intermediate.dense"


def build_workspace(root: Path) -> Path:
    """Fill ``root`` (a fresh folder) with the models, texts and statistics; return it."""
    save_classifiers(root, [f"m{i}" for i in range(K)])
    rng = np.random.default_rng(3)
    texts = random_texts(rng, 64)
    (root / "all.txt").write_text("\n".join(texts) + "\n")
    (root / "part1.txt").write_text("\n".join(texts[:32]) + "\n")
    (root / "part2.txt").write_text("\n".join(texts[32:]) + "\n")
    with open(root / "labeled.jsonl", "w") as f:
        for j, t in enumerate(texts):
            f.write(json.dumps({"text": t, "label": j % 2}) + "\n")
    for i in range(K):
        rc = main(
            [
                "stats",
                str(root / f"m{i}"),
                str(root / "all.txt"),
                "--batch-size",
                "8",
                "--out",
                str(root / f"s{i}.safetensors"),
                "--no-progress",
            ]
        )
        assert rc == 0
    return root


def write_config(path: Path, text: str) -> Path:
    path.write_text(text)
    return path
