"""How a Gram is accumulated (``accumulation``: "mixed" or "float64"), one name for it in
the API, ``lmdx stats`` and the statistics file; ``precision`` (its earlier name, now the
merge's solve only) still works with a deprecation note, and older files that record it
as ``extra["precision"]`` read the same. Also the collector's keyword-only options and the
one "stop the forward pass" mechanism (``lmdx.stats.stop``).

Grams are checked against float64 Grams of the inputs captured by this suite's own hooks
(``hf_models.reference_grams``).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import hf_models as H
import numpy as np
import pytest
import torch
from lmdx.cli import main
from lmdx.stats import Statistics, add_statistics
from lmdx.stats.collect import collect_regmean_stats
from lmdx.stats.collector import GramCollector
from lmdx.stats.format import metadata_hash
from lmdx.stats.sites import find_linear_modules
from lmdx.stats.stop import run_until_stopped, stop_before, stop_forward
from tiny_bert import build_tiny_bert, random_texts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _collect(model, data, **kwargs):
    return collect_regmean_stats(model, data, progress=False, n_threads=1, **kwargs)


def test_float64_accumulation_is_exact_and_recorded():
    _, models, batches = H.cached_family("bert")
    model, data = models[0], list(batches[0])
    ref = H.reference_grams(model, data, False)
    exact = _collect(model, data, accumulation="float64")
    mixed = _collect(model, data)
    assert (exact.accumulation, mixed.accumulation) == ("float64", "mixed")
    assert exact.extra["accumulation"] == "float64" and "precision" not in exact.extra
    for name, r in ref.items():
        # float32 activations widened to float64: only the float64 sums' rounding
        assert H.rel_err(exact.gram(name), r["gram"]) <= 1e-12, name
        assert H.rel_err(mixed.gram(name), r["gram"]) <= 1e-6, name
    assert any(H.rel_err(mixed.gram(n), r["gram"]) > 1e-12 for n, r in ref.items())


def test_precision_is_a_deprecated_spelling_of_accumulation():
    _, models, batches = H.cached_family("bert")
    model, data = models[0], list(batches[0])
    with pytest.warns(DeprecationWarning, match=r"precision= is deprecated.*accumulation="):
        old = _collect(model, data, precision="float64")
    new = _collect(model, data, accumulation="float64")
    assert old.accumulation == "float64"
    for name in new.modules:
        assert np.array_equal(old.gram(name), new.gram(name)), name
    with pytest.raises(ValueError, match=r"accumulation='float64' and precision='mixed' disagree"):
        with pytest.warns(DeprecationWarning):
            _collect(model, data, accumulation="float64", precision="mixed")


@pytest.mark.parametrize("value", ["half", "float32", "auto"])
def test_unknown_accumulation_is_an_error(value):
    _, models, batches = H.cached_family("bert")
    with pytest.raises(
        ValueError, match=rf"accumulation: expected 'mixed' or 'float64', got '{value}'"
    ):
        _collect(models[0], list(batches[0]), accumulation=value)


def _as_older_file(path: Path, out: Path) -> None:
    """``path`` rewritten as lmdx wrote it before the rename: ``extra["precision"]``, with
    the metadata's hash recomputed and the tensors' bytes unchanged."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    meta = json.loads(header["__metadata__"]["lmdx"])
    meta["extra"]["precision"] = meta["extra"].pop("accumulation")
    meta["blake3"]["metadata"] = metadata_hash(meta)
    header["__metadata__"]["lmdx"] = json.dumps(meta)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    out.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])


@pytest.mark.parametrize("accumulation", ["mixed", "float64"])
def test_older_files_recording_precision_read_the_same(tmp_path, accumulation):
    _, models, batches = H.cached_family("bert")
    new = tmp_path / "new.safetensors"
    _collect(models[0], list(batches[0]), accumulation=accumulation, out=new)
    old = tmp_path / "old.safetensors"
    _as_older_file(new, old)
    assert "precision" in old.read_bytes().decode("latin-1")
    a, b = Statistics.load(old), Statistics.load(new)
    assert a.accumulation == b.accumulation == accumulation
    assert "precision" not in a.extra and a.extra == b.extra
    for name in b.modules:
        assert np.array_equal(a.gram(name), b.gram(name)), name


def test_statistics_without_accumulation_say_so():
    stats = Statistics(kind="regmean-gram", model={"architecture": "X", "parameters": {}})
    assert stats.accumulation is None


