"""lmdx_merge.json names its inputs by normalized paths: a config that reaches its models
through ``..`` (merge/../ft/m0) records ft/m0, and a symbolic link that makes ``..``
lead elsewhere records the folder actually read."""

from __future__ import annotations

import json
import os
from pathlib import Path

import hf_models as H
import pytest
from lmdx.cli import main


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("record")
    _, models, batches = H.cached_family("bert", k=2)
    for i, (model, data) in enumerate(zip(models, batches, strict=True)):
        model.save_pretrained(root / "ft" / f"m{i}")
        H.collect(model, data).save(root / "ft" / f"s{i}.safetensors")
    (root / "merge").mkdir()
    return root


def _paths(record: dict) -> list[str]:
    cfg = record["config"]
    return [
        *record["report"]["models"],
        *record["inputs"],
        *(m["path"] for m in cfg["models"]),
        *(m["stats"] for m in cfg["models"]),
        *(v["stats"] for v in record["inputs"].values()),
    ]


def test_record_folds_dot_dot_away(root: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = root / "merge" / "merge.yaml"
    cfg.write_text(
        "method: regmean\nmodels:\n"
        "  - {path: ../ft/m0, stats: ../ft/./s0.safetensors}\n"
        "  - {path: ../ft/m1, stats: ../merge/../ft/s1.safetensors}\n"
        "heads: {patterns: ['classifier.*']}\n"
    )
    out = root / "merged"
    assert main(["merge", str(cfg), "--out", str(out), "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert (
        f"model i's classifier (i = 0..1, in the config's order): lmdx.load_merged('{out}', task=i)"
        in said
    )
    record = json.loads((out / "lmdx_merge.json").read_text())
    paths = _paths(record)
    assert len(paths) == 10 and all(".." not in p and "/./" not in p for p in paths), paths
    assert record["report"]["models"] == [str(root / "ft" / "m0"), str(root / "ft" / "m1")]
    assert record["config"]["models"][1]["stats"] == str(root / "ft" / "s1.safetensors")


def test_a_link_that_makes_dot_dot_lead_elsewhere_records_the_real_folder(root: Path) -> None:
    # root/link -> root/ft/m0: "link/../m1" is root/ft/m1 on disk, root/m1 as text
    link = root / "link"
    os.symlink(root / "ft" / "m0", link)
    cfg = root / "linked.yaml"
    cfg.write_text("method: average\nmodels: [ft/m0, link/../m1]\n")
    out = root / "merged-linked"
    assert main(["merge", str(cfg), "--out", str(out), "--no-progress"]) == 0
    record = json.loads((out / "lmdx_merge.json").read_text())
    assert record["report"]["models"] == [
        str(root / "ft" / "m0"),
        os.path.realpath(root / "ft" / "m1"),
    ]
    assert not (root / "m1").exists()
