"""Statistics collected in parts over disjoint modules and joined (lmdx.stats.join).

The parts of one collection (``include`` / ``exclude`` patterns) must hold, joined, the
very numbers a single collection holds (bit for bit: the same activations summed in the
same order), a merge from the joined parts must equal the merge from the single file bit
for bit, and parts that do not belong together must be refused with a message naming
them.
"""

from __future__ import annotations

import hf_models as H
import pytest
from lmdx import MergeError, ModelMismatchError, StatisticsFileError
from lmdx.files import Checkpoint
from lmdx.merge import stream_merge
from lmdx.stats import Statistics
from lmdx.stats.join import join_statistics

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MLP = ["*mlp*"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    root = tmp_path_factory.mktemp("join")
    _, models, batches = H.cached_family("llama")
    out = {"models": [], "whole": [], "parts": []}
    for i, (m, b) in enumerate(zip(models, batches, strict=True)):
        m.save_pretrained(root / f"m{i}")
        out["models"].append(root / f"m{i}")
        out["whole"].append(H.collect(m, b).save(root / f"s{i}.safetensors"))
        out["parts"].append(
            [
                H.collect(m, b, include=MLP).save(root / f"s{i}-mlp.safetensors"),
                H.collect(m, b, exclude=MLP).save(root / f"s{i}-rest.safetensors"),
            ]
        )
    out["root"] = root
    return out


def test_joined_parts_hold_the_single_collection(llama, tmp_path):
    for whole_path, part_paths in zip(llama["whole"], llama["parts"], strict=True):
        whole = Statistics.load(whole_path)
        parts = [Statistics.load(p) for p in part_paths]
        assert all(p.modules for p in parts)  # both parts hold something
        joined = join_statistics(parts)
        assert joined.modules.keys() == whole.modules.keys()
        assert joined.groups.keys() == whole.groups.keys()
        for m in whole.modules:
            assert joined.count(m) == whole.count(m)
            assert joined.gram(m).tobytes() == whole.gram(m).tobytes()
            assert joined.sum(m).tobytes() == whole.sum(m).tobytes()
        assert joined.accumulation == whole.accumulation is not None
        assert joined.extra["joined_from"] == [str(p) for p in part_paths]
        saved = Statistics.load(joined.save(tmp_path / "joined.safetensors"))
        for spec in whole.specs():
            assert saved.packed(spec.name).tobytes() == whole.packed(spec.name).tobytes()


def test_merge_from_joined_parts_equals_the_merge_from_one_file(llama, tmp_path):
    kw = {"alpha": 0.9, "progress": False}
    stream_merge(llama["models"], tmp_path / "one", stats=llama["whole"], **kw)
    joined = [join_statistics(Statistics.load(p) for p in parts) for parts in llama["parts"]]
    stream_merge(llama["models"], tmp_path / "parts", stats=joined, **kw)
    a, b = Checkpoint(tmp_path / "one"), Checkpoint(tmp_path / "parts")
    assert a.names() == b.names()
    for n in a.names():
        assert a.read(n).tobytes() == b.read(n).tobytes(), n


def test_parts_that_do_not_belong_together_are_refused(llama):
    mlp0, rest0 = (Statistics.load(p) for p in llama["parts"][0])
    rest1 = Statistics.load(llama["parts"][1][1])
    whole0 = Statistics.load(llama["whole"][0])
    with pytest.raises(StatisticsFileError, match="no statistics to join"):
        join_statistics([])
    with pytest.raises(ModelMismatchError, match="cannot join statistics of different models"):
        join_statistics([mlp0, rest1])
    with pytest.raises(StatisticsFileError, match=r"module '.*mlp.*' is in .*s0-mlp.*and in"):
        join_statistics([mlp0, whole0])
    other = Statistics.load(llama["parts"][0][1])
    other.data = "other texts"
    with pytest.raises(StatisticsFileError, match="their data differs"):
        join_statistics([mlp0, other])
    fisher = Statistics(kind="fisher", model=mlp0.model, parameters={}, count=1.0)
    with pytest.raises(StatisticsFileError, match="only RegMean Grams join"):
        join_statistics([fisher, rest0])


def test_statistics_know_the_files_they_are_read_from(llama, tmp_path):
    """``Statistics.files``: a loaded file or folder itself; joined parts read from files
    their files (a join of a join: every part's); None where any part is in memory; a
    joined one saved and loaded: the file it was loaded from."""
    mlp_path, rest_path = (str(p) for p in llama["parts"][0])
    mlp, rest = Statistics.load(mlp_path), Statistics.load(rest_path)
    assert mlp.files == (mlp_path,) and rest.files == (rest_path,)
    joined = join_statistics([mlp, rest])
    assert joined.files == (mlp_path, rest_path)
    assert join_statistics([join_statistics([mlp]), rest]).files == (mlp_path, rest_path)
    _, models, batches = H.cached_family("llama")
    in_memory = H.collect(models[0], batches[0], include=MLP)
    assert in_memory.files is None and join_statistics([in_memory, rest]).files is None
    saved = Statistics.load(joined.save(tmp_path / "joined.safetensors"))
    assert saved.files == (str(tmp_path / "joined.safetensors"),)
    assert saved.extra["joined_from"] == [mlp_path, rest_path]
    folder = Statistics.load(joined.save(tmp_path / "joined", max_shard_size="1KB"))
    assert folder.files == (str(tmp_path / "joined"),)
    # Ray workers open the statistics again from their files: a part in memory is refused
    stats = [
        join_statistics([H.collect(m, b, include=MLP), Statistics.load(parts[1])])
        for m, b, parts in zip(models, batches, llama["parts"], strict=True)
    ]
    with pytest.raises(MergeError, match=r"^ray_workers: the statistics must be files or fold"):
        stream_merge(llama["models"], tmp_path / "ray", stats=stats, ray_workers=2, progress=False)
    assert not (tmp_path / "ray").exists()


def _same_tensors(a_path, b_path):
    a, b = Checkpoint(a_path), Checkpoint(b_path)
    assert a.names() == b.names()
    for n in a.names():
        assert a.read(n).tobytes() == b.read(n).tobytes(), n


def test_a_config_lists_a_models_parts_and_lmdx_merge_joins_them(llama, tmp_path):
    """``models[i].stats`` may list the parts (relative to the config): ``lmdx merge`` gives
    the merge of the single files, and lmdx_merge.json names the parts."""
    import json

    import yaml
    from lmdx.cli import main

    kw = {"alpha": 0.9, "progress": False}
    stream_merge(llama["models"], tmp_path / "one", stats=llama["whole"], **kw)
    models = [
        {"path": str(m), "stats": [str(p.relative_to(llama["root"])) for p in parts]}
        for m, parts in zip(llama["models"], llama["parts"], strict=True)
    ]
    config = llama["root"] / "parts.yaml"
    config.write_text(yaml.safe_dump({"method": "regmean", "alpha": 0.9, "models": models}))
    assert main(["merge", str(config), "--out", str(tmp_path / "cli"), "--no-progress"]) == 0
    _same_tensors(tmp_path / "one", tmp_path / "cli")
    record = json.loads((tmp_path / "cli" / "lmdx_merge.json").read_text())
    recorded = [entry["stats"] for entry in record["inputs"].values()]
    assert recorded == [[str(p) for p in parts] for parts in llama["parts"]]


def test_a_config_part_that_does_not_exist_is_named(llama, tmp_path):
    import yaml
    from lmdx.cli import main

    models = [{"path": str(m), "stats": [str(parts[0]), "nowhere.safetensors"]}
              for m, parts in zip(llama["models"], llama["parts"], strict=True)]  # fmt: skip
    config = tmp_path / "parts.yaml"
    config.write_text(yaml.safe_dump({"method": "regmean", "models": models}))
    assert main(["merge", str(config), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    assert not (tmp_path / "out").exists()


RAY_SCRIPT = """
import sys
from lmdx.files import Checkpoint
from lmdx.merge import stream_merge
models, parts, out = sys.argv[1:4], sys.argv[4:10], sys.argv[10]
stats = [parts[0:2], parts[2:4], parts[4:6]]
kw = dict(alpha=0.9, progress=False)
remote = stream_merge(models, out + "/ray", stats=stats, ray_workers=2, **kw)
local = stream_merge(models, out + "/local", stats=stats, **kw)
a, b = Checkpoint(out + "/ray"), Checkpoint(out + "/local")
same = a.names() == b.names() and all(a.read(n).tobytes() == b.read(n).tobytes() for n in a.names())
print("RESULT", remote.report["ray_workers"], same)
"""


@pytest.mark.slow  # Ray starts
def test_ray_workers_join_the_parts_themselves(llama, tmp_path):
    """On Ray each worker opens and joins a model's parts from their paths: the merge is
    the local one, bit for bit."""
    import os
    import subprocess
    import sys

    pytest.importorskip("ray")
    parts = [str(p) for ps in llama["parts"] for p in ps]
    env = {**os.environ, "LMDX_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", RAY_SCRIPT, *map(str, llama["models"]), *parts, str(tmp_path)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")] == ["RESULT 2 True"], (
        out.stdout[-2000:]
    )
