"""Any Hugging Face model a user has: 25 architecture families end to end.

Per family (tests/hf_families.py: tiny models built from configs, never downloaded): two
fine-tuned stand-ins (seeded perturbations of one base), each with its own data;
statistics collected on the models in memory; RegMean in memory (merge_models +
save_merged) and streaming from the saved checkpoints (stream_merge) — bit-identical;
the merged folder reloaded with the model's class and run forward; and chosen layers
checked twice against float64 references computed here: their Grams (this file's own
hooks; for mixture-of-experts layers the tokens the router sent to the expert, and the
expert's down-projection input recomputed in float64) and their merged weight (the
paper's formula in NumPy on those Grams). The support table of docs/guide/models.md is
rendered from what these runs measure (``support_table``) and checked against that page.
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
from lmdx.stats import add_statistics
from lmdx.stats.collect import collect_regmean_stats
from safetensors.torch import load_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")

ALPHA = 0.9
K = 2
SUPPORT_PAGE = Path(__file__).resolve().parents[2] / "docs" / "guide" / "models.md"


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
    # what cannot be solved (a family's 3-D expert tensors saved as they are) is said
    unsolved = {n for n in saved if any(fnmatch.fnmatchcase(n, p) for p in family.unsolved)}
    assert set(stats[0].not_solved) == unsolved
    assert set(run.stream.report.get("not_solved", {})) == unsolved
    for n in unsolved:
        a, b = (load_file(f / "model.safetensors")[n].double() for f in run.folders)
        assert torch.allclose(run.memory.state_dict[n].double(), (a + b) / 2, rtol=1e-6, atol=0)
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
    shard = collect(models[0], run.data[1])
    assert add_statistics([stats[0], shard]).not_solved == missing  # adding keeps it said
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


# --------------------------------------------------------------------------- support table

TABLE_START = "<!-- support table: tests/stats/test_architectures.py -->"
TABLE_END = "<!-- end of support table -->"


def _by_value(run: Run) -> dict[str, tuple[str, Any, bool]]:
    """Model 0's checkpoint tensors -> (in-memory parameter, its module, whether the
    tensor is the whole parameter or an expert's slice of a 3-D one), matched by value:
    independent of lmdx's naming."""
    model = run.models[0]
    modules = dict(model.named_modules())
    params = {n: p.detach() for n, p in model.named_parameters()}
    out = {}
    for name, t in load_file(run.folders[0] / "model.safetensors").items():
        for p_name, p in params.items():
            whole = p.shape == t.shape and torch.equal(p, t)
            if whole or _expert_slice(p, t):
                out[name] = (p_name, modules[p_name.rpartition(".")[0]], whole)
                break
    return out


def _expert_slice(p: torch.Tensor, t: torch.Tensor) -> bool:
    """Whether ``t`` is a run of consecutive rows of one expert of 3-D ``p``."""
    if p.ndim != 3 or t.ndim != 2 or p.shape[2] != t.shape[1] or p.shape[1] < t.shape[0]:
        return False
    k = t.shape[0]
    return any(
        torch.equal(p[e, i : i + k], t)
        for e in range(p.shape[0])
        for i in range(0, p.shape[1] - k + 1)
    )