# --------------------------------------------------------------------------- lmdx stats


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("accumulation")
    build_tiny_bert(root / "model")
    rng = np.random.default_rng(4)
    (root / "texts.txt").write_text("\n".join(random_texts(rng, 12)) + "\n")
    return root


def _stats_cli(workspace: Path, out: Path, *flags: str) -> int:
    argv = ["stats", str(workspace / "model"), str(workspace / "texts.txt"), "--out", str(out)]
    return main([*argv, "--no-progress", *flags])


def test_cli_accumulation_and_its_deprecated_flag(workspace, tmp_path, capsys):
    assert _stats_cli(workspace, tmp_path / "a.safetensors", "--accumulation", "float64") == 0
    assert "deprecated" not in capsys.readouterr().err
    assert _stats_cli(workspace, tmp_path / "b.safetensors", "--float64-products") == 0
    err = capsys.readouterr().err
    assert "--float64-products is deprecated; write --accumulation float64" in err
    assert _stats_cli(workspace, tmp_path / "c.safetensors") == 0
    a, b, c = (Statistics.load(tmp_path / f"{x}.safetensors") for x in "abc")
    assert (a.accumulation, b.accumulation, c.accumulation) == ("float64", "float64", "mixed")
    for name in a.modules:
        assert np.array_equal(a.gram(name), b.gram(name)), name
    assert main(["stats", "show", str(tmp_path / "a.safetensors")]) == 0
    assert "accumulation: float64" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("flags", "match"),
    [
        (["--accumulation", "half"], "--accumulation: expected one of mixed, float64, got half"),
        (
            ["--accumulation", "mixed", "--float64-products"],
            "--float64-products and --accumulation mixed disagree",
        ),
    ],
)
def test_cli_bad_accumulation(workspace, tmp_path, capsys, flags, match):
    out = tmp_path / "x.safetensors"
    assert _stats_cli(workspace, out, *flags) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines()[-1].startswith("lmdx stats: error: "), err
    assert match in err
    assert not out.exists()


# --------------------------------------------------------------------------- the collector


def test_collector_options_are_keyword_only():
    _, models, _ = H.cached_family("bert")
    modules = find_linear_modules(models[0])
    with pytest.raises(TypeError, match="positional"):
        GramCollector(modules, False, True, "attention_mask", 1)  # type: ignore[misc]
    collector = GramCollector(modules, n_threads=1)
    assert (collector.include_padding, collector.share_inputs) == (False, True)
    assert (collector.mask_key, collector.accumulation) == ("attention_mask", "mixed")


# --------------------------------------------------------------------------- stopping


class _Chain(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(3, 3) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _ran(model: _Chain, stop: torch.nn.Module | None) -> tuple[bool, list[int]]:
    """Whether a hook stopped the forward pass, and the layers that ran (to their end)."""
    seen: list[int] = []
    handles = [
        m.register_forward_hook(lambda m, a, out, i=i: seen.append(i))
        for i, m in enumerate(model.layers)
    ]
    try:
        with stop_before(stop):
            stopped = run_until_stopped(lambda: model(torch.ones(2, 3)))
    finally:
        for h in handles:
            h.remove()
    return stopped, seen


def test_stop_before_ends_the_forward_pass_there():
    model = _Chain()
    assert _ran(model, model.layers[1]) == (True, [0])
    assert _ran(model, None) == (False, [0, 1, 2])
    assert _ran(model, model.layers[0])[1] == []
    # the hook is gone after the block, and other errors pass through
    assert _ran(model, None) == (False, [0, 1, 2])

    def broken() -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        run_until_stopped(broken)
    assert run_until_stopped(stop_forward) is True  # a hook's own call ends the pass


@pytest.mark.parametrize(
    ("first", "second", "added"),
    [("mixed", "mixed", "mixed"), ("float64", "float64", "float64"), ("float64", "mixed", "mixed")],
)
def test_added_statistics_keep_the_coarsest_accumulation(first, second, added):
    _, models, batches = H.cached_family("bert")
    a = _collect(models[0], list(batches[0]), accumulation=first)
    b = _collect(models[0], list(batches[0]), accumulation=second)
    assert add_statistics([a, b]).accumulation == added


def test_added_statistics_with_a_part_that_does_not_say_do_not_say():
    _, models, batches = H.cached_family("bert")
    a = _collect(models[0], list(batches[0]), accumulation="float64")
    b = _collect(models[0], list(batches[0]), accumulation="float64")
    del b.extra["accumulation"]
    assert add_statistics([a, b]).accumulation is None
