"""LMD results (lmdx.lmd.results): tables, result.json and results.csv."""

from __future__ import annotations

import csv
import json

import lmdx
import pytest
from lmd_reference import decomposition, three_splits


def test_result_tables_json_and_csv(rng, tmp_path):
    names = ["bert", "roberta", "gpt2"]
    data = three_splits(rng, [300, 80, 80], [3, 2, 4])
    dec = decomposition(names, data, seed=7)
    res = dec.fit()
    assert len(res.pairwise) == 6 and len(res.group) == 3
    table = res.r2_target_by_basis("validation")
    for fit in res.pairwise:
        a, b = names.index(fit.target[0]), names.index(fit.basis[0])
        assert table[a, b] == fit.r2["validation"]
    one = dec.fit_one("gpt2", "bert")
    assert table[2, 0] == pytest.approx(one.r2["validation"], rel=1e-12)
    assert "target" in res.orientation and "columns are bases" in res.orientation

    doc = json.loads(res.to_json(tmp_path / "lmd.json"))
    assert doc == json.loads((tmp_path / "lmd.json").read_text(encoding="utf-8"))
    assert doc["models"] == [{"name": n, "dim": d} for n, d in zip(names, [3, 2, 4], strict=True)]
    assert doc["n"] == {"train": 300, "validation": 80, "test": 80}
    assert doc["seed"] == 7 and doc["lmdx_version"] == lmdx.__version__
    assert doc["regularization"]["rho_grid"] == list(lmdx.lmd.DEFAULT_RIDGE_GRID)
    assert doc["pairwise"][0]["target"] == ["bert"] and doc["pairwise"][0]["basis"] == ["roberta"]
    assert doc["dependency"]["test"] == pytest.approx(res.dependency("test"))
    assert all(isinstance(g["rho"], float) and g["lambda"] > 0 for g in doc["group"])

    res.to_csv(tmp_path / "lmd.csv")
    with open(tmp_path / "lmd.csv", newline="", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    assert len([r for r in rows if r["kind"] in ("pairwise", "group")]) == (6 + 3) * 3
    row = next(
        r
        for r in rows
        if r["kind"] == "pairwise"
        and r["target"] == "gpt2"
        and r["basis"] == "bert"
        and r["split"] == "test"
    )
    assert float(row["r2"]) == res.r2_target_by_basis("test")[2, 0]
    assert int(row["n"]) == 80
    group_row = next(r for r in rows if r["kind"] == "group" and r["target"] == "bert")
    assert group_row["basis"] == "roberta;gpt2"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lmd.csv", "lmd.json"]
