"""Any Hugging Face model a user has: 24 architecture families end to end.

Per family (tests/hf_families.py: tiny models built from configs, never downloaded): two
fine-tuned stand-ins (seeded perturbations of one base), each with its own data;
statistics collected on the models in memory; RegMean in memory (merge_models +
save_merged) and streaming from the saved checkpoints (stream_merge) — bit-identical;
the merged folder reloaded with the model's class and run forward; and chosen layers
checked twice against float64 references computed here: their Grams (this file's own
hooks; for mixture-of-experts layers the tokens the router sent to the expert, and the
expert's down-projection input recomputed in float64) and their merged weight (the
paper's formula in NumPy on those Grams). The README's support table is rendered from
what these runs measure (``support_table``) and checked against the README.
"""

from __future__ import annotations

import copy
import fnmatch
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hf_families as F
import hf_models as H
import numpy as np
import pytest
import torch
import transformers
from lmdx import merge_models, save_merged
from lmdx.files import Checkpoint
from lmdx.merge import stream_merge
from lmdx.stats.collect import collect_regmean_stats
from safetensors.torch import load_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ALPHA = 0.9
K = 2
README = Path(__file__).resolve().parents[2] / "README.md"


@dataclass
class Run:
    """One family through the whole pipeline."""

    family: F.Family
    models: list[Any]
    data: list[list[dict[str, Any]]]
    stats: list[Any]
    folders: list[Path]
    memory: Any  # MergeResult
    memory_dir: Path
    stream: Any  # StreamMergeResult
    stream_dir: Path


_RUNS: dict[str, Run] = {}


def collect(model: Any, batches: Any, **kwargs: Any) -> Any:
    return collect_regmean_stats(model, batches, progress=False, **kwargs)


def run_family(name: str, root: Path) -> Run:
    """Statistics, in-memory and streaming RegMean of family ``name`` (once per session)."""
    if name in _RUNS:
        return _RUNS[name]
    family = F.FAMILIES[name]
    folder = root / re.sub(r"\W+", "_", name)
    folder.mkdir()
    base = F.build(family)
    models = [H.finetuned(base, i) for i in range(K)]
    data = [F.batches(family, 10 + i) for i in range(K)]
    stats = [collect(m, b) for m, b in zip(models, data, strict=True)]
    files = [s.save(folder / f"stats{i}.safetensors") for i, s in enumerate(stats)]
    folders = []
    for i, m in enumerate(models):
        m.save_pretrained(folder / f"model{i}")
        folders.append(folder / f"model{i}")
    kw = {"alpha": ALPHA, "heads": family.heads, "progress": False}
    memory = merge_models(models, "regmean", stats=stats, **kw)
    save_merged(memory, folder / "memory", template=models[0], progress=False)
    stream = stream_merge(folders, folder / "stream", "regmean", stats=files, **kw)
    _RUNS[name] = Run(
        family, models, data, stats, folders, memory, folder / "memory", stream, folder / "stream"
    )
    return _RUNS[name]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


def saved_name(folder: Path, weight: np.ndarray) -> str:
    """The tensor of the checkpoint in ``folder`` holding ``weight`` (``[out, in]``; or
    its transpose), found by value: independent of how lmdx names it."""
    saved = load_file(folder / "model.safetensors")
    target = torch.from_numpy(weight).to(torch.float32)
    hits = [
        n
        for n, t in saved.items()
        if (t.shape == target.shape and torch.equal(t, target))
        or (t.shape == target.T.shape and torch.equal(t, target.T))
    ]
    assert len(hits) == 1, hits
    return hits[0]


def test_the_matrix_has_at_least_20_families_of_every_kind():
    kinds = {f.inputs for f in F.FAMILIES.values()}
    assert len(F.FAMILIES) >= 20 and kinds == {"text", "seq2seq", "image"}
    moe = [f for f in F.FAMILIES.values() if any(c.kind.startswith("expert") for c in f.checks)]
    assert len(moe) >= 3


