"""Task vectors against the bare encoder the task models were fine-tuned from: ``base`` is
a ``BertModel`` folder (tensors ``embeddings.*``), the models
``BertForSequenceClassification`` folders (``bert.embeddings.*``). lmdx reads the base
under the models' ``base_model_prefix`` (as transformers loads one into the other) and says
which tensors the base lacks and what it did with them. References: NumPy in float64 on
the saved tensors (tests/task_vectors.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import transformers
from lmdx import MergeError
from lmdx.cli import main
from lmdx.merge import merge_models, save_merged, stream_merge
from safetensors.numpy import load_file
from task_vectors import ref_merge

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 3
HEADS = ("classifier.*",)
CASES = [
    ("task_arithmetic", {"scaling": 0.6}, 1.0, 0.6),
    ("ties", {"density": 0.4}, 0.4, 1.0),
    ("dare", {"density": 0.7, "seed": 3}, 0.7, 0.3),
]


def _config() -> transformers.BertConfig:
    return transformers.BertConfig(
        vocab_size=40,
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=24,
        max_position_embeddings=32,
        num_labels=3,
    )


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A BertModel base on disk and K task models built on it (the encoder moved by seeded
    noise, each with its own classifier)."""
    root = tmp_path_factory.mktemp("base-prefix")
    torch.manual_seed(0)
    base = transformers.BertModel(_config()).eval()
    base.save_pretrained(root / "base")
    models = []
    for i in range(K):
        torch.manual_seed(100 + i)
        task = transformers.BertForSequenceClassification(_config()).eval()
        task.bert.load_state_dict(base.state_dict())
        gen = torch.Generator().manual_seed(200 + i)
        with torch.no_grad():
            for p in task.bert.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        task.save_pretrained(root / f"m{i}")
        models.append(root / f"m{i}")
    return {"root": root, "base": root / "base", "models": models}


def _reference(folders, method, density, scaling, seed, heads) -> dict[str, np.ndarray]:
    base = load_file(str(folders["base"] / "model.safetensors"))
    states = [load_file(str(m / "model.safetensors")) for m in folders["models"]]
    out = {}
    for name, first in states[0].items():
        if heads and name.startswith("classifier."):
            continue
        thetas = [s[name].astype(np.float64) for s in states]
        inner = name.removeprefix("bert.")
        if not np.issubdtype(first.dtype, np.floating):
            out[name] = first
        elif inner in base and name != inner:
            theta0 = base[inner].astype(np.float64)
            out[name] = ref_merge(method, name, theta0, thetas, None, density, scaling, seed)
        else:  # the base lacks it (the classifier): the models' average
            out[name] = np.mean(np.stack(thetas), axis=0)
    return out


@pytest.mark.parametrize(("method", "options", "density", "scaling"), CASES)
@pytest.mark.parametrize("heads", [HEADS, ()])
def test_task_vectors_against_a_bare_encoder_base(
    folders, tmp_path, method, options, density, scaling, heads
):
    seed = options.get("seed", 0)
    ref = _reference(folders, method, density, scaling, seed, heads)
    res = stream_merge(
        folders["models"],
        tmp_path / "s",
        method,
        base=folders["base"],
        heads=heads,
        progress=False,
        **options,
    )
    merged = load_file(str(tmp_path / "s" / "model.safetensors"))
    for name, expected in ref.items():
        np.testing.assert_allclose(merged[name], expected, rtol=2e-6, atol=1e-6, err_msg=name)
    note = res.report["base"]
    assert note["prefix"] == "bert"
    lacking = ["classifier.bias", "classifier.weight"]
    if heads:
        assert note["heads"] == lacking and "averaged" not in note
        assert (
            "lacks the task heads classifier.bias, classifier.weight (kept per model)"
            in (note["line"])
        )
    else:
        assert note["averaged"] == lacking and "heads" not in note
        assert "(averaged over the models: no task vector)" in note["line"]
    # in memory: bit-identical to streaming
    mem = merge_models(
        folders["models"], method, base=folders["base"], heads=heads, progress=False, **options
    )
    save_merged(mem, tmp_path / "m", folders["models"][0], progress=False)
    again = load_file(str(tmp_path / "m" / "model.safetensors"))
    assert all(np.array_equal(again[n], merged[n]) for n in merged)
    assert mem.report["base"] == note


def test_cli_says_what_the_base_lacks(folders, tmp_path, capsys):
    models = "\n".join(f"  - {m}" for m in folders["models"])
    cfg = tmp_path / "ta.yaml"
    cfg.write_text(f"method: task_arithmetic\nbase: {folders['base']}\nmodels:\n{models}\n")
    out = tmp_path / "merged"
    assert main(["merge", str(cfg), "--out", str(out), "--dry-run"]) == 0
    plan = capsys.readouterr().out
    line = (
        f"base {folders['base']}: its tensors read as the models' bert.* (base_model_prefix); "
        "lacks classifier.bias, classifier.weight (averaged over the models: no task vector)"
    )
    assert f"note:     {line}" in plan
    assert main(["merge", str(cfg), "--out", str(out), "--no-progress"]) == 0
    assert f"lmdx merge: {line}" in capsys.readouterr().out
    record = json.loads((out / "lmdx_merge.json").read_text())
    assert record["report"]["base"]["line"] == line


def test_a_base_of_another_model_is_refused(folders, tmp_path):
    other = transformers.GPT2Model(
        transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=40, n_positions=32)
    )
    other.save_pretrained(tmp_path / "gpt2")
    with pytest.raises(MergeError, match=r"has none of the models' tensors .*not the model"):
        stream_merge(
            folders["models"], tmp_path / "x", "ties", base=tmp_path / "gpt2", progress=False
        )
    assert not (tmp_path / "x").exists()
