"""``lmdx stats`` on image data for a vision model, then ``lmdx merge``.

Tiny ViT classifiers (tests/hf_families.py) saved with an image processor; DATA is a
folder of PNG/JPEG files or a ``.npy`` array of pixel values. References: the Gram of one
layer's input from this file's own hooks on pixel values made here with the same
processor, in float64; the merged folder's forward pass.
"""

from __future__ import annotations

import re
from pathlib import Path

import hf_families as F
import hf_models as H
import numpy as np
import pytest
import torch
import transformers
from lmdx.cli import main
from lmdx.stats import Statistics
from PIL import Image

pytestmark = pytest.mark.usefixtures("one_torch_thread")

FAMILY = F.FAMILIES["ViT"]
CHECK = F.Check("vit.layers.1.mlp.fc1", stack=None)
SAVED = "vit.encoder.layer.1.intermediate.dense"  # CHECK's module in the checkpoint


def _processor() -> transformers.ViTImageProcessor:
    return transformers.ViTImageProcessor(size={"height": F.IMAGE, "width": F.IMAGE})


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("images-cli")
    base = F.build(FAMILY)
    for i in range(2):
        H.finetuned(base, i).save_pretrained(root / f"m{i}")
        _processor().save_pretrained(root / f"m{i}")
    rng = np.random.default_rng(5)
    (root / "photos").mkdir()
    for j in range(11):
        pixels = rng.integers(0, 256, (int(rng.integers(12, 30)), int(rng.integers(12, 30)), 3))
        suffix = ".png" if j % 2 else ".jpg"
        Image.fromarray(pixels.astype(np.uint8)).save(root / "photos" / f"img{j:02d}{suffix}")
    return root


def _stats(args: list[str]) -> int:
    return main(["stats", *args, "--batch-size", "4", "--no-progress"])


def test_stats_of_an_image_folder_equals_the_reference(workspace: Path) -> None:
    out = workspace / "photos.safetensors"
    assert _stats([str(workspace / "m0"), str(workspace / "photos"), "--out", str(out)]) == 0
    stats = Statistics.load(out)
    files = sorted((workspace / "photos").iterdir())
    images = [Image.open(p).convert("RGB") for p in files]
    pixels = _processor()(images, return_tensors="pt")["pixel_values"]
    model = transformers.ViTForImageClassification.from_pretrained(workspace / "m0").eval()
    ref, n = F.reference_gram(model, FAMILY, CHECK, [{"pixel_values": pixels}])
    assert stats.count(SAVED) == n == 11 * 5  # 4 patches + the class token per image
    assert np.linalg.norm(stats.gram(SAVED) - ref) <= 1e-6 * np.linalg.norm(ref)
    assert stats.data == f"11 images from {workspace / 'photos'}"


def test_stats_of_a_npy_file_of_pixel_values(workspace: Path) -> None:
    pixels = np.random.default_rng(6).standard_normal((7, 3, F.IMAGE, F.IMAGE))
    np.save(workspace / "pixels.npy", pixels.astype(np.float32))
    out = workspace / "npy.safetensors"
    args = [str(workspace / "m1"), str(workspace / "pixels.npy"), "--max-texts", "6"]
    assert _stats([*args, "--out", str(out)]) == 0
    stats = Statistics.load(out)
    model = transformers.ViTForImageClassification.from_pretrained(workspace / "m1").eval()
    data = [{"pixel_values": torch.from_numpy(pixels[:6].astype(np.float32))}]
    ref, n = F.reference_gram(model, FAMILY, CHECK, data)
    assert stats.count(SAVED) == n == 6 * 5
    assert np.linalg.norm(stats.gram(SAVED) - ref) <= 1e-6 * np.linalg.norm(ref)


def test_merge_of_vision_models_keeps_the_image_processor(workspace: Path) -> None:
    for i in range(2):
        out = workspace / f"s{i}.safetensors"
        assert _stats([str(workspace / f"m{i}"), str(workspace / "photos"), "--out", str(out)]) == 0
    (workspace / "merge.yaml").write_text(
        "method: regmean\nmodels:\n"
        "  - {path: m0, stats: s0.safetensors}\n  - {path: m1, stats: s1.safetensors}\n"
        "alpha: 0.9\nheads: {patterns: ['classifier.*'], policy: keep}\n"
    )
    merged = workspace / "merged"
    assert (
        main(["merge", str(workspace / "merge.yaml"), "--out", str(merged), "--no-progress"]) == 0
    )
    assert (merged / "preprocessor_config.json").is_file()
    processor = transformers.AutoImageProcessor.from_pretrained(merged)
    model = transformers.ViTForImageClassification.from_pretrained(merged).eval()
    image = Image.open(sorted((workspace / "photos").iterdir())[0]).convert("RGB")
    with torch.no_grad():
        logits = model(**processor([image], return_tensors="pt")).logits
    assert logits.shape == (1, 3) and torch.isfinite(logits).all()


@pytest.mark.parametrize(
    ("setup", "match"),
    [
        ("broken", r"broken\.png is not a readable image"),
        ("other-file", r"notes\.txt is not an image file"),
        ("empty", r"no images"),
        ("bad-npy", r"expected a float array of pixel values .* shape \(3, 16\)"),
        ("pickle-npy", r"not a NumPy \.npy array file"),
        ("no-processor", r"no image processor \(preprocessor_config\.json\)"),
    ],
)
def test_bad_image_data_is_a_one_line_error(
    workspace: Path, tmp_path: Path, setup: str, match: str, capsys: pytest.CaptureFixture[str]
) -> None:
    model, data = workspace / "m0", tmp_path / "data"
    if setup in ("broken", "other-file", "empty", "no-processor"):
        data.mkdir()
        if setup != "empty":
            Image.new("RGB", (20, 20)).save(data / "a.png")
        if setup == "broken":
            (data / "broken.png").write_bytes(b"not a png at all")
        if setup == "other-file":
            (data / "notes.txt").write_text("hello")
        if setup == "no-processor":
            model = tmp_path / "bare"
            transformers.ViTForImageClassification(FAMILY.config()).save_pretrained(model)
    elif setup == "bad-npy":
        data = tmp_path / "bad.npy"
        np.save(data, np.zeros((3, 16), dtype=np.float32))
    else:
        data = tmp_path / "objects.npy"
        np.save(data, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    out = tmp_path / "s.safetensors"
    capsys.readouterr()  # what the setup printed
    assert _stats([str(model), str(data), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("lmdx stats: error: DATA") and err.count("\n") == 1, err
    assert re.search(match, err), err
    assert not out.exists()
