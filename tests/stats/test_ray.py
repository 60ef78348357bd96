"""``lmdx.collect_regmean_stats_ray`` and ``lmdx stats --ray`` on a local two-CPU Ray.

One tiny BERT classifier (built from a config, saved with ``save_pretrained``) and 40 texts
in 5 batches of 8, split by Ray into shards of 3 and 2 batches. References are computed
here: the single-process ``collect_regmean_stats`` on the same batches (what the Ray run
must reproduce to 1e-12), and for one module the float64 Gram of its inputs captured by
this module's own forward hook. Worker failures are provoked with model factories that
kill their own process (``os._exit``) or raise. Nothing is downloaded.
"""

from __future__ import annotations

import itertools
import re
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lmdx import RayClusterError
from lmdx.cli import main
from lmdx.data.batches import text_batches
from lmdx.files.hf import load_model
from lmdx.stats import Statistics
from lmdx.stats.collect import collect_regmean_stats
from lmdx.stats.ray import collect_regmean_stats_ray, shard_bounds
from safetensors.numpy import load_file
from tiny_bert import WORDS, build_tiny_bert
from transformers import AutoTokenizer, BertForSequenceClassification

pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]  # Ray starts

MODULE = "bert.encoder.layer.1.intermediate.dense"
N_TEXTS, BATCH = 40, 8  # 5 batches: shards of 3 and 2


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def local_ray() -> Any:
    """A local Ray with two CPUs, shared by the tests (the function reuses it)."""
    ray = pytest.importorskip("ray")
    ray.init(num_cpus=2, include_dashboard=False)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``model/`` (a saved tiny BERT classifier with its tokenizer) and ``texts.txt``."""
    root = tmp_path_factory.mktemp("ray")
    tiny = build_tiny_bert(root / "tokenizer-source")
    torch.manual_seed(1)
    model = BertForSequenceClassification.from_pretrained(str(tiny), num_labels=2)
    model.save_pretrained(root / "model")
    AutoTokenizer.from_pretrained(str(tiny)).save_pretrained(root / "model")
    rng = np.random.default_rng(5)
    texts = [" ".join(rng.choice(WORDS, size=rng.integers(2, 14))) for _ in range(N_TEXTS)]
    (root / "texts.txt").write_text("\n".join(texts) + "\n")
    return root


@pytest.fixture(scope="module")
def batches(workspace: Path) -> list[dict[str, Any]]:
    texts = (workspace / "texts.txt").read_text().splitlines()
    tokenizer = AutoTokenizer.from_pretrained(str(workspace / "model"))
    return text_batches(texts, tokenizer, batch_size=BATCH)


@pytest.fixture(scope="module")
def single(workspace: Path, batches: list[dict[str, Any]]) -> Statistics:
    """The single-process statistics of the same batches (one lmdx and torch thread)."""
    model = load_model(workspace / "model", progress=False)
    return collect_regmean_stats(
        model, batches, progress=False, n_threads=1, description="40 texts"
    )


# --------------------------------------------------------------------------- helpers


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _assert_same_statistics(got: Statistics, ref: Statistics) -> None:
    """Same metadata (but extra.ray), counts equal, Grams and sums ≤ 1e-12 relative."""
    assert got.kind == ref.kind == "regmean-gram"
    assert got.model == ref.model
    assert got.padding == ref.padding and got.data == ref.data
    assert got.modules == ref.modules
    assert list(got.groups) == list(ref.groups)
    assert got.metadata()["groups"] == ref.metadata()["groups"]  # dims and counts
    assert {k: v for k, v in got.extra.items() if k != "ray"} == ref.extra
    for module in ref.modules:
        assert got.count(module) == ref.count(module), module
        assert _rel(got.gram(module), ref.gram(module)) <= 1e-12, module
        assert _rel(got.sum(module), ref.sum(module)) <= 1e-12, module


def _hooked_gram(model: Any, batches: list[dict[str, Any]], module: str) -> np.ndarray:
    """Σ x xᵀ in float64 over the real-token rows of ``module``'s input."""
    grams: list[np.ndarray] = []
    mask: list[Any] = []

    def hook(_m: Any, args: tuple[Any, ...]) -> None:
        x = args[0].detach().double()[mask[0].bool()].numpy()
        grams.append(x.T @ x)

    handle = model.get_submodule(module).register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            for b in batches:
                mask[:] = [b["attention_mask"]]
                model(input_ids=b["input_ids"], attention_mask=b["attention_mask"])
    finally:
        handle.remove()
    return np.sum(grams, axis=0)


