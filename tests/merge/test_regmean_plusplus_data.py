"""RegMean++ with data options per model: each model's texts cut at its own ``max_length``
(and limited to its own ``max_texts``), next to its data, in the Python API and in a merge
configuration.

The reference tokenizes each model's texts itself, with the Hugging Face tokenizer saved
in the model folders, at that model's length, and merges those batches (the batches path,
checked against a float64 reimplementation in tests/merge/test_regmean_plusplus.py): the
texts with per-model options must give the very same tensors. The same merge with one
length for both models must not (the options are not ignored).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from lmdx import MergeError, merge_models
from lmdx._tensors import to_torch
from lmdx.cli import main
from lmdx.files import Checkpoint
from tiny_bert import random_texts, save_classifiers
from transformers import AutoTokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")

LENGTHS = (5, 12)  # tokens: the random texts run to 15, so 5 cuts most of them
BATCH = 8


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("pp-data")
    save_classifiers(root, ["m0", "m1"])
    rng = np.random.default_rng(11)
    for i in range(2):
        (root / f"d{i}.txt").write_text("\n".join(random_texts(rng, 20)) + "\n")
    return root


def _texts(root: Path, i: int) -> list[str]:
    return [t for t in (root / f"d{i}.txt").read_text().split("\n") if t]


def _batches(root: Path, texts: list[str], max_length: int) -> list[dict[str, torch.Tensor]]:
    """The texts tokenized here, at ``max_length``, BATCH per batch, padded."""
    tokenizer = AutoTokenizer.from_pretrained(str(root / "m0"))
    return [
        dict(
            tokenizer(
                texts[s : s + BATCH],
                padding=True,
                truncation=True,
                max_length=max_length,
                return_tensors="pt",
            )
        )
        for s in range(0, len(texts), BATCH)
    ]


def _merge(root: Path, data: list, **kwargs) -> dict[str, torch.Tensor]:
    result = merge_models(
        [root / "m0", root / "m1"],
        "regmean_plusplus",
        data=data,
        batch_size=BATCH,
        alpha=0.9,
        heads=["classifier.*"],
        progress=False,
        n_threads=1,
        **kwargs,
    )
    return result.model_state(0)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    assert set(a) == set(b)
    return all(torch.equal(a[n], b[n]) for n in a)


def test_each_model_is_cut_at_its_own_max_length(workspace: Path) -> None:
    t0, t1 = _texts(workspace, 0), _texts(workspace, 1)
    own = _merge(
        workspace,
        [{"texts": t0, "max_length": LENGTHS[0]}, {"texts": t1, "max_length": LENGTHS[1]}],
        max_length=64,  # the length for all, replaced by each model's own
    )
    reference = _merge(
        workspace,
        [_batches(workspace, t0, LENGTHS[0]), _batches(workspace, t1, LENGTHS[1])],
    )
    assert _same(own, reference)
    one_length = _merge(workspace, [t0, t1], max_length=LENGTHS[1])
    assert not _same(own, one_length)
    # a model that sets none of its own (or None) uses the options for all
    mixed = _merge(
        workspace,
        [{"texts": t0, "max_length": LENGTHS[0]}, {"texts": t1, "max_length": None}],
        max_length=LENGTHS[1],
    )
    assert _same(mixed, reference)


def test_each_model_takes_its_own_max_texts(workspace: Path) -> None:
    t0, t1 = _texts(workspace, 0), _texts(workspace, 1)
    own = _merge(workspace, [{"texts": t0, "max_texts": 9}, t1], max_texts=16, max_length=12)
    reference = _merge(
        workspace, [_batches(workspace, t0[:9], 12), _batches(workspace, t1[:16], 12)]
    )
    assert _same(own, reference)


@pytest.mark.parametrize(
    ("entry", "match"),
    [
        ({"texts": ["a cat"], "max_len": 4}, r"data\[0\] \(of .*m0\): unknown key 'max_len'"),
        ({"max_length": 4}, r"data\[0\] .*'texts' must be a list of texts, got NoneType"),
        ({"texts": "a cat sat"}, r"'texts' must be a list of texts, got str"),
        ({"texts": ["a cat"], "max_length": 0}, r"data\[0\] .*: max_length: expected a whole"),
        ({"texts": ["a cat"], "max_texts": True}, r"max_texts: expected a whole number"),
        ({"texts": []}, r"data\[0\] \(of .*m0\): no texts or batches"),
    ],
)
def test_bad_model_data_entries(workspace: Path, entry: dict, match: str) -> None:
    with pytest.raises(MergeError, match=match):
        _merge(workspace, [entry, ["a dog ran"]])


CONFIG = """\
method: regmean_plusplus
models:
  - {{path: m0, data: d0.txt, max_length: {l0}, max_texts: 9}}
  - {{path: m1, data: d1.txt}}
alpha: 0.9
max_length: {l1}
batch_size: {batch}
heads: {{patterns: ["classifier.*"], policy: keep}}
"""


def test_config_takes_per_model_data_options(
    workspace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = workspace / "pp.yaml"
    cfg.write_text(CONFIG.format(l0=LENGTHS[0], l1=LENGTHS[1], batch=BATCH))
    out = workspace / "merged"
    assert main(["merge", str(cfg), "--out", str(out), "--no-progress"]) == 0
    t0, t1 = _texts(workspace, 0), _texts(workspace, 1)
    reference = _merge(
        workspace, [_batches(workspace, t0[:9], LENGTHS[0]), _batches(workspace, t1, LENGTHS[1])]
    )
    written = Checkpoint(out)
    assert set(written.names()) == set(reference)
    for name in written.names():
        assert torch.equal(to_torch(written.read(name)), reference[name]), name
    record = json.loads((out / "lmdx_merge.json").read_text())
    models = record["config"]["models"]
    assert (models[0]["max_length"], models[0]["max_texts"]) == (LENGTHS[0], 9)
    assert (models[1]["max_length"], models[1]["max_texts"]) == (None, None)


@pytest.mark.parametrize(
    ("body", "match"),
    [
        (
            "method: average\nmodels:\n  - {path: m0, max_length: 8}\n  - m1\n",
            r"models\[0\]\.max_length: only method regmean_plusplus takes data, not average",
        ),
        (
            "method: average\nmodels:\n  - m0\n  - {path: m1, max_texts: 8}\n",
            r"models\[1\]\.max_texts: only method regmean_plusplus takes data, not average",
        ),
        (
            CONFIG.format(l0=0, l1=12, batch=8),
            r"models\[0\]\.max_length .*greater than or equal to 1, got 0",
        ),
        (
            CONFIG.format(l0="true", l1=12, batch=8),
            r"models\[0\]\.max_length .*, got True",
        ),
    ],
)
def test_per_model_data_option_errors(
    workspace: Path, body: str, match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = workspace / "bad.yaml"
    cfg.write_text(body)
    assert main(["merge", str(cfg), "--out", str(workspace / "never"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lmdx merge: error: ") and err.count("\n") == 1, err
    assert re.search(match, err), err
    assert not (workspace / "never").exists()
