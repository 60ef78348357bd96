"""Task heads of a merged folder: every kept head's labels (heads/<i>.json) and
lmdx.load_merged(path, task=i), through both front doors (merge_models + save_merged, and
stream_merge).

Model i of the merge is a classifier with its own number of labels, label names and
problem type over one shared body. load_merged(path, task=i) must hold exactly the merged
body (as written to model.safetensors) and model i's own head, carry model i's labels,
and predict exactly what a model assembled here by hand predicts: model i with the merged
body loaded into it.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import hf_models as H
import numpy as np
import pytest
import torch
import transformers
from lmdx import MergeError, load_merged, merge_models, save_merged, stream_merge
from lmdx.files import Checkpoint

pytestmark = pytest.mark.usefixtures("one_torch_thread")

#: Per task: number of labels, label names (None: transformers' defaults, not written to
#: config.json) and problem type.
TASKS = (
    (3, ("world", "sports", "business"), None),
    (2, None, None),
    (4, ("a", "b", "c", "d"), "multi_label_classification"),
)
HEADS = {"bert": "classifier.*", "roberta": "classifier.*"}  # roberta: dense + out_proj


def _task_model(arch: str, base: Any, task: int) -> Any:
    """Model ``task``: ``base``'s body with a head of its own labels, fine-tuned (noise)."""
    n, names, problem = TASKS[task]
    config = copy.deepcopy(base.config)
    config.num_labels = n
    if names is not None:
        config.id2label = dict(enumerate(names))
        config.label2id = {v: k for k, v in enumerate(names)}
    config.problem_type = problem
    torch.manual_seed(100 + task)
    model = type(base)(config).eval()
    body = {k: v for k, v in base.state_dict().items() if not k.startswith("classifier.")}
    missing, unexpected = model.load_state_dict(body, strict=False)
    assert not unexpected and all(k.startswith("classifier.") for k in missing)
    return H.finetuned(model, seed=task)


@pytest.fixture(scope="module", params=sorted(HEADS))
def merged(request, tmp_path_factory) -> dict[str, Any]:
    """Per architecture: the task models, their folders and both front doors' outputs."""
    arch = request.param
    root = tmp_path_factory.mktemp(f"heads-{arch}")
    base = H.build_base(arch)
    models = [_task_model(arch, base, t) for t in range(len(TASKS))]
    stats = []
    for t, model in enumerate(models):
        model.save_pretrained(root / f"m{t}")
        s = H.collect(model, H.random_batches(arch, 10 + t))
        s.save(root / f"s{t}.safetensors")
        stats.append(root / f"s{t}.safetensors")
    heads = [HEADS[arch]]
    folders = [root / f"m{t}" for t in range(len(TASKS))]
    streamed = stream_merge(folders, root / "streamed", stats=stats, heads=heads, progress=False)
    result = merge_models(folders, stats=stats, heads=heads, progress=False)
    in_memory = save_merged(result, root / "in-memory", folders[0], progress=False)
    return {
        "arch": arch,
        "models": models,
        "folders": folders,
        "stats": stats,
        "outputs": {"streaming": streamed.out_dir, "in-memory": in_memory},
        "root": root,
    }


def _body(folder: Path, heads: str) -> dict[str, torch.Tensor]:
    ckpt = Checkpoint(folder)
    return {
        n: torch.from_numpy(ckpt.read(n))
        for n in ckpt.names()
        if not n.startswith(heads.rstrip("*"))
    }


@pytest.mark.parametrize("door", ["streaming", "in-memory"])
@pytest.mark.parametrize("task", range(len(TASKS)))
def test_task_model_is_the_merged_body_with_its_own_head_and_labels(merged, door, task):
    out = merged["outputs"][door]
    own = merged["models"][task]
    head_prefix = HEADS[merged["arch"]].rstrip("*")
    body = _body(out, HEADS[merged["arch"]])
    model = load_merged(out, task=task, progress=False)

    n, _, problem = TASKS[task]
    assert type(model) is type(own) and not model.training
    assert model.config.num_labels == n
    assert model.config.id2label == own.config.id2label
    assert model.config.label2id == own.config.label2id
    assert model.config.problem_type == problem
    state = model.state_dict()
    own_state = own.state_dict()
    for name, value in state.items():
        if name.startswith(head_prefix):
            assert torch.equal(value, own_state[name]), name
        else:
            assert torch.equal(value, body[name]), name
    assert {n for n in state if n.startswith(head_prefix)} == {
        n for n in own_state if n.startswith(head_prefix)
    }

    hand = copy.deepcopy(own)  # model i, its body replaced by the merged body
    missing, unexpected = hand.load_state_dict(body, strict=False)
    assert not unexpected and all(k.startswith(head_prefix) for k in missing)
    with torch.no_grad():
        for batch in H.random_batches(merged["arch"], 50 + task):
            got = model(**batch).logits
            assert got.shape[-1] == n
            assert torch.equal(got, hand(**batch).logits)


