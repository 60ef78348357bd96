"""What a merged folder gives its users beyond the weights: a model card (README.md) and,
on request, one complete model folder per kept head (tasks/<i>/).

Content hashes are recomputed here from the input files with hashlib and the
safetensors library; predictions of the task folders are compared with
``lmdx.load_merged(path, task=i)``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import blake3
import hf_models as H
import numpy as np
import pytest
import torch
from lmdx import MergeError, load_merged, merge_models, save_merged, stream_merge
from lmdx.cli import main
from safetensors import safe_open
from safetensors.numpy import load_file
from transformers import AutoModelForSequenceClassification

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 3


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("tasks")
    _, models = H.family("bert", K)
    paths, stats = [], []
    for i, model in enumerate(models):
        n = H.NUM_LABELS + i  # every task its own number of labels
        model.classifier = torch.nn.Linear(H.HIDDEN, n)
        model.num_labels = n
        labels = [f"task{i}-label{j}" for j in range(n)]
        model.config.id2label = dict(enumerate(labels))
        model.config.label2id = {name: j for j, name in enumerate(labels)}
        model.save_pretrained(root / f"m{i}")
        H.collect(model, H.random_batches("bert", 10 + i), exclude=["classifier*"]).save(
            root / f"s{i}.safetensors"
        )
        paths.append(root / f"m{i}")
        stats.append(root / f"s{i}.safetensors")
    return {"root": root, "models": models, "paths": paths, "stats": stats}


def _content_sha256(folder: Path) -> str:
    """SHA-256 over ``name:dtype:shape:blake3;`` of every stored tensor, in name order."""
    total = hashlib.sha256()
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        for name in sorted(f.keys()):
            t = f.get_tensor(name)
            h = blake3.blake3(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
            dtype = str(t.dtype).removeprefix("torch.")
            total.update(f"{name}:{dtype}:{list(t.shape)}:{h};".encode())
    return total.hexdigest()


def _stats_identity(path: Path) -> str:
    """SHA-256 over ``metadata:<hash>;`` then ``name:<hash>;`` of every tensor in name
    order, the hashes a statistics file holds, each checked here against what it names."""
    with safe_open(str(path), "np") as f:
        meta = json.loads(f.metadata()["lmdx"])
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    hashes = meta["blake3"]
    total = hashlib.sha256(f"metadata:{hashes['metadata']};".encode())
    for name in sorted(tensors):
        assert (
            blake3.blake3(tensors[name].astype("<f8").tobytes()).hexdigest()
            == (hashes["tensors"][name])
        )
        total.update(f"{name}:{hashes['tensors'][name]};".encode())
    return total.hexdigest()


def _logits(model: Any, batches: list[dict[str, Any]]) -> np.ndarray:
    with torch.no_grad():
        return torch.cat([model(**b).logits for b in batches]).numpy()


def test_task_folders_load_and_predict_as_load_merged(folders, tmp_path):
    res = stream_merge(
        folders["paths"], tmp_path / "merged", stats=folders["stats"], alpha=0.9,
        heads=["classifier.*"], task_folders=True, progress=False,
    )  # fmt: skip
    out = res.out_dir
    assert out is not None
    batches = H.random_batches("bert", 99)
    for i in range(K):
        task = AutoModelForSequenceClassification.from_pretrained(str(out / "tasks" / str(i)))
        assert task.config.id2label == folders["models"][i].config.id2label
        assert task.classifier.out_features == H.NUM_LABELS + i
        assert np.array_equal(
            _logits(task.eval(), batches), _logits(load_merged(out, task=i), batches)
        )
        assert sorted(p.name for p in (out / "tasks" / str(i)).iterdir()) == [
            "README.md",
            "config.json",
            "model.safetensors",
        ]
    assert json.loads((out / "lmdx_merge.json").read_text())["task_folders"] == [
        f"tasks/{i}" for i in range(K)
    ]
    # the same folders from the in-memory front door
    result = merge_models(
        folders["models"], stats=[str(s) for s in folders["stats"]], alpha=0.9,
        heads=["classifier.*"], labels=[str(p) for p in folders["paths"]], progress=False,
    )  # fmt: skip
    again = save_merged(result, tmp_path / "again", folders["paths"][0], task_folders=True)
    for i in range(K):
        a = load_file(str(out / "tasks" / str(i) / "model.safetensors"))
        b = load_file(str(again / "tasks" / str(i) / "model.safetensors"))
        assert a.keys() == b.keys() and all(np.array_equal(a[n], b[n]) for n in a)


def test_task_folders_need_kept_heads(folders, tmp_path):
    with pytest.raises(MergeError, match="per-task folders: the merge kept no task heads"):
        stream_merge(
            folders["paths"], tmp_path / "o", "average", heads=["classifier.*"],
            head_policy="drop", task_folders=True, progress=False,
        )  # fmt: skip
    assert not (tmp_path / "o").exists()


def test_model_card_names_method_inputs_hashes_and_command(folders, tmp_path):
    root = folders["root"]
    lines = ["method: regmean", "alpha: 0.9", "models:"]
    for p, s in zip(folders["paths"], folders["stats"], strict=True):
        lines.append(f"  - {{path: {p}, stats: {s}}}")
    lines += ["heads: {patterns: ['classifier.*']}"]
    (tmp_path / "merge.yaml").write_text("\n".join(lines) + "\n")
    out = tmp_path / "merged"
    argv = ["merge", str(tmp_path / "merge.yaml"), "--out", str(out), "--per-task-folders",
            "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    card = (out / "README.md").read_text()
    record = json.loads((out / "lmdx_merge.json").read_text())
    assert "**regmean** of 3 models" in card and "- `alpha`: 0.9" in card
    assert f"lmdx merge {tmp_path / 'merge.yaml'} --out {out} --per-task-folders" in card
    assert record["config"]["heads"]["per_task_folders"] is True
    assert record["command"] == "lmdx " + " ".join(argv)
    assert '"alpha": 0.9' in card  # the configuration
    for p, s in zip(folders["paths"], folders["stats"], strict=True):
        entry = record["inputs"][str(p)]
        assert entry["weights_sha256"] == _content_sha256(p)
        assert entry["stats_sha256"] == _stats_identity(s)
        row = next(line for line in card.splitlines() if f"| {p} |" in line)
        assert f"`{entry['weights_sha256'][:16]}…`" in row
        assert f"`{entry['stats_sha256'][:16]}…`" in row
    assert 'BertForSequenceClassification.from_pretrained("PATH/tasks/i")' in card
    assert (out / "tasks" / "1" / "README.md").read_text().count(str(folders["paths"][1])) == 1
    assert root.exists()
