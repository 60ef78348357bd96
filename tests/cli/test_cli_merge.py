"""``lmdx merge`` end to end on tiny BERT classifiers saved to disk (the workspace:
cli_workspace.py; ``lmdx stats`` itself: test_cli_stats.py).

References are computed here: the RegMean solve with ``numpy.linalg.solve``, averages
with NumPy.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from cli_workspace import MODULE, K, build_workspace, write_config
from hf_models import leftovers, rel_err
from lmdx.cli import main
from lmdx.stats import Statistics
from safetensors.numpy import load_file
from task_vectors import ref_merge
from transformers import BertForSequenceClassification


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_workspace(tmp_path_factory.mktemp("merge-cli"))


def _regmean_config(workspace: Path, name: str, alpha: float = 0.9) -> Path:
    models = "\n".join(f"  - {{path: m{i}, stats: s{i}.safetensors}}" for i in range(K))
    return write_config(
        workspace / name,
        f"method: regmean\nmodels:\n{models}\nalpha: {alpha}\n"
        "heads: {patterns: ['classifier.*'], policy: keep}\n",
    )


def test_merge_regmean_matches_numpy(workspace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _regmean_config(workspace, "regmean.yaml")
    out = workspace / "merged-regmean"
    assert main(["merge", str(cfg), "--out", str(out), "--no-progress"]) == 0
    # Tiny layers are solved in float64 under precision auto; the summary counts them.
    assert "lmdx merge: RegMean systems by precision: " in capsys.readouterr().out
    merged = BertForSequenceClassification.from_pretrained(str(out))
    alpha = 0.9
    grams, weights = [], []
    for i in range(K):
        s = Statistics.load(workspace / f"s{i}.safetensors")
        g = s.gram(MODULE) / s.count(MODULE)
        grams.append(alpha * g + (1 - alpha) * np.diag(np.diag(g)))
        w = load_file(str(workspace / f"m{i}" / "model.safetensors"))[f"{MODULE}.weight"]
        weights.append(w.astype(np.float64))
    ref = np.linalg.solve(sum(grams), sum(g @ w.T for g, w in zip(grams, weights, strict=True))).T
    got = merged.get_parameter(f"{MODULE}.weight").detach().double().numpy()
    assert rel_err(got, ref) < 1e-6
    bias = np.mean(
        [
            load_file(str(workspace / f"m{i}" / "model.safetensors"))[f"{MODULE}.bias"]
            for i in range(K)
        ],
        axis=0,
        dtype=np.float64,
    )
    assert rel_err(merged.get_parameter(f"{MODULE}.bias").detach().double().numpy(), bias) < 1e-6
    heads = [load_file(str(out / "heads" / f"{i}.safetensors")) for i in range(K)]
    for i, head in enumerate(heads):
        own = load_file(str(workspace / f"m{i}" / "model.safetensors"))
        np.testing.assert_array_equal(head["classifier.weight"], own["classifier.weight"])
    record = json.loads((out / "lmdx_merge.json").read_text())
    assert record["config"]["method"] == "regmean" and record["config"]["alpha"] == alpha
    layer = record["report"]["layers"][MODULE]
    assert layer["precision"] == "float64" and layer["output_error_estimate"] == 0.0
    assert len(record["inputs"]) == K and all(v["stats_sha256"] for v in record["inputs"].values())
    assert (out / "tokenizer.json").is_file() or (out / "vocab.txt").is_file()


def test_merge_task_arithmetic_and_average(workspace: Path) -> None:
    models = "\n".join(f"  - m{i}" for i in range(K))
    cfg = write_config(
        workspace / "ta.yaml",
        f"method: task_arithmetic\nbase: base\nscaling: 0.5\nmodels:\n{models}\n",
    )
    out = workspace / "merged-ta"
    assert main(["merge", str(cfg), "--out", str(out), "--no-progress"]) == 0
    name = "bert.encoder.layer.0.output.dense.weight"
    base = load_file(str(workspace / "base" / "model.safetensors"))[name].astype(np.float64)
    thetas = [
        load_file(str(workspace / f"m{i}" / "model.safetensors"))[name].astype(np.float64)
        for i in range(K)
    ]
    ref = base + 0.5 * sum(t - base for t in thetas)
    got = load_file(str(out / "model.safetensors"))[name]
    assert rel_err(got.astype(np.float64), ref) < 1e-6

    cfg = write_config(
        workspace / "avg.yaml",
        "method: average\nmodels:\n"
        + "\n".join(f"  - {{path: m{i}, coefficient: {i + 1}}}" for i in range(K)),
    )
    out = workspace / "merged-avg"
    assert main(["merge", str(cfg), "--out", str(out), "--no-progress"]) == 0
    ref = sum((i + 1) * t for i, t in enumerate(thetas)) / 6.0
    assert rel_err(load_file(str(out / "model.safetensors"))[name].astype(np.float64), ref) < 1e-6


def test_merge_ties_and_dare_match_numpy(
    workspace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    models = "\n".join(f"  - {{path: m{i}, coefficient: {i + 1}}}" for i in range(K))
    heads = "heads: {patterns: ['classifier.*'], policy: keep}\n"
    base = load_file(str(workspace / "base" / "model.safetensors"))
    thetas = [load_file(str(workspace / f"m{i}" / "model.safetensors")) for i in range(K)]
    for method, keys, settings in (
        ("ties", "density: 0.3\n", {"density": 0.3, "scaling": 1.0}),
        ("dare", "seed: 4\nscaling: 0.5\n", {"density": 0.5, "scaling": 0.5, "seed": 4}),
    ):
        cfg = write_config(
            workspace / f"{method}.yaml",
            f"method: {method}\nbase: base\n{keys}{heads}models:\n{models}\n",
        )
        out = workspace / f"merged-{method}"
        assert main(["merge", str(cfg), "--out", str(out), "--no-progress"]) == 0
        shown = ", ".join(f"{k} {v}" for k, v in settings.items())
        assert f"lmdx merge: {method} ({shown}) of {K} models in" in capsys.readouterr().out
        merged = load_file(str(out / "model.safetensors"))
        for name in ("bert.encoder.layer.0.output.dense.weight", "bert.embeddings.LayerNorm.bias"):
            ref = ref_merge(
                method,
                name,
                base[name].astype(np.float64),
                [t[name] for t in thetas],
                [1.0, 2.0, 3.0],
                settings["density"],
                settings["scaling"],
                settings.get("seed", 0),
            )
            assert rel_err(merged[name].astype(np.float64), ref) < 1e-6, (method, name)
        record = json.loads((out / "lmdx_merge.json").read_text())
        assert {k: record["report"][k] for k in settings} == settings
        assert record["config"]["base"] == str(workspace / "base")
        model = BertForSequenceClassification.from_pretrained(str(out))
        ids = torch.tensor([[2, 7, 9, 3]])
        assert torch.isfinite(model(input_ids=ids).logits).all()


@pytest.mark.parametrize(
    ("body", "match"),
    [
        ("method: regmean\nmodels: [m0, m1]\nalpah: 0.5\n", r"unknown key\(s\) \['alpah'\]"),
        ("method: mean\nmodels: [m0, m1]\n", "method must be one of"),
        (
            "method: regmean\nmodels: [m0, m1]\n",
            r"models\[0\]\.stats: method regmean needs regmean-gram statistics, one per model",
        ),
        ("method: average\nmodels: [m0]\n", "at least 2"),
        ("method: average\nmodels: [m0, nowhere]\n", r"models\[1\]\.path .*no such model folder"),
        (
            "method: regmean\nmodels:\n  - {path: m0, stats: s0.safetensors}\n"
            "  - {path: m1, stats: missing.safetensors}\n",
            r"models\[1\]\.stats .*no such file",
        ),
        (
            "method: regmean\nmodels:\n  - {path: m0, stats: s1.safetensors}\n"
            "  - {path: m1, stats: s1.safetensors}\n",
            "do not belong to .*m0: parameter",
        ),
        ("method: average\nalpha: 2\nmodels: [m0, m1]\n", r"alpha must be in \[0, 1\]"),
        (
            "method: average\nprecision: half\nmodels: [m0, m1]\n",
            "precision must be one of auto, float32, float32-rhs, float64",
        ),
        ("method: task_arithmetic\nmodels: [m0, m1]\n", "needs the pre-trained model"),
        ("method: ties\nmodels: [m0, m1]\n", "base: method ties needs the pre-trained model"),
        (
            "method: ties\nbase: base\ndensity: 0\nmodels: [m0, m1]\n",
            r"density must be in \(0, 1\]",
        ),
        (
            "method: dare\nbase: base\ndensity: 1.5\nmodels: [m0, m1]\n",
            r"density must be in \(0, 1\]",
        ),
        (
            "method: dare\nbase: base\nseed: -1\nmodels: [m0, m1]\n",
            "seed must be a whole number >= 0",
        ),
        ("method: dare\nbase: base\nseed: 1.5\nmodels: [m0, m1]\n", "seed must be a whole number"),
        (
            "method: ties\nbase: base\nseed: 3\nmodels: [m0, m1]\n",
            "seed is only used by dare, dare_ties, della, della_linear, not ties",
        ),
        (
            "method: average\ndensity: 0.5\nmodels: [m0, m1]\n",
            "density is only used by ties, dare, dare_ties, breadcrumbs, .*, not average",
        ),
        (
            "method: average\nscaling: 0.5\nmodels: [m0, m1]\n",
            "scaling is only used by task_arithmetic",
        ),
        (
            "method: average\nbase: base\nmodels: [m0, m1]\n",
            r"base: used by LoRA adapters .* and by task_arithmetic, ties, dare, dare_ties, "
            r"breadcrumbs, .*, wudi, not by average",
        ),
        (
            "method: dare_ties\nbase: base\n"
            "models:\n  - {path: m0, stats: s0.safetensors}\n  - m1\n",
            r"models\[0\]\.stats: method dare_ties takes no statistics",
        ),
        ("method: average\nmodels: [m0, m1]\noutput: {dtype: int8}\n", "output.dtype"),
        ("method: [unclosed\n", "cannot parse"),
    ],
)
def test_merge_config_errors(
    workspace: Path, body: str, match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = write_config(workspace / "bad.yaml", body)
    out = workspace / "never-written"
    before = leftovers(workspace)
    assert main(["merge", str(cfg), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lmdx merge: error:")
    import re

    assert re.search(match, err), err
    assert not out.exists()
    assert leftovers(workspace) == before


@pytest.mark.parametrize("flags", [[], ["--dry-run"], ["--in-memory"]])
def test_differing_heads_are_advised_in_the_files_words(
    workspace: Path, tmp_path: Path, flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    """A configuration file is told how to exclude heads as a file writes it, not as a
    Python keyword argument (heads=[...])."""
    three = workspace / "m0-three-labels"
    if not three.exists():
        model = BertForSequenceClassification.from_pretrained(
            str(workspace / "m0"), num_labels=3, ignore_mismatched_sizes=True
        )
        model.save_pretrained(three)
    cfg = write_config(
        tmp_path / "heads.yaml", f"method: average\nmodels: [{workspace / 'm0'}, {three}]\n"
    )
    out = tmp_path / "merged"
    capsys.readouterr()
    assert main(["merge", str(cfg), "--out", str(out), "--no-progress", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lmdx merge: error: tensor 'classifier.bias': shape (2,) in ")
    assert err.rstrip().endswith(
        "(exclude differing task heads with heads: {patterns: ['classifier.*']})"
    )
    assert not out.exists()


def test_merge_refuses_existing_output(workspace: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = workspace / "exists"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    cfg = _regmean_config(workspace, "again.yaml")
    assert main(["merge", str(cfg), "--out", str(out), "--no-progress"]) == 2
    assert "already exists" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_merge_dry_run_and_in_memory_equal_streaming(
    workspace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _regmean_config(workspace, "ooc.yaml")
    out = workspace / "ooc-stream"
    assert main(["merge", str(cfg), "--out", str(out), "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "regmean" in text and "GB peak estimated" in text and "dry run" in text
    assert "tensors the statistics do not cover" in text and "needs no statistics" in text
    assert not out.exists()
    assert main(["merge", str(cfg), "--out", str(out), "--no-progress"]) == 0
    assert "peak RSS" in capsys.readouterr().out
    mem = workspace / "ooc-mem"
    assert main(["merge", str(cfg), "--out", str(mem), "--in-memory", "--no-progress"]) == 0
    a = BertForSequenceClassification.from_pretrained(str(out)).state_dict()
    b = BertForSequenceClassification.from_pretrained(str(mem)).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert json.loads((out / "lmdx_merge.json").read_text())["report"]["streaming"] is True


def test_sigterm_during_merge_leaves_nothing(workspace: Path, tmp_path: Path) -> None:
    import subprocess
    import sys
    import time

    cfg = _regmean_config(workspace, "term.yaml")
    out = tmp_path / "merged"
    script = (
        "import time, lmdx.merge.builtin.regmean_solve as s\n"
        "s.regmean_merge_layer = lambda *a, **k: time.sleep(60)\n"
        "from lmdx.cli import main\n"
        f"raise SystemExit(main(['merge', {str(cfg)!r}, '--out', {str(out)!r}, '--no-progress']))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not leftovers(tmp_path) and proc.poll() is None:
            time.sleep(0.05)
        assert leftovers(tmp_path), "the merge did not start writing (or finished before SIGTERM)"
        proc.terminate()
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate()
    assert proc.returncode == 130, err
    assert "interrupted; nothing was written" in err
    assert list(tmp_path.iterdir()) == []


def test_errors_are_one_escaped_line_and_debug_shows_them_raised(
    workspace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from lmdx import MergeError

    cfg = write_config(workspace / "odd.yaml", 'method: average\nmodels: [m0, "m\\e[2J1"]\n')
    out = workspace / "never"
    assert main(["merge", str(cfg), "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err and "m\\x1b[2J1" in err
    with pytest.raises(MergeError, match="no such model folder"):
        main(["--debug", "merge", str(cfg), "--out", str(out), "--no-progress"])
    assert not out.exists()


def test_merge_summary_names_poorly_determined_systems(
    workspace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Statistics on 3 texts: the pooler sees 3 rows for its inputs, far fewer than 2 each.
    (workspace / "three.txt").write_text("a short text\nanother one here\nand a third\n")
    for i in range(K):
        stats = workspace / f"few{i}.safetensors"
        if not stats.exists():
            args = ["stats", str(workspace / f"m{i}"), str(workspace / "three.txt")]
            assert main([*args, "--out", str(stats), "--no-progress"]) == 0
    models = "\n".join(f"  - {{path: m{i}, stats: few{i}.safetensors}}" for i in range(K))
    cfg = write_config(
        workspace / "few.yaml",
        f"method: regmean\nmodels:\n{models}\nheads: {{patterns: ['classifier.*']}}\n",
    )
    out = workspace / "merged-few"
    capsys.readouterr()
    assert main(["merge", str(cfg), "--out", str(out), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    notes = json.loads((out / "lmdx_merge.json").read_text())["report"]["poorly_determined"]
    pooler = next(n for n in notes if n["module"] == "bert.pooler.dense")
    assert pooler["rows"] == 3 and "3 statistics rows for" in pooler["why"]
    assert f"{len(notes)} RegMean system(s) poorly determined" in printed
    assert "bert.pooler.dense (3 statistics rows for" in printed
    assert "Collect statistics on more data" in printed
