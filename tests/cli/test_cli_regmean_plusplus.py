"""``lmdx merge`` with ``method: regmean_plusplus`` end to end on tiny BERT classifiers saved
to disk, each model with its own data file (read as ``lmdx stats`` reads DATA).

The numbers are checked against the Python API (whose float64 reference is in
tests/merge/test_regmean_plusplus.py): the CLI must give the very same tensors.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from lmdx import merge_models
from lmdx._tensors import to_torch
from lmdx.cli import main
from lmdx.files import Checkpoint
from tiny_bert import random_texts, save_classifiers

K = 3


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("merge-pp-cli")
    save_classifiers(root, [f"m{i}" for i in range(K)])
    rng = np.random.default_rng(3)
    (root / "d0.txt").write_text("\n".join(random_texts(rng, 30)) + "\n")
    with open(root / "d1.jsonl", "w") as f:
        for t in random_texts(rng, 30):
            f.write(json.dumps({"text": t, "label": 0}) + "\n")
    (root / "d2.csv").write_text("headline\n" + "\n".join(random_texts(rng, 30)) + "\n")
    return root


CONFIG = """\
method: regmean_plusplus
models:
  - {path: m0, data: d0.txt}
  - {path: m1, data: d1.jsonl}
  - {path: m2, data: d2.csv, text_field: headline}
alpha: 0.9
max_texts: 25
max_length: 12
batch_size: 8
heads: {patterns: ["classifier.*"], policy: keep}
"""


def _config(root: Path, name: str, body: str) -> Path:
    path = root / name
    path.write_text(body)
    return path


def _texts_of(root: Path) -> list[list[str]]:
    t0 = (root / "d0.txt").read_text().split("\n")
    t1 = [json.loads(line)["text"] for line in (root / "d1.jsonl").read_text().splitlines()]
    t2 = (root / "d2.csv").read_text().splitlines()[1:]
    return [[t for t in texts if t][:25] for texts in (t0, t1, t2)]


def test_merge_config_runs_regmean_plusplus(
    workspace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _config(workspace, "pp.yaml", CONFIG)
    out = workspace / "merged"
    assert main(["merge", str(cfg), "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "regmean_plusplus of 3 models" in printed
    api = merge_models(
        [workspace / f"m{i}" for i in range(K)],
        "regmean_plusplus",
        data=_texts_of(workspace),
        max_length=12,
        batch_size=8,
        alpha=0.9,
        heads=["classifier.*"],
        progress=False,
    )
    written = Checkpoint(out)
    state = api.model_state(0)
    assert set(written.names()) == set(state)
    for name in written.names():
        assert torch.equal(to_torch(written.read(name)), state[name]), name
    record = json.loads((out / "lmdx_merge.json").read_text())
    assert record["config"]["method"] == "regmean_plusplus"
    assert record["config"]["models"][2]["text_field"] == "headline"
    run = record["report"]["regmean_plusplus"]
    assert run["blocks"] == 2 and run["batches"] == [4, 4, 4]  # 25 texts, 8 per batch
    assert (out / "heads" / "2.safetensors").is_file()

    in_memory = workspace / "merged-in-memory"
    args = ["merge", str(cfg), "--out", str(in_memory), "--in-memory", "--no-progress"]
    assert main(args) == 0
    for name in written.names():
        assert torch.equal(
            to_torch(Checkpoint(in_memory).read(name)), to_torch(written.read(name))
        ), name

    assert main(["merge", str(cfg), "--out", str(workspace / "plan"), "--dry-run"]) == 0
    plan = capsys.readouterr().out
    assert "regmean_plusplus" in plan and "block" in plan
    assert not (workspace / "plan").exists()


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (
            CONFIG.replace(", data: d0.txt", ""),
            "models[0].data: method regmean_plusplus needs each model's data",
        ),
        (CONFIG.replace("d1.jsonl", "nope.jsonl"), "models[1].data"),
        (CONFIG.replace("d0.txt", "corpus:nope"), "unknown corpus 'nope'"),
        (CONFIG.replace("d0.txt}", "d0.txt, stats: d0.txt}"), "takes no statistics"),
        (
            CONFIG.replace("method: regmean_plusplus", "method: average").replace(
                "max_texts: 25\n", ""
            ),
            "models[0].data: only method regmean_plusplus takes data, not average",
        ),
        (
            "method: average\nmodels: [m0, m1]\nmax_length: 12\n",
            "max_length is only used by method regmean_plusplus",
        ),
        (CONFIG.replace("max_texts: 25", "max_texts: 0"), "max_texts must be a whole number"),
        (CONFIG.replace("batch_size: 8", "batch_size: true"), "batch_size"),
        (CONFIG.replace("alpha: 0.9", "alpha: 0.9\nmax_activation_memory: lots"), "max_activation"),
        (CONFIG.replace("d0.txt", "empty.txt"), r"models\[0\]\.data: DATA .*empty\.txt: no texts"),
    ],
)
def test_regmean_plusplus_config_errors(
    workspace: Path, body: str, match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (workspace / "empty.txt").write_text("\n")
    cfg = _config(workspace, "bad.yaml", body)
    out = workspace / "bad-out"
    assert main(["merge", str(cfg), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lmdx merge: error: ") and err.count("\n") == 1, err
    assert re.search(match if "*" in match else re.escape(match), err), err
    assert not out.exists()
