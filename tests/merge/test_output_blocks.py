"""RegMean groups solved in blocks of output rows (lmdx.merge.builtin.regmean_solve).

A block's rows are solved from the same system as the whole group's, so the blocked
result must equal the RegMean formula (an independent float64 NumPy solve) and the whole
solve, for every block size and every split of a group's members over the blocks; rows
read from a checkpoint alone must be the rows of the whole tensor, bit for bit; and a
streaming merge under a tiny budget must give the merge without one.
"""

from __future__ import annotations

import hf_models as H
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lmdx import MergeError
from lmdx.files import Checkpoint
from lmdx.merge import stream_merge
from lmdx.merge.builtin.average import average_in_blocks, average_tensor
from lmdx.merge.builtin.regmean_solve import (
    group_memory,
    output_block_rows,
    output_block_size,
    solve_group,
    solve_in_output_blocks,
)
from lmdx.merge.method import Step
from lmdx.merge.options import SOLVE_MEMORY_ENV
from lmdx.merge.registry import merge_options, method_named
from lmdx.merge.source import StateDictSource
from lmdx.moments import Moments
from lmdx.stats import Statistics
from safetensors.torch import save_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _checked(k, method="regmean", **kwargs):
    """A merge's checked options, as a front door makes them from its keywords."""
    return merge_options(k, method, kwargs)


def _problem(seed: int, k: int, d: int, sizes: list[int]):
    """K models of one RegMean group (members of ``sizes`` output rows, ``d`` inputs):
    float64 weights close to each other, and their statistics from random rows."""
    rng = np.random.default_rng(seed)
    members = [f"layer.m{j}" for j in range(len(sizes))]
    base = [rng.standard_normal((m, d)) for m in sizes]
    sources, stats = [], []
    for i in range(k):
        state = {
            f"{m}.weight": torch.from_numpy(b + 0.1 * rng.standard_normal(b.shape))
            for m, b in zip(members, base, strict=True)
        }
        sources.append(StateDictSource(state, f"model{i}"))
        rows = rng.standard_normal((3 * d + 2, d)) * rng.uniform(0.5, 2.0, d)
        mom = Moments(d)
        mom.update(rows)
        stats.append(
            Statistics(
                kind="regmean-gram",
                model={},
                modules={
                    m: {"group": "g", "layout": "linear", "weight": f"{m}.weight", "dim": d}
                    for m in members
                },
                groups={"g": {"dim": d, "count": mom.count}},
                moments={"g": mom},
            )
        )
    step = Step(method_named("regmean"), [f"{m}.weight" for m in members], members, "linear", d)
    return step, sources, stats


