"""bench/bench_methods.py on a user's own folders (tiny BERT classifiers saved to disk, with
labelled validation and test files): every method's grid scored on validation, the best
point chosen there and scored on test; the test accuracies recomputed here from a merge
of the chosen point and the models' own forward pass."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from lmdx import merge_models
from tiny_bert import random_texts, save_classifiers
from transformers import AutoTokenizer, BertForSequenceClassification

ROOT = Path(__file__).resolve().parents[2]
NAMES = ["m0", "m1", "m2"]


@pytest.fixture(scope="module")
def bench():
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import bench_methods
    finally:
        sys.path.remove(str(ROOT / "bench"))
    return bench_methods


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("leaderboard")
    save_classifiers(root, NAMES)
    rng = np.random.default_rng(0)
    for name in NAMES:
        for split, n in (("val", 24), ("test", 40)):
            rows = [
                {"text": t, "label": ["LABEL_0", "LABEL_1"][int(rng.integers(2))]}
                for t in random_texts(rng, n)
            ]
            lines = [json.dumps(r) for r in rows]
            (root / f"{name}-{split}.jsonl").write_text("\n".join(lines) + "\n")
    return root


def _accuracy(model, tokenizer, path: Path) -> float:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    batch = tokenizer([r["text"] for r in rows], padding=True, truncation=True,
                      max_length=64, return_tensors="pt")  # fmt: skip
    with torch.no_grad():
        predicted = model(**batch).logits.argmax(-1).tolist()
    labels = [model.config.label2id[r["label"]] for r in rows]
    return float(np.mean([p == y for p, y in zip(predicted, labels, strict=True)]))


def test_own_folders_choose_on_validation_and_score_on_test(bench, workspace, capsys):
    out = workspace / "leaderboard.json"
    methods = ["average", "ties", "tsv_m+svc", "fisher", "regmean", "regmean_prior"]
    bench.main(
        ["--folders", *(str(workspace / n) for n in NAMES), "--base", str(workspace / "base"),
         "--val-files", *(str(workspace / f"{n}-val.jsonl") for n in NAMES),
         "--test-files", *(str(workspace / f"{n}-test.jsonl") for n in NAMES),
         "--methods", *methods, "--threads", "1", "--json", str(out)]
    )  # fmt: skip
    table = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert set(result["rows"]) == {"average", "ties", "tsv_m+svc"}
    assert set(result["skipped"]) == {"fisher", "regmean", "regmean_prior"}
    assert "`regmean` left out: needs --stats-files" in table
    models = [BertForSequenceClassification.from_pretrained(workspace / n) for n in NAMES]
    tokenizer = AutoTokenizer.from_pretrained(workspace / "m0")
    for i, name in enumerate(NAMES):  # the specialists on their own test files
        own = _accuracy(models[i], tokenizer, workspace / f"{name}-test.jsonl")
        assert result["own"][i] == pytest.approx(own)
    for method, row in result["rows"].items():
        tried = row["tried"]
        assert len(tried) == len(bench.GRIDS[method])
        best = max(range(len(tried)), key=lambda j: (tried[j]["val"], -j))
        assert row["point"] == tried[best]["point"] and row["val"] == tried[best]["val"]
        kw = {"base": workspace / "base"} if method != "average" else {}
        merged = merge_models(models, method, heads=["classifier.*"], progress=False,
                              **kw, **row["point"])  # fmt: skip
        for i, name in enumerate(NAMES):
            model = BertForSequenceClassification.from_pretrained(workspace / name)
            model.load_state_dict(merged.model_state(i))
            test = _accuracy(model.eval(), tokenizer, workspace / f"{name}-test.jsonl")
            assert row["test"][i] == pytest.approx(test), (method, name)
        assert np.mean(row["test"]) == pytest.approx(row["test_mean"])
        se = np.sqrt(sum(a * (1 - a) / 40 for a in row["test"])) / len(NAMES)
        assert row["test_se"] == pytest.approx(se)
        assert row["search_s"] == pytest.approx(sum(e["search_s"] for e in tried))
    assert "| `ties` |" in table


def test_own_folders_errors_name_the_option(bench, workspace):
    with pytest.raises(SystemExit, match=r"--val-files: one per folder \(3\), got 1"):
        bench.main(["--folders", *(str(workspace / n) for n in NAMES),
                    "--val-files", str(workspace / "m0-val.jsonl"), "--test-files",
                    *(str(workspace / f"{n}-test.jsonl") for n in NAMES)])  # fmt: skip
    bad = workspace / "bad.jsonl"
    bad.write_text(json.dumps({"text": "a cat", "label": "spam"}) + "\n")
    with pytest.raises(SystemExit, match=r"bad.jsonl: label 'spam' is neither a label"):
        bench.main(["--folders", str(workspace / "m0"), "--val-files", str(bad),
                    "--test-files", str(bad)])  # fmt: skip
