"""The merging page's (docs/guide/merging.md) "Merging Hugging Face models" section runs as
written: its shell commands (every ``lmdx`` line of the first bash block, in order), its
merge.yaml and the Python that predicts with task i's merged classifier, on three tiny BERT
classifiers standing in for the fine-tuned models, in the folder names and data files the
page uses; and so do its "Without statistics" section (ties.yaml over the bare pre-trained
encoder, lmdx merge) and
its RegMean++ section (merge-pp.yaml, lmdx merge)."""

from __future__ import annotations

import ast
import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest
from doc_blocks import CLASSIFIERS, ROOT, classifiers
from lmdx.cli import main
from safetensors.numpy import load_file
from task_vectors import ref_merge
from transformers import BertForSequenceClassification

PAGE = ROOT / "docs" / "guide" / "merging.md"
#: The page's three classifiers: folder -> labels.
MODELS = CLASSIFIERS


def _section(title: str = "Merging Hugging Face models") -> str:
    """The page's ``## title`` section, up to the next ``## `` heading."""
    text = PAGE.read_text(encoding="utf-8")
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def _blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.S)


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    classifiers(tmp_path)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_merging_section_runs(workspace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    section = _section()
    (yaml_block,) = _blocks(section, "yaml")
    assert yaml_block.startswith("# merge.yaml")
    (workspace / "merge.yaml").write_text(yaml_block)

    commands = [
        shlex.split(line, comments=True) for line in _blocks(section, "bash")[0].splitlines()
    ]
    commands = [c for c in commands if c]
    assert [c[:2] for c in commands][-2:] == [["lmdx", "merge"], ["lmdx", "merge"]]
    assert len(commands) >= 8
    for argv in commands:
        assert argv[0] == "lmdx", argv
        assert main(argv[1:]) == 0, (argv, capsys.readouterr().err)
    assert not (workspace / "merged" / ".tmp").exists()
    heads = json.loads((workspace / "merged" / "heads" / "2.json").read_text())
    assert heads["model"].endswith("finetuned/tweets") and heads["num_labels"] == 3

    (predict,) = [b for b in _blocks(section, "python") if 'load_merged("merged"' in b]
    capsys.readouterr()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(predict, str(PAGE), "exec"), {})
    shown = ast.literal_eval(printed.getvalue().strip().splitlines()[-1])
    assert len(shown) == 2 and set(shown) <= set(MODELS["tweets"]), shown


def test_task_vector_section_runs(workspace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The "Without statistics" section: its ties.yaml over the bare pre-trained encoder
    and lmdx merge line; the merged body is the TIES formula of the page's table, against
    the base's own tensors, and the command says what the base lacks."""
    section = _section("Without statistics: task arithmetic, TIES and DARE")
    assert _blocks(section, "python") == []  # the pre-trained folder is the base as it is
    (yaml_block,) = _blocks(section, "yaml")
    assert yaml_block.startswith("# ties.yaml")
    (workspace / "ties.yaml").write_text(yaml_block)
    (command,) = [shlex.split(line) for line in _blocks(section, "bash")[0].splitlines()]
    assert command[:2] == ["lmdx", "merge"]
    assert main(command[1:]) == 0
    said = capsys.readouterr().out
    assert "its tensors read as the models' bert.* (base_model_prefix); lacks the task " in said
    out = workspace / command[command.index("--out") + 1]
    name = "bert.encoder.layer.1.attention.self.query.weight"
    bare = name.removeprefix("bert.")
    base = load_file(str(workspace / "pretrained" / "model.safetensors"))[bare]
    thetas = [
        load_file(str(workspace / "finetuned" / m / "model.safetensors"))[name] for m in MODELS
    ]
    expected = ref_merge("ties", name, base.astype(np.float64), thetas, None, 0.2, 1.0)
    got = load_file(str(out / "model.safetensors"))[name].astype(np.float64)
    assert np.abs(got - expected).max() <= 1e-6 * np.abs(expected).max()
    model = BertForSequenceClassification.from_pretrained(str(out))
    assert model.config.num_labels == len(MODELS["bbc"])


def test_regmean_plusplus_section_runs(workspace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The RegMean++ section's command and merge-pp.yaml, on the same stand-ins."""
    section = _section("RegMean++")
    (yaml_block,) = _blocks(section, "yaml")
    assert yaml_block.startswith("# merge-pp.yaml")
    (workspace / "merge-pp.yaml").write_text(yaml_block)
    (bash,) = _blocks(section, "bash")
    commands = [shlex.split(line, comments=True) for line in bash.splitlines()]
    commands = [c for c in commands if c]
    assert commands == [["lmdx", "merge", "merge-pp.yaml", "--out", "merged-pp"]]
    for argv in commands:
        assert main(argv[1:]) == 0, (argv, capsys.readouterr().err)
    record = json.loads((workspace / "merged-pp" / "lmdx_merge.json").read_text())
    assert record["report"]["method"] == "regmean_plusplus"
    assert record["report"]["regmean_plusplus"]["blocks"] == 2
    assert json.loads((workspace / "merged-pp" / "heads" / "1.json").read_text())["num_labels"] == 4