@pytest.mark.parametrize("name", list(F.FAMILIES))
def test_family_end_to_end(name, root):
    run = run_family(name, root)
    family, stats = run.family, run.stats
    # statistics collected in memory are keyed by the checkpoint's names
    saved = set(Checkpoint(run.folders[0], "model 0").names())
    weights = {info["weight"] for info in stats[0].modules.values()}
    assert weights <= set(stats[0].model["parameters"])
    assert saved <= set(stats[0].model["parameters"])
    tied = run.stream.report.get("tied", {})
    assert weights - set(tied) <= saved
    assert not stats[0].not_solved and "not_solved" not in run.stream.report
    # every statistics module solved, except heads and tied weights
    solved = {stats[0].modules[m]["weight"] for m in run.stream.report["layers"]}
    heads = {w for w in weights if any(fnmatch.fnmatchcase(w, p) for p in family.heads)}
    expected = weights - set(tied) - heads
    assert solved == expected
    # in memory and streaming: the same bits
    a = load_file(run.memory_dir / "model.safetensors")
    b = load_file(run.stream_dir / "model.safetensors")
    assert a.keys() == b.keys()
    assert [n for n in a if not torch.equal(a[n], b[n])] == []
    # the merged folder loads with the model's class and runs
    loaded = getattr(transformers, family.cls).from_pretrained(run.stream_dir).eval()
    with torch.no_grad():
        out = loaded(**run.data[0][0])
    first = out[0] if isinstance(out, tuple) else next(iter(out.values()))
    assert torch.isfinite(first).all()
    # chosen layers: Grams and merged weight against float64 references
    for check in family.checks:
        grams, counts = [], []
        for i, (m, d) in enumerate(zip(run.models, run.data, strict=True)):
            g, n = F.reference_gram(m, family, check, d)
            module = saved_name(run.folders[i], check.weight(m)).removesuffix(".weight")
            got = stats[i].gram(module)
            assert stats[i].count(module) == n, (check, stats[i].count(module), n)
            assert np.linalg.norm(got - g) <= 1e-6 * np.linalg.norm(g), check
            grams.append(g)
            counts.append(n)
        ref = F.regmean_reference(grams, counts, [check.weight(m) for m in run.models], ALPHA)
        assert H.rel_err(torch.from_numpy(check.weight(loaded)), ref) < 1e-5, check


# --------------------------------------------------------------------------- masks per stack


def _without(batches: list[dict[str, Any]], key: str) -> list[dict[str, Any]]:
    return [{k: v for k, v in b.items() if k != key} for b in batches]


@pytest.mark.parametrize("name", ["T5", "BART"])
def test_decoder_rows_all_count_without_a_decoder_mask(name, root):
    run = run_family(name, root)
    model, data = run.models[0], run.data[0]
    stats = collect(model, _without(data, "decoder_attention_mask"))
    decoder_rows = sum(b["decoder_input_ids"].numel() for b in data)
    encoder_rows = sum(float(b["attention_mask"].sum()) for b in data)
    for check in run.family.checks:
        module = saved_name(run.folders[0], check.weight(model)).removesuffix(".weight")
        expected = encoder_rows if check.stack == "encoder" else decoder_rows
        assert stats.count(module) == expected, (check.module, stats.count(module), expected)
    # with the mask, the decoder's padding is left out
    masked = sum(float(b["decoder_attention_mask"].sum()) for b in data)
    assert masked < decoder_rows
    decoder_check = next(c for c in run.family.checks if c.stack == "decoder")
    module = saved_name(run.folders[0], decoder_check.weight(model)).removesuffix(".weight")
    assert run.stats[0].count(module) == masked


@pytest.mark.parametrize("name", ["T5", "BART"])
def test_encoder_decoder_grams_do_not_depend_on_batching(name, root):
    """Padding excluded per stack: re-batching the same sequences (other padding in both
    stacks) gives the same Grams."""
    run = run_family(name, root)
    model, data = run.models[0], run.data[0]
    rebatched = F.batches(run.family, 10, batch_size=5)
    assert [b["input_ids"].shape for b in rebatched] != [b["input_ids"].shape for b in data]
    a, b = run.stats[0], collect(model, rebatched)
    assert a.modules == b.modules
    for module in a.modules:
        assert a.count(module) == b.count(module)
        ga, gb = a.gram(module), b.gram(module)
        assert np.linalg.norm(ga - gb) <= 1e-6 * np.linalg.norm(ga), module


