"""Every data-free method added after the 2023 set, and the SVC post-step, through
``lmdx merge`` on tiny BERT classifiers saved to disk: a configuration file per method
(with options and coefficients), the merged folder bit-identical to the in-memory door
(:func:`lmdx.merge_models` on the same folders, loaded), the record, the model card and
``lmdx methods`` naming the method and its options. Their arithmetic is checked
against NumPy references in tests/merge/ (test_matrix_methods.py, test_wudi.py,
test_sparsified.py, test_spherical.py); one tensor per method again here.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from data_free_refs import (
    ref_iso_c,
    ref_model_stock,
    ref_slerp,
    ref_sparsified_merge,
    ref_tsv,
    ref_wudi,
)
from lmdx import merge_models
from lmdx.cli import main
from safetensors.numpy import load_file
from tiny_bert import save_classifiers
from transformers import BertForSequenceClassification

K = 3
NAME = "bert.encoder.layer.1.attention.self.query.weight"
#: method -> (its keys in the configuration file, as keyword arguments)
METHODS = {
    "tsv_m": {"scaling": 0.8, "rank_fraction": 0.5},
    "iso_c": {"scaling": 1.5},
    "iso_cts": {"common_space_fraction": 0.6},
    "wudi": {"solver": "ridge", "ridge": 0.5, "precision": "float64"},
    "breadcrumbs": {"density": 0.8, "gamma": 0.05},
    "breadcrumbs_ties": {},
    "della": {"density": 0.6, "epsilon": 0.1, "seed": 3},
    "della_linear": {"scaling": 0.5},
    "model_stock": {},
    "slerp": {"t": 0.25},
    "karcher": {},
    "tsv_m+svc": {"svc_alpha": 0.5},
}
NO_BASE = {"slerp", "karcher"}
#: method -> what its model card must say of it (the paper, or the construction)
DESCRIBED = {
    "tsv_m": "TSV-M (Gargiulo et al., CVPR 2025)",
    "iso_c": "ISO-C (Marczak et al., ICML 2025)",
    "iso_cts": "ISO-CTS (Marczak et al., ICML 2025)",
    "wudi": "WUDI (Cheng et al., ICML 2025)",
    "breadcrumbs": "Model Breadcrumbs (Davari & Belilovsky, 2024)",
    "breadcrumbs_ties": "Model Breadcrumbs' masks, then TIES",
    "della": "DELLA-Merging (Deep et al., 2024)",
    "della_linear": "DELLA's magnitude-ranked drops",
    "model_stock": "Model Stock (Jang et al., 2024)",
    "slerp": "SLERP (Shoemake, 1985",
    "karcher": "the Karcher mean",
    "tsv_m+svc": "TSV-M (Gargiulo et al., CVPR 2025)",
}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data-free-cli")
    save_classifiers(root, [f"m{i}" for i in range(K)])
    return root


def _config(root: Path, method: str, options: dict) -> Path:
    k = 2 if method == "slerp" else K
    coefficient = method != "slerp"
    models = "\n".join(
        f"  - {{path: m{i}, coefficient: {i + 1}}}" if coefficient else f"  - m{i}"
        for i in range(k)
    )
    keys = "".join(f"{key}: {value}\n" for key, value in options.items())
    base = "" if method in NO_BASE else "base: base\n"
    text = (
        f"method: {method}\n{base}{keys}heads: {{patterns: ['classifier.*']}}\nmodels:\n{models}\n"
    )
    path = root / f"{method}.yaml"
    path.write_text(text)
    return path


def _reference(method, options, theta0, thetas, coef):
    """Tensor NAME (a 16 × 16... query weight) by the reference of ``method``."""
    taus = [c * (t - theta0) for c, t in zip(coef, thetas, strict=True)]
    if method == "tsv_m":
        return theta0 + options["scaling"] * ref_tsv(taus, options["rank_fraction"])
    if method == "iso_c":
        return theta0 + options["scaling"] * ref_iso_c(taus)
    if method == "wudi":
        return theta0 + ref_wudi([t - theta0 for t in thetas], coef, options["ridge"])
    if method == "model_stock":
        return ref_model_stock(theta0, thetas, coef)
    if method == "slerp":
        return ref_slerp(options["t"], thetas[0], thetas[1])
    defaults = {
        "breadcrumbs": {"scaling": 0.3, "density": 0.9, "gamma": 0.01},
        "della_linear": {"scaling": 0.3, "density": 0.5, "epsilon": 0.15, "seed": 0},
        "della": {"scaling": 1.0, "density": 0.5, "epsilon": 0.15, "seed": 0},
    }
    if method in defaults:
        settings = {**defaults[method], **options}
        return ref_sparsified_merge(method, NAME, theta0, thetas, coef, settings)
    return None  # checked in tests/merge/ only


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_through_the_cli_equals_the_in_memory_door(workspace, method, capsys):
    options = METHODS[method]
    cfg = _config(workspace, method, options)
    out = workspace / f"merged-{method}"
    assert main(["merge", str(cfg), "--out", str(out), "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert f"lmdx merge: {method}" in said
    merged = load_file(str(out / "model.safetensors"))
    k = 2 if method == "slerp" else K
    coef = None if method == "slerp" else tuple(float(i + 1) for i in range(k))
    models = [
        BertForSequenceClassification.from_pretrained(str(workspace / f"m{i}")) for i in range(k)
    ]
    base = None
    if method not in NO_BASE:
        base = BertForSequenceClassification.from_pretrained(str(workspace / "base"))
    memory = merge_models(
        models,
        method,
        base=base,
        coefficients=coef,
        heads=["classifier.*"],
        progress=False,
        **options,
    )
    for name, t in memory.state_dict.items():
        assert np.array_equal(merged[name], t.numpy()), (method, name)
    # one tensor against its reference (float32 models: 1e-6)
    theta0 = load_file(str(workspace / "base" / "model.safetensors"))[NAME].astype(np.float64)
    thetas = [
        load_file(str(workspace / f"m{i}" / "model.safetensors"))[NAME].astype(np.float64)
        for i in range(k)
    ]
    ref = _reference(method, options, theta0, thetas, list(coef or (1.0, 1.0)))
    if ref is not None:
        got = merged[NAME].astype(np.float64)
        assert np.linalg.norm(got - ref) <= 1e-6 * np.linalg.norm(ref), method
    record = json.loads((out / "lmdx_merge.json").read_text())
    assert record["report"]["method"] == method
    assert all(record["report"][key] == value for key, value in options.items())
    card = (out / "README.md").read_text()
    assert f"**{method}**" in card
    assert DESCRIBED[method] in card
    assert ("then SVC (singular value calibration)" in card) == method.endswith("+svc")
    assert all(f"- `{key}`: {value}" in card for key, value in options.items())
    loaded = BertForSequenceClassification.from_pretrained(str(out))
    assert torch.isfinite(loaded(input_ids=torch.tensor([[2, 7, 9, 3]])).logits).all()


def test_methods_lists_every_method_and_svc(capsys):
    assert main(["methods"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for method in METHODS:
        head = method.split("+")[0]
        assert f" {head}: " in text, head
    for key in ("rank_fraction", "common_space_fraction", "ridge", "gamma", "epsilon", "t", "tol"):
        assert f" {key} (default " in text
    assert "+svc: SVC (singular value calibration" in text
    assert "svc_alpha (default 0.1)" in text