def _reference(step, sources, stats, alpha):
    """W_M = (Σ G̃_i)⁻¹ Σ G̃_i W_iᵀ, transposed, in float64 NumPy (G̃ = α Ĝ + (1-α) diag Ĝ)."""
    lhs, rhs = 0.0, 0.0
    for src, s in zip(sources, stats, strict=True):
        g = s.gram(step.modules[0]) / s.count(step.modules[0])
        g = alpha * g + (1 - alpha) * np.diag(np.diag(g))
        w = np.concatenate([src.read(t).numpy() for t in step.tensors])
        lhs, rhs = lhs + g, rhs + g @ w.T
    return np.linalg.solve(lhs, rhs).T


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    k=st.integers(2, 4),
    d=st.integers(2, 9),
    sizes=st.lists(st.integers(1, 13), min_size=1, max_size=3),
    block=st.integers(1, 12),
    alpha=st.sampled_from([1.0, 0.9, 0.0]),
)
def test_blocks_equal_the_formula_and_the_whole_solve(seed, k, d, sizes, block, alpha):
    step, sources, stats = _problem(seed, k, d, sizes)
    options = _checked(k, alpha=alpha, precision="float64", n_threads=1)
    grams = [s.gram_stored(step.modules[0]) for s in stats]
    labels = [f"model{i}" for i in range(k)]
    merged, layers = solve_in_output_blocks(step, sources, stats, grams, labels, options, block)
    got = np.concatenate([merged[t] for t in step.tensors])
    ref = _reference(step, sources, stats, alpha)
    assert np.abs(got - ref).max() <= 1e-10 * np.abs(ref).max()
    weights = [[src.read(t) for t in step.tensors] for src in sources]
    whole, whole_layers = solve_group(step.modules, weights, grams, stats, labels, options)
    for t in step.tensors:
        assert merged[t].dtype == np.float64
        assert np.abs(merged[t] - whole[t]).max() <= 1e-12 * np.abs(ref).max()
    blocks = -(-sum(sizes) // block)
    for m in step.modules:
        assert layers[m]["output_blocks"] == blocks
        assert layers[m]["precision"] == whole_layers[m]["precision"] == "float64"
        assert layers[m]["shared_with"] == whole_layers[m]["shared_with"]


def test_auto_precision_blocks_report_their_worst_estimate():
    step, sources, stats = _problem(7, 3, 8, [40, 24])
    options = _checked(3, alpha=0.9, precision="auto", n_threads=1)
    grams = [s.gram_stored(step.modules[0]) for s in stats]
    merged, layers = solve_in_output_blocks(
        step, sources, stats, grams, ["a", "b", "c"], options, 16
    )
    ref = _reference(step, sources, stats, 0.9)
    got = np.concatenate([merged[t] for t in step.tensors])
    assert np.abs(got - ref).max() <= 1e-10 * np.abs(ref).max()
    assert layers[step.modules[0]]["output_blocks"] == 4
    assert layers[step.modules[0]]["output_error_estimate"] <= 1e-6


@settings(max_examples=40, deadline=None)
@given(
    d=st.integers(1, 5000),
    rows=st.integers(1, 200000),
    k=st.integers(1, 8),
    stored=st.sampled_from([2, 4, 8]),
    budget=st.integers(1, 10**10),
)
def test_block_rows_fit_the_budget_or_are_the_least_allowed(d, rows, k, stored, budget):
    block = output_block_rows(d, rows, k, stored, budget)
    assert 1 <= block <= rows
    if group_memory(d, rows, k, stored) <= budget:
        assert block == rows
    else:
        assert block >= min(rows, d)
        assert block == min(rows, d) or group_memory(d, block, k, stored) <= budget
        # not needlessly small: a fifth more rows would not fit
        more = min(rows, block + block // 5 + 1)
        assert more == block or group_memory(d, more, k, stored) > budget


def test_small_groups_are_not_blocked(monkeypatch):
    step, sources, _ = _problem(1, 3, 4, [5])
    assert output_block_size(step, sources, _checked(3)) is None
    tiny = _checked(3, solve_memory=100)
    assert output_block_size(step, sources, tiny) == 4  # at least d_in rows
    monkeypatch.setenv(SOLVE_MEMORY_ENV, "100B")
    assert _checked(3).solve_memory == 100
    assert _checked(3, solve_memory="2GB").solve_memory == 2 * 10**9  # option first
    monkeypatch.setenv(SOLVE_MEMORY_ENV, "lots")
    with pytest.raises(
        MergeError, match=r"^solve_memory: LMDX_SOLVE_MEMORY='lots' \(its default\) must be a size"
    ):
        _checked(3)
    with pytest.raises(
        MergeError, match=r"^solve_memory: must be a size such as '2GB'.*, got '-1GB'"
    ):
        _checked(3, solve_memory="-1GB")


def test_rows_read_alone_are_the_tensors_rows(tmp_path):
    rng = np.random.default_rng(3)
    w = torch.from_numpy(rng.standard_normal((37, 6)).astype(np.float32)).to(torch.bfloat16)
    b = torch.from_numpy(rng.standard_normal(5).astype(np.float32))
    save_file({"w": w, "b": b}, str(tmp_path / "model.safetensors"))
    ckpt = Checkpoint(tmp_path)
    whole = ckpt.read("w")
    for lo, hi in ((0, 37), (0, 1), (5, 17), (36, 37), (9, 9)):
        part = ckpt.read_rows("w", lo, hi)
        assert part.dtype == whole.dtype and part.shape == (hi - lo, 6)
        assert part.tobytes() == whole[lo:hi].tobytes()
    assert ckpt.read_rows("b", 1, 4).tobytes() == ckpt.read("b")[1:4].tobytes()
    with pytest.raises(MergeError, match="tensor 'w' has no rows 30:40"):
        ckpt.read_rows("w", 30, 40)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """Three tiny Llama checkpoints and their statistics files."""
    root = tmp_path_factory.mktemp("llama")
    _, models, batches = H.cached_family("llama")
    paths, stats = [], []
    for i, (m, b) in enumerate(zip(models, batches, strict=True)):
        m.save_pretrained(root / f"m{i}")
        paths.append(root / f"m{i}")
        stats.append(H.collect(m, b).save(root / f"s{i}.safetensors"))
    return paths, stats


def test_stream_merge_in_blocks_equals_the_whole_merge(llama, tmp_path, monkeypatch):
    paths, stats = llama
    kw = {"alpha": 0.9, "precision": "float64", "progress": False}
    monkeypatch.delenv(SOLVE_MEMORY_ENV, raising=False)
    whole = stream_merge(paths, tmp_path / "whole", stats=stats, **kw)
    blocked = stream_merge(paths, tmp_path / "blocked", stats=stats, solve_memory="1B", **kw)
    assert blocked.report["solve_memory"] == 1
    blocks = {m: v.get("output_blocks", 1) for m, v in blocked.report["layers"].items()}
    assert max(blocks.values()) > 1
    assert "output_blocks" not in next(iter(whole.report["layers"].values()))
    a, b = Checkpoint(tmp_path / "whole"), Checkpoint(tmp_path / "blocked")
    assert a.names() == b.names()
    for n in a.names():
        x, y = np.asarray(a.read(n), np.float64), np.asarray(b.read(n), np.float64)
        assert np.abs(x - y).max() <= 1e-6 * max(np.abs(x).max(), 1e-30), n


def test_dry_run_estimates_the_blocks(llama, tmp_path, monkeypatch):
    """The plan's memory per step is that of one block where a step is done in blocks:
    with a budget between a group's smallest block and the whole group, every blocked
    group's estimate stays within it and below the whole; with room, nothing changes."""
    paths, stats = llama
    monkeypatch.delenv(SOLVE_MEMORY_ENV, raising=False)

    def plan(budget):
        res = stream_merge(paths, tmp_path / "p", stats=stats, dry_run=True, solve_memory=budget)
        return {s.tensors[0]: s for s in res.plan.steps}

    whole = plan(None)
    groups = {t: s for t, s in whole.items() if s.kind == "regmean"}
    largest = max(groups.values(), key=lambda s: s.memory)
    k, stored = len(paths), 4  # float32 checkpoints
    least = group_memory(largest.dim, largest.dim, k, stored, members=len(largest.tensors))
    assert least < largest.memory  # the group has more output rows than inputs
    budget = (least + largest.memory) // 2
    cut = plan(budget)
    assert least <= cut[largest.tensors[0]].memory <= budget
    for t, s in groups.items():
        got = cut[t].memory
        assert got == s.memory if s.memory <= budget else got <= max(budget, least), t
    roomy = plan(10**12)
    assert all(roomy[t].memory == s.memory for t, s in whole.items())


def test_config_and_cli_set_the_budget(llama, tmp_path, capsys):
    """``solve_memory:`` in the config, ``--solve-memory`` over it; recorded in
    ``lmdx_merge.json``; a bad size is one line."""
    import json

    from lmdx.cli import main

    paths, stats = llama
    models = "".join(f"  - {{path: {p}, stats: {s}}}\n" for p, s in zip(paths, stats, strict=True))
    cfg = tmp_path / "merge.yaml"
    cfg.write_text(f"method: regmean\nmodels:\n{models}alpha: 0.9\nsolve_memory: 1B\n")
    out = tmp_path / "a"
    assert main(["merge", str(cfg), "--out", str(out), "--no-progress"]) == 0
    report = json.loads((out / "lmdx_merge.json").read_text())["report"]
    assert report["solve_memory"] == 1
    assert max(v.get("output_blocks", 1) for v in report["layers"].values()) > 1
    out = tmp_path / "b"
    argv = ["merge", str(cfg), "--out", str(out), "--no-progress", "--solve-memory", "1GB"]
    assert main(argv) == 0
    report = json.loads((out / "lmdx_merge.json").read_text())["report"]
    assert report["solve_memory"] == 10**9
    assert all("output_blocks" not in v for v in report["layers"].values())
    capsys.readouterr()
    argv = ["merge", str(cfg), "--out", str(tmp_path / "c"), "--solve-memory", "lots"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--solve-memory: must be a size such as '2GB'" in err[0], err
    assert err[0].endswith(", got 'lots'"), err
    cfg.write_text(f"method: regmean\nmodels:\n{models}solve_memory: [1]\n")
    assert main(["merge", str(cfg), "--out", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "solve_memory" in err[0] and "size" in err[0], err
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**31),
    k=st.integers(2, 4),
    shape=st.tuples(st.integers(1, 40), st.integers(1, 7)),
    budget=st.integers(1, 4000),
    weighted=st.booleans(),
)
def test_averages_in_blocks_equal_the_formula_and_the_whole_average(
    seed, k, shape, budget, weighted
):
    rng = np.random.default_rng(seed)
    values = [rng.standard_normal(shape) for _ in range(k)]
    sources = [StateDictSource({"e": torch.from_numpy(v)}, f"m{i}") for i, v in enumerate(values)]
    coef = tuple(rng.uniform(0.1, 2.0, k)) if weighted else None
    options = _checked(k, method="average", coefficients=coef, n_threads=1, solve_memory=budget)
    got = average_in_blocks("e", sources, options)
    c = np.ones(k) if coef is None else np.asarray(coef)
    ref = sum(ci * v for ci, v in zip(c, values, strict=True)) / c.sum()
    row = shape[1] * (k * 12 + 16)
    if row * shape[0] <= budget:
        assert got is None
        return
    assert got is not None and got.dtype == np.float64
    assert np.abs(got - ref).max() <= 1e-14 * max(np.abs(ref).max(), 1.0)
    whole = average_tensor("e", values, options)
    assert got.tobytes() == whole.tobytes()


RAY_SCRIPT = """
import sys
import numpy as np
from lmdx.files import Checkpoint
from lmdx.merge import stream_merge
paths, stats, out = sys.argv[1:4], sys.argv[4:7], sys.argv[7]
kw = {"stats": stats, "alpha": 0.9, "progress": False}
local = stream_merge(paths, out + "/local", **kw)
remote = stream_merge(paths, out + "/ray", ray_workers=2, **kw)
blocks = max(v.get("output_blocks", 1) for v in remote.report["layers"].values())
a, b = Checkpoint(local.out_dir), Checkpoint(remote.out_dir)
same = a.names() == b.names() and all(np.array_equal(a.read(n), b.read(n)) for n in a.names())
print("RESULT", remote.report["ray_workers"], blocks > 1, same,
      remote.report["layers"] == local.report["layers"])
"""


@pytest.mark.slow  # Ray starts
def test_blocks_on_ray_workers_give_the_local_merge(tmp_path):
    """Ray workers solve through the same step, with the merge's budget (here from
    LMDX_SOLVE_MEMORY, read once where the merge starts; it travels with the options):
    the same blocks, bit-identical tensors."""
    import os
    import subprocess
    import sys

    pytest.importorskip("ray")
    _, models, batches = H.cached_family("llama")
    paths, stats = [], []
    for i, (m, b) in enumerate(zip(models, batches, strict=True)):
        m.save_pretrained(tmp_path / f"m{i}")
        paths.append(str(tmp_path / f"m{i}"))
        stats.append(str(H.collect(m, b).save(tmp_path / f"s{i}.safetensors")))
    env = {**os.environ, SOLVE_MEMORY_ENV: "1B", "LMDX_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", RAY_SCRIPT, *paths, *stats, str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
    assert result == ["RESULT 2 True True True"], out.stdout[-2000:]
