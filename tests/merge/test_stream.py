"""Out of core: lmdx.stream_merge and disk-backed / sharded statistics.

The in-memory pipeline (merge_models + save_merged) is checked against float64 NumPy
references in test_merge.py; here the streaming merge must give the very same tensors
(bit for bit: same kernels, same float64 intermediates, same casts), and one RegMean
layer is also checked against the paper's formula directly. Disk-backed statistics
(several passes, written while collecting) must equal the in-memory statistics bit for
bit. Bad inputs (missing or foreign shards, other models' statistics, a full disk) must
fail with a message naming the file or tensor and leave nothing behind, also when the
run is interrupted or killed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import hf_models as H
import numpy as np
import pytest
import torch
from lmdx import (
    DiskFullError,
    MergeError,
    ModelMismatchError,
    StatisticsFileError,
    merge_models,
    save_merged,
)
from lmdx.files import Checkpoint
from lmdx.files import atomic as lmdx_atomic
from lmdx.files import safetensors as lmdx_io
from lmdx.files.atomic import remove_stale_temporaries
from lmdx.files.hf import load_model
from lmdx.merge import stream_merge
from lmdx.merge.registry import methods
from lmdx.stats import Statistics
from lmdx.stats.collect import collect_regmean_stats

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SHARD = 6000  # bytes: several output shards even for the tiny models


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Per architecture: K model folders (sharded safetensors), statistics files, base."""
    root = tmp_path_factory.mktemp("stream")
    out = {}
    for arch in ("bert", "gpt2", "llama"):
        base, models, batches = H.cached_family(arch)
        paths, stats, fishers = [], [], []
        for i, (m, b) in enumerate(zip(models, batches, strict=True)):
            p = root / f"{arch}{i}"
            m.save_pretrained(p, max_shard_size=SHARD)
            paths.append(p)
            stats.append(H.collect(m, b).save(root / f"{arch}{i}.safetensors"))
            if arch == "bert":
                from lmdx.stats.fisher import collect_fisher

                f = collect_fisher(m, H.random_batches(arch, 50 + i, n_sequences=6), progress=False)
                fishers.append(f.save(root / f"{arch}{i}-fisher.safetensors"))
        base_path = root / f"{arch}-base"
        base.save_pretrained(base_path)
        out[arch] = {"models": paths, "stats": stats, "fisher": fishers, "base": base_path}
    return out


def _state(folder):
    return load_model(folder, progress=False).state_dict()


def _assert_same_folder_weights(a, b):
    sa, sb = _state(a), _state(b)
    assert sa.keys() == sb.keys()
    differ = [n for n in sa if not torch.equal(sa[n], sb[n])]
    assert not differ, f"tensors differ: {differ[:5]}"


def _leftovers(folder):
    return [p.name for p in Path(folder).iterdir() if p.name.startswith(".")]


CASES = [
    ("regmean", {"alpha": 0.9}),
    ("regmean", {"alpha": 1.0, "coefficients": (0.5, 2.0, 1.25)}),
    ("average", {}),
    ("task_arithmetic", {"scaling": 0.7}),
    ("ties", {"density": 0.3, "coefficients": (0.5, 2.0, 1.25)}),
    ("dare", {}),
    ("dare_ties", {"density": 0.6, "seed": 5}),
]