def support_row(run: Run) -> str:
    """The support table's row for one family, from what its run measured."""
    family, stats, report = run.family, run.stats[0], run.stream.report
    keys = ", ".join(f"`{k}`" for k in run.data[0][0])
    if family.inputs == "seq2seq":
        keys = (
            "`input_ids`, `attention_mask` (encoder, cross-attention k/v); "
            "`decoder_input_ids`, `decoder_attention_mask` (decoder)"
        )
    solved_weights = {stats.modules[m]["weight"] for m in report["layers"]}
    origin = _by_value(run)
    tied = set(report.get("tied", {}))
    output = run.models[0].get_output_embeddings()
    lm_head = [n for n, (p, mod, _w) in origin.items() if mod is output and p.endswith("weight")]
    lm_head += [n for n in tied if n.startswith("lm_head")]
    solved = ["every other linear layer" if stats.not_solved else "every linear layer"]
    if any(stats.modules[m]["layout"] == "conv1d" for m in report["layers"]):
        solved[0] += " (`Conv1D`)"
    linear = (torch.nn.Linear, transformers.pytorch_utils.Conv1D)
    if any(
        n in solved_weights and not isinstance(mod, linear) and whole
        for n, (_p, mod, whole) in origin.items()
    ):
        solved.append("the routers")
    if stats.extra.get("experts"):
        solved.append("each expert from the tokens routed to it")
    if lm_head and lm_head[0] in solved_weights:
        solved.append("the untied LM head")
    averaged: list[str] = []
    heads = set()
    saved = load_file(run.folders[0] / "model.safetensors")
    for n, (_p, mod, _w) in origin.items():
        if n in solved_weights or n in tied:
            continue
        if any(fnmatch.fnmatchcase(n, h) for h in family.heads):
            heads.add(n)
            continue
        if n in stats.not_solved:
            kind = "the fused experts (3-D tensors; not solved, and reported so)"
        elif isinstance(mod, torch.nn.Embedding):
            kind = "embeddings"
        elif isinstance(mod, torch.nn.Conv2d):
            kind = "patch convolution"
        elif n.endswith("bias"):
            kind = "biases"
        elif saved[n].ndim == 1 and "norm" in type(mod).__name__.lower():
            kind = "norms"
        else:
            kind = f"`{n.rpartition('.')[2]}`"
        if kind not in averaged:
            averaged.append(kind)
    first, last = ["embeddings", "patch convolution"], ["biases", "norms"]
    averaged = sorted(averaged, key=lambda k: (k in last, last.index(k) if k in last else 0, k))
    averaged = [k for k in first if k in averaged] + [k for k in averaged if k not in first]
    if lm_head and lm_head[0] in tied:
        averaged.append("the LM head (tied to the embeddings)")
    if heads:
        averaged.append(f"task head ({', '.join(f'`{h}`' for h in family.heads)}) kept per model")
    split = any(not whole for _p, _m, whole in origin.values())
    renamed = any(n != p for n, (p, _m, whole) in origin.items() if whole)
    parts = (["fused experts split per expert"] if split else []) + (["renamed"] if renamed else [])
    form = "; ".join(parts) or "as in memory"
    return (
        f"| {family.name} | `{family.cls}` | {keys} | {'; '.join(solved)} | "
        f"{', '.join(averaged)} | {form} |"
    )


def support_table(root: Path) -> str:
    rows = [support_row(run_family(name, root)) for name in F.FAMILIES]
    head = (
        "| Family | Class tested | Batch keys | Solved by RegMean | Averaged (or kept per model) "
        "| Saved form |\n"
        "|---|---|---|---|---|---|"
    )
    return "\n".join([head, *rows])


def test_support_table_is_what_the_matrix_measures(root):
    table = support_table(root)
    text = SUPPORT_PAGE.read_text(encoding="utf-8")
    assert TABLE_START in text and TABLE_END in text, f"{SUPPORT_PAGE} lacks the table markers"
    written = text.split(TABLE_START, 1)[1].split(TABLE_END, 1)[0].strip()
    assert written == table, f"{SUPPORT_PAGE}: support table out of date; it should read:\n{table}"


def test_only_modules_computing_f_linear_of_their_weight_count_as_linear(rng):
    """A module holding just a 2-D weight is collected when its first output is
    ``F.linear(input, weight, bias)`` on the probe (a router), not otherwise."""

    class Router(torch.nn.Module):  # returns (logits, top-1 index), like MoE routers
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.randn(4, 6, dtype=torch.float64))
            self.bias = torch.nn.Parameter(torch.randn(4, dtype=torch.float64))

        def forward(self, x):
            logits = torch.nn.functional.linear(x, self.weight, self.bias)
            return logits, logits.argmax(-1)

    class Squashed(Router):  # a weight, but not a linear map of the input
        def forward(self, x):
            return torch.tanh(torch.nn.functional.linear(x, self.weight, self.bias))

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.router, self.squashed = Router(), Squashed()

        def forward(self, x):
            return self.router(x)[0] + self.squashed(x)

    torch.manual_seed(0)
    net = Net()
    x = torch.from_numpy(rng.standard_normal((3, 5, 6)))
    stats = collect(net, [{"x": x}])
    assert set(stats.modules) == {"router"}
    rows = x.reshape(-1, 6).numpy()
    assert np.allclose(stats.gram("router"), rows.T @ rows, rtol=1e-12, atol=0)