def test_encoder_decoder_batches_need_decoder_inputs(root):
    run = run_family("BART", root)
    with pytest.raises(
        ValueError, match=r"encoder-decoder model; every batch needs decoder_input_ids"
    ):
        collect(run.models[0], _without(run.data[0], "decoder_input_ids"))


@pytest.mark.parametrize("name", ["T5", "Mixtral"])
def test_several_passes_give_the_same_statistics(name, root, tmp_path):
    """Bounded memory (a pass per few groups, the forward pass stopped early where the
    wiring allows) and the in-memory collection give the same bits."""
    run = run_family(name, root)
    one = run.stats[0]
    several = collect(run.models[0], run.data[0], out=tmp_path / "s", max_memory=4000)
    assert several.extra["passes"] > 3
    assert several.modules == one.modules and several.groups.keys() == one.groups.keys()
    for module in one.modules:
        assert np.array_equal(several.gram(module), one.gram(module)), module


# --------------------------------------------------------------------------- MoE


def test_experts_of_an_unknown_interface_are_averaged_and_reported(root):
    """Experts lmdx cannot route (here: Mixtral's experts behind a forward with other
    argument names) are not solved: averaged, and listed with why."""
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    class OtherExperts(MixtralExperts):
        def forward(self, states, index, weights):  # the same math, other argument names
            return super().forward(states, index, weights)

    run = run_family("Mixtral", root)
    models = [copy.deepcopy(m) for m in run.models]
    for m in models:
        for module in m.modules():
            if isinstance(module, MixtralExperts):
                module.__class__ = OtherExperts
    stats = [collect(m, d) for m, d in zip(models, run.data, strict=True)]
    missing = stats[0].not_solved
    experts = {n for n in Checkpoint(run.folders[0], "m").names() if ".experts." in n}
    assert set(missing) == experts
    assert all("not of transformers' fused-experts interface" in why for why in missing.values())
    assert not any(".experts." in m for m in stats[0].modules)
    result = merge_models(models, "regmean", stats=stats, alpha=ALPHA, progress=False)
    assert set(result.report["not_solved"]) == experts
    for n in experts:
        a, b = (load_file(f / "model.safetensors")[n].double() for f in run.folders)
        assert torch.allclose(result.state_dict[n].double(), (a + b) / 2, rtol=1e-6, atol=0), n


# --------------------------------------------------------------------------- other kinds


def test_fisher_is_keyed_by_the_saved_names(root, tmp_path):
    """ViT's in-memory names differ from its checkpoint's: the Fisher follows the saved
    names, so a streaming Fisher merge of the checkpoints uses it for every parameter."""
    from lmdx.stats.fisher import collect_fisher

    run = run_family("ViT", root)
    fishers = [
        collect_fisher(m, d[:1], progress=False).save(tmp_path / f"f{i}.safetensors")
        for i, (m, d) in enumerate(zip(run.models, run.data, strict=True))
    ]
    from lmdx.stats import Statistics

    loaded = [Statistics.load(f) for f in fishers]
    names = set(Checkpoint(run.folders[0], "m").names())
    assert set(loaded[0].parameters) == names
    assert "vit.encoder.layer.0.attention.attention.query.weight" in names
    out = tmp_path / "fisher"
    stream_merge(run.folders, out, "fisher", stats=fishers, heads=run.family.heads, progress=False)
    merged = load_file(out / "model.safetensors")
    name = "vit.encoder.layer.1.attention.attention.value.weight"
    theta = [load_file(f / "model.safetensors")[name].double() for f in run.folders]
    weight = [s.fisher(name) / s.count() + 1e-8 for s in loaded]
    ref = sum(torch.from_numpy(w) * t for w, t in zip(weight, theta, strict=True)) / sum(
        torch.from_numpy(w) for w in weight
    )
    assert H.rel_err(merged[name], ref.numpy()) < 1e-6


def test_load_merged_gives_each_vision_classifier(root):
    from lmdx import load_merged

    run = run_family("ViT", root)
    for task in range(K):
        model = load_merged(run.stream_dir, task=task, progress=False)
        assert torch.equal(model.classifier.weight, run.models[task].classifier.weight)
        merged_query = run.memory.state_dict["vit.encoder.layer.1.attention.attention.query.weight"]
        assert torch.equal(model.vit.layers[1].attention.q_proj.weight, merged_query)
