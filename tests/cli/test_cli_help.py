"""What a new user reads and sees: every default in --help, what --include/--exclude
match for each --kind (and that they do match that), and --no-progress being quiet,
transformers' own bars included."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from lmdx.cli import main
from lmdx.cli.decompose import add_decompose_parser
from lmdx.cli.merge import add_merge_parser
from lmdx.cli.stats import add_stats_parser
from lmdx.stats import Statistics
from tiny_bert import WORDS, build_tiny_bert
from transformers import AutoTokenizer, BertForSequenceClassification


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as done:
        main(argv)
    assert done.value.code == 0
    # one line: help wraps anywhere, example commands with a shell's continuation
    return " ".join(capsys.readouterr().out.replace(" \\\n", " ").split())


def _parser(add: object) -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="lmdx")
    add(root.add_subparsers())  # type: ignore[operator]
    sub = next(a for a in root._actions if isinstance(a, argparse._SubParsersAction))
    return next(iter(sub.choices.values()))


@pytest.mark.parametrize(
    ("command", "add"),
    [("stats", add_stats_parser), ("merge", add_merge_parser), ("decompose", add_decompose_parser)],
)
def test_help_shows_every_default(command, add, capsys):
    text = _help([command, "--help"], capsys)
    parser = _parser(add)
    checked = 0
    for action in parser._actions:
        default = action.default
        if not action.option_strings or default is None or default is argparse.SUPPRESS:
            continue
        if isinstance(default, bool):
            continue  # a flag: off unless given
        shown = " ".join(parser._get_formatter()._expand_help(action).split())
        assert re.search(rf"\(default:? {re.escape(str(default))}[),]", shown), shown
        assert shown in text
        checked += 1
    # stats --max-length: its default depends on the model (stated in words, checked below)
    assert checked >= {"stats": 5, "merge": 1, "decompose": 4}[command]


def test_help_names_the_defaults_users_asked_for(capsys):
    text = _help(["stats", "--help"], capsys)
    for needle in (
        "tokens per text, longer texts are cut (truncation): match the fine-tuning length "
        "(default: 128)",
        "texts per forward pass (default: 16)",
        "field/column of .jsonl/.csv texts (default: text)",
        "(default: regmean)",
        "threads of the Gram products (default: $LMDX_NUM_THREADS or every CPU available",
    ):
        assert needle in text, needle
    assert "(default: None)" not in text and "(default: False)" not in text
    add = _help(["stats", "add", "--help"], capsys)
    assert "(default: one file)" in add


def test_help_says_what_patterns_match_for_each_kind(capsys):
    text = _help(["stats", "--help"], capsys)
    assert "regmean module names, as in model.named_modules()" in text
    assert "fisher parameter names, as in model.named_parameters()" in text
    assert "'classifier.*', not 'classifier'" in text
    assert re.search(
        r"--include PATTERN .*module names \(--kind regmean\) or parameter names "
        r"\(--kind fisher\)",
        text,
    )
    assert re.search(
        r"--exclude PATTERN .*module names \(--kind regmean, e\.g\. classifier\) "
        r"or parameter names \(--kind fisher, e\.g\. 'classifier\.\*'\)",
        text,
    )
    assert "--kind fisher --exclude 'classifier.*' 'bert.embeddings.*'" in text


# --------------------------------------------------------------------------- behaviour


@pytest.fixture(scope="module")
def classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("help-cli")
    tiny = build_tiny_bert(root / "tokenizer-source")
    torch.manual_seed(4)
    model = BertForSequenceClassification.from_pretrained(str(tiny), num_labels=2)
    model.save_pretrained(root / "model")
    AutoTokenizer.from_pretrained(str(tiny)).save_pretrained(root / "model")
    rng = np.random.default_rng(5)
    texts = [" ".join(rng.choice(WORDS, size=rng.integers(2, 10))) for _ in range(12)]
    (root / "texts.txt").write_text("\n".join(texts) + "\n")
    return root


def _collect(root: Path, out: str, *extra: str) -> Statistics:
    argv = ["stats", str(root / "model"), str(root / "texts.txt"), "--out", str(root / out)]
    assert main([*argv, "--no-progress", *extra]) == 0
    return Statistics.load(root / out)


def test_patterns_match_module_names_for_regmean_and_parameter_names_for_fisher(classifier):
    model = BertForSequenceClassification.from_pretrained(str(classifier / "model"))
    every_param = {n for n, _ in model.named_parameters()}

    gram = _collect(classifier, "g.safetensors", "--exclude", "classifier", "*.pooler.*")
    assert "classifier" not in gram.modules and "bert.pooler.dense" not in gram.modules
    assert "bert.encoder.layer.0.output.dense" in gram.modules
    by_weight = _collect(classifier, "g2.safetensors", "--exclude", "classifier.*")
    assert set(by_weight.modules) == set(gram.modules) | {"bert.pooler.dense"}

    fisher = _collect(
        classifier,
        "f.safetensors",
        "--kind",
        "fisher",
        "--exclude",
        "classifier.*",
        "bert.embeddings.*",
    )
    left_out = {n for n in every_param if n.startswith(("classifier.", "bert.embeddings."))}
    assert set(fisher.parameters) == every_param - left_out

    # a module name matches no parameter: Fisher collects everything, as the help warns
    fisher_all = _collect(
        classifier, "f2.safetensors", "--kind", "fisher", "--exclude", "classifier"
    )
    assert set(fisher_all.parameters) == every_param


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmdx", *argv], capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow  # transformers' bars: a model loaded in subprocesses
def test_no_progress_is_quiet_and_progress_shows_transformers_bars(classifier):
    data = str(classifier / "texts.txt")
    model = str(classifier / "model")
    loud = _run("stats", model, data, "--out", str(classifier / "loud.safetensors"))
    assert loud.returncode == 0, loud.stderr
    assert "Loading weights" in loud.stderr  # transformers' bar, hidden by --no-progress
    for kind in ("regmean", "fisher"):
        out = str(classifier / f"quiet-{kind}.safetensors")
        quiet = _run("stats", model, data, "--kind", kind, "--out", out, "--no-progress")
        assert quiet.returncode == 0, quiet.stderr
        assert quiet.stderr == "", quiet.stderr
    cfg = classifier / "avg.yaml"
    cfg.write_text("method: average\nmodels: [model, model]\n")
    merged = _run("merge", str(cfg), "--out", str(classifier / "m"), "--in-memory", "--no-progress")
    assert merged.returncode == 0, merged.stderr
    assert merged.stderr == "", merged.stderr


#: reStructuredText a terminal shows as it is: double backquotes, roles, literal blocks.
RAW_RST = re.compile(r"``|:(?:func|class|meth|mod|attr|data):`|::\s*$", re.M)


@pytest.mark.parametrize(
    "argv",
    [[], ["stats"], ["stats", "add"], ["stats", "show"], ["merge"], ["decompose"], ["methods"]],
    ids=lambda argv: " ".join(["lmdx", *argv]),
)
def test_help_is_plain_text(argv, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0
    text = capsys.readouterr().out
    assert not RAW_RST.findall(text), RAW_RST.findall(text)


def test_merge_help_fits_a_screen_or_two_and_says_where_the_methods_are(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    with pytest.raises(SystemExit):
        main(["merge", "--help"])
    text = capsys.readouterr().out
    assert len(text.splitlines()) <= 60, len(text.splitlines())
    assert "lmdx methods" in text and "lmdx methods NAME" in text
    assert "--out DIR" in text and "--dry-run" in text


def test_methods_name_shows_that_method_and_a_config_to_start_from(capsys):
    import yaml
    from lmdx.merge.registry import methods

    for name, method in methods().items():
        assert main(["methods", name]) == 0
        text = capsys.readouterr().out
        assert text.startswith(f"{name}: ")
        example = text.split(
            "example config (merge.yaml; then lmdx merge merge.yaml --out merged):\n", 1
        )[1]
        config = yaml.safe_load(example)
        assert config["method"] == name and len(config["models"]) == 2
        assert ("base" in config) == method.needs_base
        for key, field in method.options.model_fields.items():
            if field.default is not None:
                assert config[key] == field.default, (name, key)
        # the example is a configuration lmdx reads: its keys are the schema's
        assert set(config) <= {"method", "base", "models", "heads", *method.options.model_fields}
    assert main(["methods", "+svc"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("+svc: SVC") and "ties+svc" in text and "svc_alpha" in text


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["mrege", "x.yaml"], "lmdx: error: no command 'mrege'; did you mean merge?"),
        (["methods", "tiess"], "lmdx methods: error: no merge method 'tiess'; did you mean ties?"),
    ],
)
def test_a_mistyped_name_gets_a_suggestion(argv, said, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(said), err


@pytest.mark.parametrize(
    ("config", "said"),
    [
        ("method: tiess\nmodels: [a, b]\n", "got 'tiess'; did you mean ties?"),
        (
            "method: regmean\nalpah: 0.9\nmodels: [a, b]\n",
            "['alpah'] in the config; did you mean alpha?",
        ),
        ("method: average\nmodels: [a, b\n", "merge.yaml"),
    ],
    ids=["method", "key", "yaml"],
)
def test_config_mistakes_name_the_file_and_suggest(config, said, tmp_path, capsys):
    path = tmp_path / "merge.yaml"
    path.write_text(config)
    assert main(["merge", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0] and "<unicode string>" not in err[0], err
    assert not (tmp_path / "out").exists()
