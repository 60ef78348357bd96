"""``lmdx stats`` end to end on tiny BERT classifiers saved to disk (the workspace:
cli_workspace.py).

References are computed here: Grams from this module's own forward hooks in float64.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_workspace import MODULE, build_workspace
from hf_models import rel_err
from lmdx.cli import main
from lmdx.stats import Statistics
from transformers import AutoTokenizer, BertForSequenceClassification


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_workspace(tmp_path_factory.mktemp("merge-cli"))


def _reference_gram(folder: Path, texts: list[str], module: str) -> tuple[np.ndarray, float]:
    """Σ x xᵀ of ``module``'s input over real tokens, float64, one text at a time."""
    model = BertForSequenceClassification.from_pretrained(str(folder)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    rows: list[np.ndarray] = []
    handle = model.get_submodule(module).register_forward_pre_hook(
        lambda m, args: rows.append(
            args[0].detach().double().reshape(-1, args[0].shape[-1]).numpy()
        )
    )
    with torch.no_grad():
        for t in texts:  # no padding at all
            model(**tokenizer([t], truncation=True, max_length=128, return_tensors="pt"))
    handle.remove()
    x = np.concatenate(rows)
    return x.T @ x, float(x.shape[0])


def test_stats_file_holds_reference_gram(workspace: Path) -> None:
    texts = (workspace / "all.txt").read_text().splitlines()
    ref, n = _reference_gram(workspace / "m0", texts, MODULE)
    stats = Statistics.load(workspace / "s0.safetensors")
    assert stats.kind == "regmean-gram" and stats.padding == "excluded"
    assert stats.count(MODULE) == n
    assert rel_err(stats.gram(MODULE), ref) < 1e-6
    assert "64 texts" in stats.data


def test_stats_add_equals_whole(workspace: Path) -> None:
    parts = []
    for name in ("part1", "part2"):
        out = workspace / f"m0-{name}.safetensors"
        rc = main(
            [
                "stats",
                str(workspace / "m0"),
                str(workspace / f"{name}.txt"),
                "--batch-size",
                "8",
                "--out",
                str(out),
                "--no-progress",
            ]
        )
        assert rc == 0
        parts.append(str(out))
    total = workspace / "m0-added.safetensors"
    assert main(["stats", "add", *parts, "--out", str(total)]) == 0
    added, whole = Statistics.load(total), Statistics.load(workspace / "s0.safetensors")
    for module in whole.modules:
        assert added.count(module) == whole.count(module)
        assert rel_err(added.gram(module), whole.gram(module)) < 1e-12
        assert rel_err(added.sum(module), whole.sum(module)) < 1e-12


def test_stats_show(workspace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["stats", "show", str(workspace / "s0.safetensors")]) == 0
    out = capsys.readouterr().out
    assert "regmean-gram" in out and "padding:     excluded" in out
    assert "bert.encoder.layer.0.attention.self.query: dim 32" in out
    assert main(["stats", "show", "--json", str(workspace / "s0.safetensors")]) == 0
    meta = json.loads(capsys.readouterr().out)
    assert meta["format"] == "lmdx-stats" and meta["model"]["architecture"] == (
        "BertForSequenceClassification"
    )


def test_fisher_stats_gold_labels(workspace: Path) -> None:
    out = workspace / "f0.safetensors"
    rc = main(
        [
            "stats",
            str(workspace / "m0"),
            str(workspace / "labeled.jsonl"),
            "--kind",
            "fisher",
            "--labels",
            "gold",
            "--max-texts",
            "6",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0
    stats = Statistics.load(out)
    model = BertForSequenceClassification.from_pretrained(str(workspace / "m0")).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(workspace / "m0"))
    lines = [json.loads(s) for s in (workspace / "labeled.jsonl").read_text().splitlines()[:6]]
    name = "classifier.weight"
    ref = np.zeros(tuple(model.get_parameter(name).shape))
    for row in lines:
        model.zero_grad()
        logits = model(**tokenizer([row["text"]], return_tensors="pt")).logits
        torch.log_softmax(logits, -1)[0, row["label"]].backward()
        ref += model.get_parameter(name).grad.double().numpy() ** 2
    assert stats.count() == 6
    assert rel_err(stats.fisher(name), ref) < 1e-5


def test_stats_errors(workspace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = workspace / "x.safetensors"
    assert (
        main(["stats", str(workspace / "m0"), str(workspace / "nope.txt"), "--out", str(out)]) == 2
    )
    assert "no such file" in capsys.readouterr().err
    assert main(["stats", str(workspace), str(workspace / "all.txt"), "--out", str(out)]) == 2
    assert "not a save_pretrained folder" in capsys.readouterr().err
    assert (
        main(
            [
                "stats",
                str(workspace / "m0"),
                str(workspace / "all.txt"),
                "--out",
                str(workspace / "s0.safetensors"),
            ]
        )
        == 2
    )
    assert "already exists" in capsys.readouterr().err
    assert (
        main(
            [
                "stats",
                str(workspace / "m0"),
                str(workspace / "all.txt"),
                "--kind",
                "fisher",
                "--labels",
                "gold",
                "--out",
                str(out),
            ]
        )
        == 2
    )
    assert "has no labels" in capsys.readouterr().err
    truncated = workspace / "truncated.safetensors"
    truncated.write_bytes((workspace / "s0.safetensors").read_bytes()[:-100])
    assert main(["stats", "show", str(truncated)]) == 1
    assert "truncated" in capsys.readouterr().err
    assert not out.exists()


# --------------------------------------------------------------------------- out of core


def _same_tensors(a: Statistics, b: Statistics) -> None:
    assert a.modules == b.modules
    for m in a.modules:
        assert a.count(m) == b.count(m)
        assert np.array_equal(a.gram(m), b.gram(m)), m
        assert np.array_equal(a.sum(m), b.sum(m)), m


def test_stats_disk_backed_and_sharded(workspace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = workspace / "s0-sharded"
    rc = main(
        [
            "stats",
            str(workspace / "m0"),
            str(workspace / "all.txt"),
            "--batch-size",
            "8",
            "--max-memory",
            "30KB",
            "--max-shard-size",
            "20KB",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert rc == 0, capsys.readouterr().err
    assert out.is_dir() and len(list(out.glob("stats-*.safetensors"))) > 1
    got = Statistics.load(out)
    assert got.extra["passes"] > 1
    _same_tensors(got, Statistics.load(workspace / "s0.safetensors"))
    # shards add like files, into a sharded folder
    added = workspace / "added-sharded"
    files = [str(out), str(workspace / "s0.safetensors")]
    assert main(["stats", "add", *files, "--out", str(added), "--max-shard-size", "20KB"]) == 0
    total = Statistics.load(added)
    ref = Statistics.load(workspace / "s0.safetensors")
    assert np.array_equal(total.gram(MODULE), 2 * ref.gram(MODULE))
    assert main(["stats", "show", str(added)]) == 0
    assert "regmean-gram" in capsys.readouterr().out
    fisher = ["--kind", "fisher", "--max-memory", "1GB", "--out", str(workspace / "f.st")]
    assert main(["stats", str(workspace / "m0"), str(workspace / "all.txt"), *fisher]) == 2
    assert "--max-memory: only for --kind regmean" in capsys.readouterr().err


def test_stats_on_a_device_the_model_cannot_use_is_one_line_and_nothing_written(
    workspace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model, data = str(workspace / "m0"), str(workspace / "all.txt")
    out = workspace / "on-device.safetensors"
    rc = main(["stats", model, data, "--device", "cuda:64", "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert rc != 0 and not out.exists()
    assert err.count("\n") == 1 and "device cuda:64: cannot run the model there" in err, err
    fisher = ["--kind", "fisher", "--device", "cpu", "--out", str(out)]
    assert main(["stats", model, data, *fisher]) == 2
    assert "--device: only for --kind regmean without --ray" in capsys.readouterr().err
    # on the CPU the native kernels collect, as without --device
    rc = main(["stats", model, data, "--device", "cpu", "--out", str(out), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    got, ref = Statistics.load(out), Statistics.load(workspace / "s0.safetensors")
    assert got.accumulation == "mixed" and got.modules == ref.modules
    for m in ref.modules:
        assert got.count(m) == ref.count(m) and rel_err(got.gram(m), ref.gram(m)) < 1e-6, m
    # --backend torch: the GPU path's code (lmdx.stats.torch_gram) run on the CPU, as labelled
    on_torch = workspace / "on-torch.safetensors"
    argv = ["stats", model, data, "--device", "cpu", "--backend", "torch", "--out", str(on_torch)]
    assert main([*argv, "--no-progress"]) == 0, capsys.readouterr().err
    got = Statistics.load(on_torch)
    assert got.accumulation == "torch-float32" and got.modules == ref.modules
    for m in ref.modules:
        assert got.count(m) == ref.count(m) and rel_err(got.gram(m), ref.gram(m)) < 1e-6, m
    assert (
        main(
            [
                "stats",
                model,
                data,
                "--kind",
                "fisher",
                "--backend",
                "torch",
                "--out",
                str(workspace / "f-torch.st"),
            ]
        )
        == 2
    )
    assert "--backend: only for --kind regmean without --ray" in capsys.readouterr().err
