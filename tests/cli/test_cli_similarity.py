"""``lmdx decompose --measures``: the similarity measures in result.json, results.csv and
the heatmaps, against float64 references computed here from the .npy files on the rows
of each split (the documented seeded permutation: train, then validation, then test)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
from lmdx.cli import main
from lmdx.cli.decompose import split_counts
from similarity_reference import ref_cka, ref_debiased_cka, ref_procrustes

N = 400
SEED = 3
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    rng = np.random.default_rng(11)
    folder = tmp_path_factory.mktemp("emb")
    a = rng.standard_normal((N, 7)) + 2.0
    b = np.tanh(a @ rng.standard_normal((7, 5))) + 0.2 * rng.standard_normal((N, 5))
    c = rng.standard_normal((N, 9))
    paths = []
    for name, x in (("a", a), ("b", b), ("c", c)):
        paths.append(folder / f"{name}.npy")
        np.save(paths[-1], x)
    return paths


def _split_rows(splits: str = "0.8,0.1,0.1") -> dict[str, np.ndarray]:
    counts = split_counts(N, [float(f) for f in splits.split(",")])
    order = np.random.default_rng(SEED).permutation(N)
    cuts = np.cumsum([0, *counts.values()])
    out = {s: order[lo:hi] for s, lo, hi in zip(counts, cuts[:-1], cuts[1:], strict=True)}
    out["all"] = order
    return out


def test_all_measures_are_written_and_exact(files: list[Path], tmp_path: Path, capsys) -> None:
    out = tmp_path / "lmd"
    argv = ["decompose", "--embeddings", *map(str, files), "--seed", str(SEED)]
    assert main([*argv, "--measures", "all", "--folds", "4", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Similarity of each pair (all rows, n = 400" in text
    doc = json.loads((out / "result.json").read_text())["similarity"]
    assert doc["measures"] == [
        "cka", "debiased_cka", "cca", "svcca", "pwcca", "procrustes", "cv_r2"
    ]  # fmt: skip
    assert doc["cv_r2"]["folds"] == 4 and doc["cv_r2"]["rows_per_fold"] == [100] * 4
    data = [np.load(f) for f in files]
    for split, rows in _split_rows().items():
        tables = doc["splits"][split]["tables"]
        assert doc["splits"][split]["n"] == len(rows)
        x, y, z = (d[rows] for d in data)
        assert tables["cka"][0][1] == pytest.approx(ref_cka(x, y), rel=1e-10)
        assert tables["debiased_cka"][2][1] == pytest.approx(ref_debiased_cka(z, y), abs=1e-10)
        assert tables["procrustes"][0][2] == pytest.approx(ref_procrustes(x, z), rel=1e-10)
    for measure in doc["measures"]:
        assert (out / f"heatmap_{measure}.png").read_bytes()[:8] == PNG_MAGIC
    with (out / "results.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    svcca = [r for r in rows if r["kind"] == "svcca" and r["split"] == "all"]
    assert len(svcca) == 6
    row = next(r for r in svcca if (r["target"], r["basis"]) == ("b", "a"))
    assert float(row["value"]) == pytest.approx(doc["splits"]["all"]["tables"]["svcca"][1][0])


def test_default_measures_are_the_cheap_ones(files: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "lmd"
    argv = ["decompose", "--embeddings", *map(str, files[:2]), "--no-plots", "--out", str(out)]
    assert main(argv) == 0
    doc = json.loads((out / "result.json").read_text())
    assert doc["similarity"]["measures"] == [
        "cka", "debiased_cka", "cca", "svcca", "pwcca", "procrustes"
    ]  # fmt: skip
    assert doc["similarity"]["cv_r2"] is None
    assert sorted(p.name for p in out.iterdir()) == ["result.json", "results.csv"]


def test_measures_none_writes_no_similarity(files: list[Path], tmp_path: Path) -> None:
    out = tmp_path / "lmd"
    argv = ["decompose", "--embeddings", *map(str, files[:2]), "--measures", "none"]
    assert main([*argv, "--out", str(out)]) == 0
    assert "similarity" not in json.loads((out / "result.json").read_text())
    assert not list(out.glob("heatmap_*.png")) and (out / "heatmap.png").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["--measures", "cka,ckka"],
            "--measures: unknown measure 'ckka'; use 'all' or any of cka,",
        ),
        (["--folds", "1"], "--folds: must be >= 2, got 1"),
        (["--svcca-variance", "0"], "--svcca-variance: must be in (0, 1], got 0.0"),
    ],
)
def test_bad_measure_arguments_are_one_line_errors(
    files: list[Path], tmp_path: Path, capsys, extra: list[str], message: str
) -> None:
    argv = ["decompose", "--embeddings", *map(str, files), "--out", str(tmp_path / "o"), *extra]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