# --------------------------------------------------------------------------- no Ray needed


def test_shard_bounds_are_contiguous_and_balanced() -> None:
    assert shard_bounds(5, 2) == [(0, 3), (3, 5)]
    assert shard_bounds(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    for n in range(1, 12):
        for k in range(1, n + 1):
            b = shard_bounds(n, k)
            assert b[0][0] == 0 and b[-1][1] == n
            assert all(x[1] == y[0] for x, y in itertools.pairwise(b))
            sizes = [stop - start for start, stop in b]
            assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1
    with pytest.raises(ValueError, match="k <= n"):
        shard_bounds(2, 3)


def test_bad_arguments_are_refused_before_ray_starts(workspace: Path, batches: list) -> None:
    pytest.importorskip("ray")
    path = workspace / "model"
    with pytest.raises(ValueError, match="num_workers"):
        collect_regmean_stats_ray(path, batches, num_workers=0)
    with pytest.raises(ValueError, match="threads_per_worker"):
        collect_regmean_stats_ray(path, batches, threads_per_worker=0)
    with pytest.raises(TypeError, match="threads_per_worker"):
        collect_regmean_stats_ray(path, batches, n_threads=2)
    with pytest.raises(TypeError, match=r"out= is not passed on.*\.save\(\)"):
        collect_regmean_stats_ray(path, batches, out=workspace / "x.safetensors")
    with pytest.raises(TypeError, match="unknown argument"):
        collect_regmean_stats_ray(path, batches, include_paddings=True)
    with pytest.raises(ValueError, match="empty"):
        collect_regmean_stats_ray(path, [])
    with pytest.raises(TypeError, match="zero-argument callable"):
        collect_regmean_stats_ray(load_model(path, progress=False), batches)
    with pytest.raises(ValueError, match=r"no config\.json"):
        collect_regmean_stats_ray(workspace, batches)


def test_missing_ray_says_how_to_install(
    monkeypatch: pytest.MonkeyPatch, workspace: Path, batches: list, capsys: Any
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(ImportError, match=r"pip install 'ray>=2\.9'"):
        collect_regmean_stats_ray(workspace / "model", batches)
    out = workspace / "no-ray.safetensors"
    argv = ["stats", str(workspace / "model"), str(workspace / "texts.txt")]
    assert main([*argv, "--out", str(out), "--ray", "--no-progress"]) == 2
    assert "pip install 'ray>=2.9'" in capsys.readouterr().err
    assert not out.exists()


def test_importing_lmdx_does_not_import_ray() -> None:
    code = (
        "import sys, lmdx; print('ray' in sys.modules, hasattr(lmdx, 'collect_regmean_stats_ray'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]


def test_cli_ray_options_are_checked(workspace: Path, capsys: Any) -> None:
    argv = ["stats", str(workspace / "model"), str(workspace / "texts.txt"), "--no-progress"]
    out = str(workspace / "refused.safetensors")
    cases = [
        (["--kind", "fisher", "--ray"], "--ray: only for --kind regmean"),
        (["--workers", "2"], "--workers: only with --ray"),
        (["--ray", "--threads", "2"], "--threads-per-worker"),
        (["--ray", "--workers", "0"], "--workers: must be >= 1"),
    ]
    for extra, message in cases:
        assert main([*argv, "--out", out, *extra]) == 2, extra
        assert message in capsys.readouterr().err, extra
    assert not Path(out).exists()


# --------------------------------------------------------------------------- on Ray


def test_two_workers_equal_one_process(
    local_ray: Any, workspace: Path, batches: list, single: Statistics
) -> None:
    got = collect_regmean_stats_ray(
        workspace / "model", batches, num_workers=2, progress=False, description="40 texts"
    )
    assert local_ray.is_initialized()  # a Ray started by the caller is left running
    _assert_same_statistics(got, single)
    assert got.extra["ray"] == {
        "workers": 2,
        "threads_per_worker": 1,
        "shards": [[0, 3], [3, 5]],
        "batches": 5,
    }
    assert got.extra["batches"] == 5
    # and against this module's own float64 Gram (lmdx multiplies in fp32: 1e-6)
    model = load_model(workspace / "model", progress=False).eval()
    ref = _hooked_gram(model, batches, MODULE)
    assert _rel(got.gram(MODULE), ref) < 1e-6
    assert got.count(MODULE) == sum(int(b["attention_mask"].sum()) for b in batches)


def test_accumulation_and_its_deprecated_spelling_reach_the_workers(
    local_ray: Any, workspace: Path, batches: list
) -> None:
    """``accumulation`` is passed on to every worker; ``precision=`` (deprecated) is warned
    about once, on the driver, and read as ``accumulation``."""
    model = load_model(workspace / "model", progress=False).eval()
    ref = _hooked_gram(model, batches, MODULE)
    got = collect_regmean_stats_ray(
        workspace / "model", batches, num_workers=2, progress=False, accumulation="float64"
    )
    assert got.accumulation == "float64"
    assert _rel(got.gram(MODULE), ref) < 1e-12  # float64 products: exact to rounding
    with pytest.warns(DeprecationWarning, match="collect_regmean_stats_ray: precision="):
        old = collect_regmean_stats_ray(
            workspace / "model", batches, num_workers=2, progress=False, precision="float64"
        )
    assert old.accumulation == "float64" and "precision" not in old.extra
    assert np.array_equal(old.gram(MODULE), got.gram(MODULE))


def test_worker_killed_once_is_restarted(
    local_ray: Any, workspace: Path, tmp_path: Path, batches: list, single: Statistics
) -> None:
    flag, path = str(tmp_path / "crashed"), str(workspace / "model")

    def factory() -> Any:
        import os

        from transformers import BertForSequenceClassification

        try:  # the first call anywhere creates the flag and kills its own process
            fd = os.open(flag, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return BertForSequenceClassification.from_pretrained(path)
        os.close(fd)
        os._exit(1)

    got = collect_regmean_stats_ray(
        factory, batches, num_workers=2, progress=False, description="40 texts"
    )
    assert Path(flag).exists()  # a worker did die
    _assert_same_statistics(got, single)


@pytest.mark.parametrize("failure", ["raises", "always dies"])
def test_failing_worker_names_its_shard(local_ray: Any, batches: list, failure: str) -> None:
    def factory() -> Any:
        if failure == "raises":
            raise OSError("no weights here")
        import os

        os._exit(3)

    error, expected = {  # the worker's own error; a worker lost twice is the cluster's
        "raises": (RuntimeError, "loading the model failed: OSError: no weights here"),
        "always dies": (RayClusterError, "worker process or node was lost on the retry too"),
    }[failure]
    with pytest.raises(error) as info:
        collect_regmean_stats_ray(factory, batches, num_workers=2, progress=False)
    message = str(info.value)
    assert expected in message
    assert "shard 1 of 2 (batches 0..2 of 5)" in message or (
        "shard 2 of 2 (batches 3..4 of 5)" in message
    )
    assert local_ray.is_initialized()  # the caller's Ray survives a failed collection


def test_error_raised_in_collection_names_its_shard(
    local_ray: Any, workspace: Path, batches: list
) -> None:
    with pytest.raises(
        RuntimeError, match=r"shard 1 of 1 \(batches 0\.\.4 of 5\).*ValueError: .*no nn\.Linear"
    ):
        collect_regmean_stats_ray(
            workspace / "model", batches, num_workers=1, progress=False, include=["no.such"]
        )


def test_cli_ray_file_equals_plain_file(local_ray: Any, workspace: Path) -> None:
    argv = ["stats", str(workspace / "model"), str(workspace / "texts.txt"), "--batch-size", "8"]
    plain, on_ray = workspace / "plain.safetensors", workspace / "ray.safetensors"
    assert main([*argv, "--out", str(plain), "--threads", "1", "--no-progress"]) == 0
    assert main([*argv, "--out", str(on_ray), "--ray", "--workers", "2", "--no-progress"]) == 0
    a, b = Statistics.load(on_ray), Statistics.load(plain)
    meta_a, meta_b = a.metadata(), b.metadata()
    assert meta_a["extra"].pop("ray")["shards"] == [[0, 3], [3, 5]]
    assert meta_a == meta_b
    ta, tb = load_file(on_ray), load_file(plain)
    assert sorted(ta) == sorted(tb)
    for name in tb:
        assert ta[name].dtype == tb[name].dtype == np.float64
        assert _rel(ta[name], tb[name]) <= 1e-12, name


def test_cli_failure_on_a_worker_writes_nothing(
    local_ray: Any, workspace: Path, tmp_path: Path, capsys: Any
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in (workspace / "model").iterdir():
        data = f.read_bytes()
        (broken / f.name).write_bytes(data[:100] if f.suffix == ".safetensors" else data)
    out = tmp_path / "stats.safetensors"
    argv = ["stats", str(broken), str(workspace / "texts.txt"), "--out", str(out)]
    assert main([*argv, "--ray", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "shard" in err and "loading the model failed" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["broken"]


def test_starts_and_stops_its_own_ray(workspace: Path) -> None:
    """Without a running Ray the call starts a local one and shuts it down afterwards.

    Run in a fresh interpreter: this module's own Ray is running in this one.
    """
    script = textwrap.dedent(
        """
        import sys
        import ray
        from transformers import AutoTokenizer
        from lmdx import collect_regmean_stats_ray
        from lmdx.data.batches import text_batches

        model, data = sys.argv[1:]
        texts = open(data).read().splitlines()[:16]
        batches = text_batches(texts, AutoTokenizer.from_pretrained(model), batch_size=8)
        stats = collect_regmean_stats_ray(model, batches, num_workers=1, progress=False)
        print("RESULT", ray.is_initialized(), stats.extra["ray"]["workers"], stats.count(
            "classifier"))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script, str(workspace / "model"), str(workspace / "texts.txt")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
    assert result == ["RESULT False 1 16.0"]


# --------------------------------------------------------------------------- merging on Ray


def test_streaming_merge_with_ray_workers_is_bit_identical(local_ray: Any, tmp_path: Path) -> None:
    """RegMean groups solved on 2 Ray actors give the very tensors of the local merge
    (GPT-2: Conv1D layout, tied lm_head; bf16 output; several output shards)."""
    import hf_models as H
    from lmdx.files import Checkpoint
    from lmdx.merge import stream_merge

    _, models, data = H.cached_family("gpt2")
    paths, stats = [], []
    for i, (m, b) in enumerate(zip(models, data, strict=True)):
        m.save_pretrained(tmp_path / f"m{i}", max_shard_size=6000)
        paths.append(tmp_path / f"m{i}")
        stats.append(H.collect(m, b).save(tmp_path / f"s{i}", max_shard_size=5000))
    kwargs = {"stats": stats, "alpha": 0.9, "heads": H.HEADS["gpt2"], "dtype": "bfloat16"}
    local = stream_merge(paths, tmp_path / "local", progress=False, **kwargs)
    remote = stream_merge(paths, tmp_path / "ray", progress=False, ray_workers=2, **kwargs)
    assert remote.report["ray_workers"] == 2 and local_ray.is_initialized()
    assert remote.report["layers"] == local.report["layers"]
    # what each task pays: the workers keep the Grams they read, the driver reads its own
    for task, t in local.report["cost"]["tasks"].items():
        assert remote.report["cost"]["tasks"][task]["mean"] == pytest.approx(t["mean"], rel=1e-9)
    a, b = Checkpoint(local.out_dir), Checkpoint(remote.out_dir)
    assert a.names() == b.names()
    for name in a.names():
        x, y = a.read(name), b.read(name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name


def test_merge_cli_ray_workers_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text("method: average\nmodels: [a, b]\n")
    out = str(tmp_path / "o")
    assert main(["merge", str(cfg), "--out", out, "--in-memory", "--ray-workers", "2"]) == 2
    assert "--ray-workers: only for the streaming merge" in capsys.readouterr().err


class _Cluster:
    """What :func:`lmdx._ray.wait_ready` asks Ray: the task ends after ``calls`` waits
    of 10 ms; one live node with 1 CPU and ``memory`` bytes of Ray's memory resource, one
    dead node with more of both."""

    def __init__(self, memory: float, calls: int = 10**9) -> None:
        self.memory, self.calls = memory, calls

    def wait(self, refs: list[Any], num_returns: int, timeout: float) -> tuple[list, list]:
        time.sleep(min(timeout, 0.01))
        self.calls -= 1
        return (refs, []) if self.calls <= 0 else ([], refs)

    def nodes(self) -> list[dict[str, Any]]:
        return [
            {"Alive": True, "Resources": {"CPU": 1.0, "memory": self.memory}},
            {"Alive": False, "Resources": {"CPU": 8.0, "memory": 100 * self.memory}},
        ]


@pytest.mark.parametrize(
    ("memory", "cpus", "asked", "want"),
    [
        (3e9, 1, 4e9, "1 CPU(s) and 4.00 GB of memory"),
        (3e9, 1, 5e7, None),
        (0.0, 2, 0.0, "2 CPU(s)"),
        (0.0, 1, 0.0, None),
    ],
)
def test_waiting_ends_when_no_live_node_can_take_the_task(
    monkeypatch: pytest.MonkeyPatch, memory: float, cpus: int, asked: float, want: str | None
) -> None:
    """A task that asks for more memory (or CPUs) than any live node has is lost (the dead
    node had both): one line after LMDX_RAY_WAIT. One that a live node can take is waited
    for past LMDX_RAY_WAIT, until it ends."""
    from lmdx._ray import wait_ready

    monkeypatch.setenv("LMDX_RAY_WAIT", "0.2")
    cluster = _Cluster(memory, calls=10**9 if want else 40)
    if want is None:
        assert wait_ready(cluster, ["ref"], cpus, lambda: "group 7", asked) == ["ref"]
        return
    lost = f"group 7: lost; no node of the Ray cluster has had {want} to run it for 0.2 s"
    with pytest.raises(RayClusterError, match=re.escape(lost)):
        wait_ready(cluster, ["ref"], cpus, lambda: "group 7", asked)


HELD_SCRIPT = """
import os, signal, sys, threading, time
# Ctrl-C handled as in a terminal (a shell's background job inherits SIGINT ignored)
signal.signal(signal.SIGINT, signal.default_int_handler)
import ray
from lmdx._ray import start_ray

real, install = ray.init, signal.signal
sigterm = signal.getsignal(signal.SIGTERM)
starting, sent, returned = threading.Event(), threading.Event(), []

def init(*args, **kwargs):
    # the signal comes while ray.init runs, which also sets its own SIGTERM handler
    starting.set()
    sent.wait(60)
    signal.signal(signal.SIGTERM, lambda *a: sys.exit(15))
    out = real(*args, **kwargs)
    returned.append(True)
    return out

def children_blocking_sigterm():
    bit, mine, found = 1 << (signal.SIGTERM - 1), str(os.getpid()), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = dict(ln.split(":", 1) for ln in open(f"/proc/{pid}/status") if ":" in ln)
        except OSError:
            continue
        if status["PPid"].strip() == mine and int(status["SigBlk"], 16) & bit:
            found.append(status["Name"].strip())
    return found

if sys.argv[1] == "children":
    start_ray(None, 1)
    print("RESULT", ray.is_initialized(), children_blocking_sigterm())
    ray.shutdown()
    sys.exit(0)
# a thread started before, as BLAS and OpenMP pools are: the kernel may hand it the signal
def send():
    starting.wait()
    os.kill(os.getpid(), signal.SIGINT)
    sent.set()

threading.Thread(target=send).start()
ray.init = init
try:
    start_ray(None, 1)
except KeyboardInterrupt:
    print("RESULT", "interrupted", bool(returned), ray.is_initialized(),
          signal.getsignal(signal.SIGTERM) is sigterm, signal.signal is install)
else:
    print("RESULT", "not interrupted")
"""


def _held(mode: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", HELD_SCRIPT, mode], capture_output=True, text=True, timeout=240
    )
    result = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
    assert len(result) == 1, (out.stdout + out.stderr)[-3000:]
    return result


def test_ctrl_c_while_ray_starts_is_delivered_after() -> None:
    """A Ctrl-C that comes while ``ray.init`` runs (handed to another thread) is held back
    and raised once it has returned: Ray shut down again, the SIGTERM handler that
    ``ray.init`` installs not left in place, ``signal.signal`` itself put back; and the
    processes Ray starts do not inherit SIGTERM blocked."""
    assert _held("signal") == ["RESULT interrupted True False True True"]
    assert _held("children") == ["RESULT True []"]