@pytest.mark.parametrize("arch", ["bert", "gpt2", "llama"])
@pytest.mark.parametrize(("method", "options"), CASES)
@pytest.mark.parametrize("head_policy", ["keep", "drop"])
def test_streaming_equals_in_memory(folders, tmp_path, arch, method, options, head_policy):
    f = folders[arch]
    kwargs = dict(options, heads=H.HEADS[arch])
    if method == "regmean":
        kwargs["stats"] = f["stats"]
    if methods()[method].needs_base:
        kwargs["base"] = f["base"]
    mem = merge_models(f["models"], method, progress=False, **kwargs)
    a = save_merged(mem, tmp_path / "mem", f["models"][0], head_policy=head_policy, progress=False)
    res = stream_merge(
        f["models"],
        tmp_path / "stream",
        method,
        head_policy=head_policy,
        max_shard_size=SHARD,
        progress=False,
        **kwargs,
    )
    assert res.out_dir == tmp_path / "stream"
    _assert_same_folder_weights(a, res.out_dir)
    assert type(load_model(a, progress=False)) is type(load_model(res.out_dir, progress=False))
    files = sorted(os.listdir(res.out_dir))
    assert "model.safetensors.index.json" in files and len(res.plan.shards) > 1
    index = json.loads((res.out_dir / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {name for name, _ in res.plan.shards}
    if head_policy == "keep":
        for i, model in enumerate(f["models"]):
            heads = Checkpoint(res.out_dir / "heads" / f"{i}.safetensors")
            own = {n: t for n, t in _state(model).items() if H.is_head(n, arch)}
            assert set(heads.names()) == set(own)
            assert all(np.array_equal(heads.read(n), t.numpy()) for n, t in own.items())
    else:
        assert "heads" not in files
    assert _leftovers(tmp_path) == []


def test_streaming_fisher_equals_in_memory(folders, tmp_path):
    f = folders["bert"]
    kwargs = {"stats": f["fisher"], "heads": H.HEADS["bert"], "fisher_eps": 1e-6}
    mem = merge_models(f["models"], "fisher", progress=False, **kwargs)
    a = save_merged(mem, tmp_path / "mem", f["models"][0], progress=False)
    res = stream_merge(f["models"], tmp_path / "s", "fisher", progress=False, **kwargs)
    _assert_same_folder_weights(a, res.out_dir)


def test_streaming_regmean_layer_equals_the_formula(folders, tmp_path):
    """One q/k/v group (one shared Gram) against np.linalg.solve of the paper's formula."""
    f = folders["llama"]
    alpha = 0.9
    res = stream_merge(f["models"], tmp_path / "s", stats=f["stats"], alpha=alpha, progress=False)
    members = [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"]
    stats = [Statistics.load(p) for p in f["stats"]]
    assert len({s.group_of(m) for m in members for s in stats[:1]}) == 1  # shared input
    lhs, rhs = 0.0, 0.0
    for s, folder in zip(stats, f["models"], strict=True):
        g = s.gram(members[0]) / s.count(members[0])
        g = alpha * g + (1 - alpha) * np.diag(np.diag(g))
        w = np.concatenate(
            [Checkpoint(folder).read(f"{m}.weight").astype(np.float64) for m in members]
        )
        lhs, rhs = lhs + g, rhs + g @ w.T
    ref = np.linalg.solve(lhs, rhs).T
    got = np.concatenate(
        [Checkpoint(res.out_dir).read(f"{m}.weight").astype(np.float64) for m in members]
    )
    assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-6  # float32 output
    report = json.loads((res.out_dir / "lmdx_merge.json").read_text())["report"]
    assert report["streaming"] and report["layers"][members[1]]["shared_with"] == members[0]
    assert report["peak_rss_bytes"] > 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_streaming_output_dtype(folders, tmp_path, dtype):
    f = folders["bert"]
    kwargs = {"stats": f["stats"], "alpha": 0.9, "heads": H.HEADS["bert"]}
    mem = merge_models(f["models"], progress=False, **kwargs)
    a = save_merged(mem, tmp_path / "mem", f["models"][0], dtype=dtype, progress=False)
    res = stream_merge(f["models"], tmp_path / "s", dtype=dtype, progress=False, **kwargs)
    _assert_same_folder_weights(a, res.out_dir)
    ck = Checkpoint(res.out_dir)
    assert {ck.dtype(n) for n in ck.names() if ck.is_float(n)} == {dtype}
    assert json.loads((res.out_dir / "config.json").read_text())["dtype"] == dtype


def test_streaming_bfloat16_inputs(tmp_path):
    _, models, batches = H.cached_family("llama")
    paths, stats = [], []
    for i, (m, b) in enumerate(zip(models, batches, strict=True)):
        m16 = load_model_copy(m).to(torch.bfloat16)
        m16.save_pretrained(tmp_path / f"m{i}", max_shard_size=SHARD)
        paths.append(tmp_path / f"m{i}")
        stats.append(H.collect(m16, b).save(tmp_path / f"s{i}.safetensors"))
    kwargs = {"stats": stats, "alpha": 0.9, "heads": H.HEADS["llama"]}
    mem = merge_models(paths, progress=False, **kwargs)
    a = save_merged(mem, tmp_path / "mem", paths[0], progress=False)
    res = stream_merge(paths, tmp_path / "s", progress=False, **kwargs)
    _assert_same_folder_weights(a, res.out_dir)
    assert Checkpoint(res.out_dir).dtype("model.layers.0.mlp.up_proj.weight") == "bfloat16"


def test_generative_model_folders_merge_alike_in_memory_and_streaming(tmp_path):
    """A causal LM's folder holds generation_config.json: both front doors write the first
    model's (the in-memory merge once failed, writing it twice)."""
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=40, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32,
        pad_token_id=0, bos_token_id=1, eos_token_id=2,
    )  # fmt: skip
    torch.manual_seed(0)
    paths, stats = [], []
    for i in range(2):
        model = transformers.LlamaForCausalLM(cfg).eval()
        model.generation_config.max_new_tokens = 7 + i  # differs: whose file is copied
        model.save_pretrained(tmp_path / f"m{i}")
        assert (tmp_path / f"m{i}" / "generation_config.json").is_file()
        ids = torch.randint(3, 40, (8, 12))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        stats.append(collect_regmean_stats(model, [batch], progress=False))
        paths.append(tmp_path / f"m{i}")
    mem = merge_models(paths, stats=stats, progress=False)
    a = save_merged(mem, tmp_path / "mem", paths[0], progress=False)
    res = stream_merge(paths, tmp_path / "s", stats=stats, progress=False)
    _assert_same_folder_weights(a, res.out_dir)
    for out in (a, res.out_dir):
        written = json.loads((out / "generation_config.json").read_text())
        assert written == json.loads((paths[0] / "generation_config.json").read_text())


def load_model_copy(model):
    import copy

    return copy.deepcopy(model)


# --------------------------------------------------------------------------- plan / dry run


def test_dry_run_writes_nothing_and_plans_every_tensor(folders, tmp_path):
    f = folders["llama"]
    res = stream_merge(
        f["models"], tmp_path / "out", stats=f["stats"], max_shard_size=SHARD, dry_run=True
    )
    assert res.out_dir is None and not (tmp_path / "out").exists()
    plan = res.plan
    names = Checkpoint(f["models"][0]).names()
    assert sorted(o[1] for o in plan.outputs) == sorted(names)
    kinds = {s.kind for s in plan.steps}
    assert kinds == {"regmean", "average"}
    qkv = [s for s in plan.steps if "model.layers.0.self_attn.q_proj" in s.modules]
    assert len(qkv) == 1 and len(qkv[0].modules) == 3
    total = sum(Checkpoint(p).total_bytes() for p in f["models"])
    assert plan.input_bytes == total
    # Less than holding every model and every statistics file at once.
    stats_bytes = sum(os.path.getsize(p) for p in f["stats"])
    assert 0 < max(s.memory for s in plan.steps) < total + stats_bytes
    text = plan.describe()
    assert "regmean" in text and "GB peak estimated" in text and "shard(s)" in text


# --------------------------------------------------------------------------- bad input


def _copy_models(folders, arch, tmp_path):
    import shutil

    out = []
    for i, p in enumerate(folders[arch]["models"]):
        shutil.copytree(p, tmp_path / f"copy{i}")
        out.append(tmp_path / f"copy{i}")
    return out


def test_missing_shard_names_the_file(folders, tmp_path):
    models = _copy_models(folders, "bert", tmp_path)
    shard = sorted(models[1].glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(MergeError, match=rf"shard {shard.name} .* is missing"):
        stream_merge(models, tmp_path / "out", "average", progress=False)
    assert not (tmp_path / "out").exists()


def test_shard_of_another_checkpoint_names_file_and_tensor(folders, tmp_path):
    models = _copy_models(folders, "bert", tmp_path)
    shards = sorted(models[2].glob("model-*.safetensors"))
    shards[0].write_bytes(shards[1].read_bytes())  # right name, wrong content
    with pytest.raises(MergeError, match=rf"shard {shards[0].name} lacks tensor"):
        stream_merge(models, tmp_path / "out", "average", progress=False)


def _add_tensor(folder, name, value):
    """Rewrite a checkpoint folder's shards with one more tensor (in its last shard), as
    an older transformers that still saved it would have written the folder."""
    from safetensors.numpy import load_file, save_file

    shards = sorted(folder.glob("model-*.safetensors"))
    tensors = load_file(str(shards[-1]))
    tensors[name] = value
    save_file(tensors, str(shards[-1]), metadata={"format": "pt"})
    index = folder / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    data["weight_map"][name] = shards[-1].name
    index.write_text(json.dumps(data))


def test_integer_tensors_the_statistics_model_lacks_are_not_checked(folders, tmp_path):
    """A checkpoint holding a buffer its model no longer loads (BERT's position_ids, saved
    by older transformers) merges with statistics collected on the loaded model; the
    buffer is copied. A floating-point tensor the statistics lack is still refused."""
    f = folders["bert"]
    models = _copy_models(folders, "bert", tmp_path)
    name = "bert.embeddings.position_ids"
    for m in models:
        _add_tensor(m, name, np.arange(64, dtype=np.int64)[None, :])
    kwargs = {"stats": f["stats"], "alpha": 0.9, "heads": H.HEADS["bert"], "progress": False}
    res = stream_merge(models, tmp_path / "out", **kwargs)
    assert np.array_equal(Checkpoint(res.out_dir).read(name), np.arange(64)[None, :])
    plain = stream_merge(f["models"], tmp_path / "plain", **kwargs)
    _assert_same_folder_weights(plain.out_dir, res.out_dir)
    for m in models:
        _add_tensor(m, "bert.extra_scale", np.ones(3, dtype=np.float32))
    with pytest.raises(ModelMismatchError, match=r"'bert\.extra_scale' is in this model but not"):
        stream_merge(models, tmp_path / "out2", **kwargs)


def test_truncated_shard_names_the_file(folders, tmp_path):
    models = _copy_models(folders, "bert", tmp_path)
    shard = sorted(models[0].glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:-10])
    with pytest.raises(MergeError, match=rf"shard {shard}.*truncated"):
        stream_merge(models, tmp_path / "out", "average", progress=False)


def test_pickle_only_checkpoint_is_explained(tmp_path, folders):
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    (folder / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(MergeError, match="pickle checkpoint"):
        stream_merge([folder, folders["bert"]["models"][0]], tmp_path / "o", "average")


def test_different_architectures_are_refused(folders, tmp_path):
    with pytest.raises(MergeError, match=r"do not share one architecture|shape"):
        stream_merge(
            [folders["bert"]["models"][0], folders["llama"]["models"][0]],
            tmp_path / "o",
            "average",
            progress=False,
        )


def test_statistics_of_another_model_are_refused(folders, tmp_path):
    f = folders["bert"]
    stats = [f["stats"][1], f["stats"][0], f["stats"][2]]
    with pytest.raises(ModelMismatchError, match=r"different values .*Collect statistics"):
        stream_merge(f["models"], tmp_path / "o", stats=stats, progress=False)
    assert not (tmp_path / "o").exists()


def test_existing_output_is_refused(folders, tmp_path):
    (tmp_path / "o").mkdir()
    with pytest.raises(MergeError, match="already exists"):
        stream_merge(folders["bert"]["models"], tmp_path / "o", "average", progress=False)


# --------------------------------------------------------------------------- resilience


def test_interrupt_leaves_nothing(folders, tmp_path, monkeypatch):
    import lmdx.merge.builtin.regmean_solve as merge

    calls = {"n": 0}
    real = merge.regmean_merge_layer

    def interrupted(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 4:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(merge, "regmean_merge_layer", interrupted)
    f = folders["bert"]
    with pytest.raises(KeyboardInterrupt):
        stream_merge(f["models"], tmp_path / "o", stats=f["stats"], progress=False)
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(merge, "regmean_merge_layer", real)
    stream_merge(f["models"], tmp_path / "o", stats=f["stats"], progress=False)  # re-run works
    assert os.listdir(tmp_path) == ["o"]


def test_disk_full_is_reported_before_any_work(folders, tmp_path, monkeypatch):
    import shutil

    import lmdx.files.atomic as stream

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(stream.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    f = folders["bert"]
    with pytest.raises(DiskFullError, match=r"needs .* GB but .* free; nothing was written"):
        stream_merge(f["models"], tmp_path / "o", "average", progress=False)
    assert os.listdir(tmp_path) == []


def test_disk_full_while_writing(tmp_path, monkeypatch):
    import errno

    def full(fd, data, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(lmdx_io.os, "pwrite", full)
    spec = lmdx_io.TensorSpec("a", np.float32, (3,))
    with pytest.raises(DiskFullError, match=r"disk full while writing .*x.safetensors"):
        lmdx_io.write_safetensors(
            tmp_path / "x.safetensors", [spec], lambda n: np.zeros(3, np.float32)
        )
    assert os.listdir(tmp_path) == []


def test_killed_merge_leaves_no_output_and_the_next_run_cleans_up(folders, tmp_path):
    """A merge killed with SIGKILL mid-way: no output; its temporary folder is removed
    by the next run, which succeeds."""
    f = folders["bert"]
    script = textwrap.dedent(
        f"""
        import time, lmdx.merge.builtin.regmean_solve as m, lmdx.merge as s
        def slow(*a, **k):
            time.sleep(60)
        m.regmean_merge_layer = slow
        s.stream_merge({[str(p) for p in f["models"]]!r}, {str(tmp_path / "o")!r},
                       stats={[str(p) for p in f["stats"]]!r}, progress=False)
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        deadline = time.time() + 60
        while time.time() < deadline and not _leftovers(tmp_path) and proc.poll() is None:
            time.sleep(0.05)
        time.sleep(0.3)
        assert proc.poll() is None, "the merge process is still running"
        assert _leftovers(tmp_path), "the merge started writing"
    finally:
        proc.kill()
        proc.wait()
    assert not (tmp_path / "o").exists()
    stale = _leftovers(tmp_path)
    assert len(stale) == 1 and ".lmdx-" in stale[0]
    stream_merge(f["models"], tmp_path / "o", stats=f["stats"], progress=False)
    assert os.listdir(tmp_path) == ["o"]


def test_temporaries_of_live_processes_are_kept(tmp_path):
    live = tmp_path / f".out.lmdx-{lmdx_atomic._HOST}-{os.getpid()}-abc.tmp"
    dead = tmp_path / f".out.lmdx-{lmdx_atomic._HOST}-999999999-abc.tmp"
    other_host = tmp_path / ".out.lmdx-00000000-999999999-abc.tmp"
    for p in (live, dead, other_host):
        p.mkdir()
    assert remove_stale_temporaries(tmp_path / "out") == [dead]
    assert live.exists() and other_host.exists() and not dead.exists()


# --------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("arch", ["bert", "gpt2", "llama"])
def test_disk_backed_statistics_equal_in_memory(arch, tmp_path):
    _, models, batches = H.cached_family(arch)
    ref = H.collect(models[0], batches[0])
    one = H.collect(models[0], batches[0], out=tmp_path / "one.safetensors", max_memory=3000)
    sharded = H.collect(
        models[0], batches[0], out=tmp_path / "dir", max_memory=5000, max_shard_size=4000
    )
    assert one.extra["passes"] > 3 and sharded.extra["passes"] > 2
    assert len(list((tmp_path / "dir").glob("stats-*.safetensors"))) > 1
    for got in (one, sharded, Statistics.load(tmp_path / "dir")):
        assert got.modules == ref.modules
        assert {g: v["count"] for g, v in got.groups.items()} == {
            g: v["count"] for g, v in ref.groups.items()
        }
        for m in ref.modules:
            assert np.array_equal(got.gram(m), ref.gram(m)), m
            assert np.array_equal(got.sum(m), ref.sum(m)), m
    # and the Grams are the module inputs' (independent float64 reference)
    grams = H.reference_grams(models[0], batches[0], include_padding=False)
    for m, ref_m in grams.items():
        assert one.count(m) == ref_m["count"]
        assert H.rel_err(one.gram(m), ref_m["gram"]) < 1e-6


def test_passes_stop_the_forward_early(tmp_path):
    """With P passes the last module is reached once per batch, not P times."""
    _, models, batches = H.cached_family("bert")
    model = models[0]
    calls = {"n": 0}

    def count(module, args, output):  # after the module ran
        calls["n"] += 1

    handle = model.classifier.register_forward_hook(count)
    try:
        stats = H.collect(model, batches[0], out=tmp_path / "s.safetensors", max_memory=3000)
    finally:
        handle.remove()
    assert stats.extra["passes"] > 3
    # the probe calls it once, then once per batch in the pass holding it
    assert calls["n"] == 1 + len(batches[0])


def test_many_passes_need_a_reiterable_dataset(tmp_path):
    _, models, batches = H.cached_family("bert")
    with pytest.raises(ValueError, match="one-shot iterator; pass a list"):
        H.collect(models[0], iter(batches[0]), out=tmp_path / "s.safetensors", max_memory=3000)
    assert os.listdir(tmp_path) == []


def test_max_memory_needs_out():
    _, models, batches = H.cached_family("bert")
    with pytest.raises(ValueError, match="need out="):
        H.collect(models[0], batches[0], max_memory="1GB")


def test_interrupted_collection_leaves_nothing(tmp_path):
    _, models, batches = H.cached_family("bert")

    def interrupt_on_third(batches):
        for i, b in enumerate(batches):
            if i == 2:
                raise KeyboardInterrupt
            yield b

    for out in (tmp_path / "s.safetensors", tmp_path / "dir"):
        with pytest.raises(KeyboardInterrupt):
            collect_regmean_stats(
                models[0],
                interrupt_on_third(batches[0]),
                out=out,
                max_shard_size=4000 if out.suffix == "" else None,
                progress=False,
            )
        assert os.listdir(tmp_path) == []


def test_sharded_statistics_folder_errors_name_the_shard(tmp_path):
    _, models, batches = H.cached_family("bert")
    H.collect(models[0], batches[0]).save(tmp_path / "a", max_shard_size=4000)
    H.collect(models[1], batches[1]).save(tmp_path / "b", max_shard_size=4000)
    shards = sorted((tmp_path / "a").glob("stats-*.safetensors"))
    # a shard of another collection under the right name
    other = sorted((tmp_path / "b").glob("stats-*.safetensors"))[0]
    saved = shards[0].read_bytes()
    shards[0].write_bytes(other.read_bytes())
    with pytest.raises(StatisticsFileError, match=rf"{shards[0].name}: belongs to another"):
        Statistics.load(tmp_path / "a")
    shards[0].write_bytes(saved)
    Statistics.load(tmp_path / "a")
    shards[1].unlink()
    with pytest.raises(StatisticsFileError, match=rf"shard .*{shards[1].name} is missing"):
        Statistics.load(tmp_path / "a")
    (tmp_path / "a" / "lmdx_stats.index.json").unlink()
    with pytest.raises(StatisticsFileError, match=r"no lmdx_stats\.index\.json"):
        Statistics.load(tmp_path / "a")


def test_sharded_statistics_merge_like_single_files(folders, tmp_path):
    f = folders["llama"]
    dirs = []
    for i, p in enumerate(f["stats"]):
        dirs.append(Statistics.load(p).save(tmp_path / f"s{i}", max_shard_size=5000))
    a = stream_merge(f["models"], tmp_path / "a", stats=f["stats"], progress=False)
    b = stream_merge(f["models"], tmp_path / "b", stats=dirs, progress=False)
    _assert_same_folder_weights(a.out_dir, b.out_dir)
    records = [json.loads((r.out_dir / "lmdx_merge.json").read_text())["inputs"] for r in (a, b)]
    hashes = [[v["stats_sha256"] for v in inputs.values()] for inputs in records]
    assert hashes[0] == hashes[1] and len(set(hashes[0])) == len(f["stats"])  # the same content