@pytest.mark.parametrize("door", ["streaming", "in-memory"])
def test_head_records_carry_each_models_labels(merged, door):
    out = merged["outputs"][door]
    for task, (n, names, problem) in enumerate(TASKS):
        record = json.loads((out / "heads" / f"{task}.json").read_text())
        own = merged["models"][task]
        assert record["format"] == "lmdx-head" and record["task"] == task
        assert record["architecture"] == type(own).__name__
        assert record["path"] == str(merged["folders"][task].absolute())
        assert sorted(record["tensors"]) == sorted(
            k for k in own.state_dict() if k.startswith("classifier.")
        )
        cfg = record["config"]
        assert cfg["problem_type"] == problem
        if names is None and door == "streaming":  # config.json leaves the defaults out
            assert cfg["id2label"] is None and record["num_labels"] is None
        else:
            assert record["num_labels"] == n
            assert {int(k): v for k, v in cfg["id2label"].items()} == own.config.id2label
            assert cfg["label2id"] == own.config.label2id


def test_both_doors_write_the_same_heads(merged):
    a, b = (merged["outputs"][d] for d in ("streaming", "in-memory"))
    for task in range(len(TASKS)):
        ha, hb = (Checkpoint(o / "heads" / f"{task}.safetensors") for o in (a, b))
        assert sorted(ha.names()) == sorted(hb.names())
        assert all(np.array_equal(ha.read(n), hb.read(n)) for n in ha.names())


def test_no_task_loads_the_folder_as_written(merged):
    out = merged["outputs"]["streaming"]
    model = load_merged(out, progress=False)
    direct = transformers.AutoModelForSequenceClassification.from_pretrained(out)
    assert model.config.num_labels == TASKS[0][0]
    a, b = model.state_dict(), direct.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bad_task_index_and_missing_head_files_name_what_to_do(merged, tmp_path):
    out = merged["outputs"]["streaming"]
    with pytest.raises(MergeError, match=r"no head for task 3; it has heads for tasks 0\.\.2"):
        load_merged(out, task=3)
    with pytest.raises(MergeError, match=r"no head for task -1"):
        load_merged(out, task=-1)
    with pytest.raises(MergeError, match=r"task: expected the index of an input model"):
        load_merged(out, task="1")  # type: ignore[arg-type]
    with pytest.raises(MergeError, match=r"no config\.json"):
        load_merged(tmp_path, task=0)

    import shutil

    copy_dir = tmp_path / "copy"
    shutil.copytree(out, copy_dir)
    (copy_dir / "heads" / "1.safetensors").unlink()
    with pytest.raises(MergeError, match=r"heads/1\.safetensors is missing"):
        load_merged(copy_dir, task=1)
    shutil.copy(copy_dir / "heads" / "2.safetensors", copy_dir / "heads" / "1.safetensors")
    record = json.loads((copy_dir / "heads" / "1.json").read_text())
    record["tensors"] = ["classifier.weight"]
    (copy_dir / "heads" / "1.json").write_text(json.dumps(record))
    with pytest.raises(MergeError, match=r"heads/1\.safetensors: holds .* lists"):
        load_merged(copy_dir, task=1)
    (copy_dir / "heads" / "0.json").write_text("{}")
    with pytest.raises(MergeError, match=r"0\.json: not an lmdx head record"):
        load_merged(copy_dir, task=0)


def test_merge_without_kept_heads_says_so(merged, tmp_path):
    out = stream_merge(
        merged["folders"],
        tmp_path / "dropped",
        stats=merged["stats"],
        heads=[HEADS[merged["arch"]]],
        head_policy="drop",
        progress=False,
    ).out_dir
    with pytest.raises(MergeError, match=r"no task heads kept .* load it without task="):
        load_merged(out, task=0)


def test_heads_of_state_dicts_have_unknown_labels(merged, tmp_path):
    states = [m.state_dict() for m in merged["models"]]
    result = merge_models(states, "average", heads=[HEADS[merged["arch"]]], progress=False)
    out = save_merged(result, tmp_path / "from-states", merged["models"][0], progress=False)
    assert json.loads((out / "heads" / "1.json").read_text())["config"] is None
    with pytest.raises(MergeError, match=r"merged as a state dict.*labels are unknown"):
        load_merged(out, task=1)
