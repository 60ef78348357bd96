"""Import budget: a command imports what it runs and no more.

Importing torch and transformers takes seconds; only collecting statistics (and the
in-memory merge) needs them: a streaming merge reads, merges and writes NumPy arrays.
ml_dtypes (NumPy's bfloat16; 0.8-1.5 s to import in version 0.7.0) is imported only where
a bfloat16 tensor is.
Each command runs in a fresh interpreter (python -m lmdx, through runpy) that then
reports which of torch and transformers it imported.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import hf_models as H
import pytest

RUNNER = """
import json, runpy, sys
report, *argv = sys.argv[1:]
sys.argv = ["lmdx", *argv]
code = 0
try:
    runpy.run_module("lmdx", run_name="__main__", alter_sys=True)
except SystemExit as exc:
    code = exc.code
heavy = sorted({m.split(".")[0] for m in sys.modules} & {"ml_dtypes", "torch", "transformers"})
lmdx = sorted(m for m in sys.modules if m.count(".") == 1 and m.startswith("lmdx."))
with open(report, "w") as f:
    json.dump({"code": code, "heavy": heavy, "lmdx": lmdx}, f)
"""


def _run(tmp: Path, *argv: str, code: int = 0) -> dict[str, Any]:
    """Run ``lmdx ARGV`` in a new interpreter, expecting exit status ``code``: the heavy
    packages (``heavy``) and the modules of lmdx's top level (``lmdx``) it imported, and
    what it wrote on stderr (``stderr``)."""
    report = tmp / "report.json"
    report.unlink(missing_ok=True)
    done = subprocess.run(
        [sys.executable, "-c", RUNNER, str(report), *argv],
        capture_output=True,
        text=True,
        timeout=300,
    )
    result = json.loads(report.read_text())
    assert result["code"] == code, done.stderr
    return {**result, "stderr": done.stderr}


def _imports(tmp: Path, *argv: str) -> list[str]:
    return list(_run(tmp, *argv)["heavy"])


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two tiny BERT classifiers on disk, their Gram statistics, one of them in two parts,
    and a RegMean merge configuration."""
    root = tmp_path_factory.mktemp("startup")
    _, models, batches = H.cached_family("bert", k=2)
    for i, (model, data) in enumerate(zip(models, batches, strict=True)):
        model.save_pretrained(root / f"m{i}")
        H.collect(model, data).save(root / f"s{i}.safetensors")
    for j, part in enumerate((batches[0][:2], batches[0][2:])):
        H.collect(models[0], part).save(root / f"part{j}.safetensors")
    (root / "merge.yaml").write_text(
        "method: regmean\nmodels:\n"
        "  - {path: m0, stats: s0.safetensors}\n  - {path: m1, stats: s1.safetensors}\n"
        "heads: {patterns: ['classifier.*'], policy: keep}\n"
    )
    return root


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        ["info"],
        ["merge", "--help"],
        ["stats", "--help"],
        ["stats", "show", "{root}/s0.safetensors"],
        ["stats", "add", "{root}/part0.safetensors", "{root}/part1.safetensors", "--out", "{out}"],
        ["merge", "{root}/merge.yaml", "--out", "{out}", "--dry-run"],
    ],
    ids=lambda argv: " ".join(a for a in argv if "{" not in a),
)
def test_command_imports_neither_torch_nor_transformers(folder, tmp_path, argv):
    args = [a.format(root=folder, out=tmp_path / "out") for a in argv]
    assert _imports(tmp_path, *args) == []


@pytest.mark.parametrize("argv", [["--help"], ["info"], ["stats", "--help"]])
def test_help_and_info_import_no_subpackage(tmp_path, argv):
    """``import lmdx`` imports its subpackages on first use only."""
    imported = set(_run(tmp_path, *argv)["lmdx"])
    assert not imported & {"lmdx.merge", "lmdx.stats", "lmdx.lmd", "lmdx.data", "lmdx.files"}
    assert "lmdx.cli" in imported


def test_streaming_merge_imports_neither_torch_nor_transformers(folder, tmp_path):
    """A merge of safetensors checkpoints runs on NumPy arrays from reading to writing."""
    heavy = _imports(
        tmp_path, "merge", str(folder / "merge.yaml"), "--out", str(tmp_path / "o"), "--no-progress"
    )
    assert heavy == []
    assert (tmp_path / "o" / "heads" / "1.json").is_file()


def test_the_check_sees_an_import(folder, tmp_path):
    """The in-memory merge loads the models with transformers: the check reports both."""
    out = tmp_path / "m"
    argv = ["merge", str(folder / "merge.yaml"), "--out", str(out), "--in-memory", "--no-progress"]
    assert _imports(tmp_path, *argv) == ["torch", "transformers"]


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["stats", "{tmp}/nope", "{root}/texts.txt", "--out", "{out}"], "MODEL {tmp}/nope"),
        (["stats", "{root}/m0", "{tmp}/nope.txt", "--out", "{out}"], "DATA {tmp}/nope.txt"),
        (["stats", "{root}/m0", "{root}/texts.txt", "--out", "{tmp}/no/s.st"], "--out"),
        (["stats", "show", "{tmp}/nope.safetensors"], "{tmp}/nope.safetensors"),
        (["merge", "{tmp}/nope.yaml", "--out", "{out}"], "{tmp}/nope.yaml"),
        (["merge", "{root}/missing.yaml", "--out", "{out}"], "nope-model"),
        (["decompose", "--embeddings", "{tmp}/a.npy", "{tmp}/b.npy", "--out", "{out}"], "a.npy"),
    ],
    ids=[
        "stats model",
        "stats data",
        "stats out",
        "stats show",
        "merge config",
        "merge model",
        "decompose embeddings",
    ],
)
def test_a_missing_file_or_folder_is_one_line_before_torch(folder, tmp_path, argv, said):
    """A mistyped path is reported before torch or transformers are imported (they take
    seconds): a user hears of it at once, in one line that names it, exit status 2."""
    (folder / "texts.txt").write_text("one text\nanother text\n")
    (folder / "missing.yaml").write_text("method: average\nmodels: [nope-model, m1]\n")
    fill = {"root": folder, "tmp": tmp_path, "out": tmp_path / "out"}
    result = _run(tmp_path, *[a.format(**fill) for a in argv], code=2)
    assert result["heavy"] == [], result["stderr"]
    lines = result["stderr"].strip().splitlines()
    assert len(lines) == 1 and said.format(**fill) in lines[0], lines
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "method", ["task_arithmetic", "ties", "dare", "tsv_m", "iso_c", "della", "wudi", "ties+svc"]
)
def test_a_merge_with_a_base_imports_neither_torch_nor_transformers(folder, tmp_path, method):
    """The base's names are the models' (the common case): nothing asks transformers for a
    backbone prefix, and a BERT has no Conv1D weights to look for (WUDI and SVC read
    transformers' modeling file as text), so a base-using merge of safetensors folders
    stays on NumPy (it took seconds and 0.4 GB to import transformers for that)."""
    config = tmp_path / "base.yaml"
    config.write_text(
        f"method: {method}\nbase: {folder / 'm0'}\nmodels: [{folder / 'm0'}, "
        f"{folder / 'm1'}]\nheads: {{patterns: ['classifier.*'], policy: keep}}\n"
    )
    heavy = _imports(tmp_path, "merge", str(config), "--out", str(tmp_path / "o"), "--no-progress")
    assert heavy == []
