"""Statistics and merges on a multi-node Ray cluster that loses nodes, and Ray's edges.

A simulated cluster (``ray.cluster_utils.Cluster``): a head with no CPUs and worker nodes
of one CPU each, in this process. Two tiny BERT classifiers (built from a config, saved
with ``save_pretrained``), 40 texts in 5 batches. References are computed here: the
single-process statistics (one thread, as each 1-CPU worker runs) and the local
streaming merge, which the cluster must reproduce (Grams to 1e-12, merged tensors bit for
bit). A node is lost mid-run with a trap installed in every Ray worker process (a
``worker_process_setup_hook``): the first statistics shard or RegMean group started while
the trap is armed records its node and sleeps; a thread then removes that node.

Every test is bounded: a watchdog ends the run with its tracebacks if one hangs, and the
waits here have deadlines. Nothing is downloaded.
"""

from __future__ import annotations

import faulthandler
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from lmdx import RayClusterError
from lmdx.cli import main
from lmdx.data.batches import text_batches
from lmdx.files import Checkpoint
from lmdx.merge import stream_merge
from lmdx.stats import Statistics
from lmdx.stats.collect import collect_regmean_stats
from lmdx.stats.ray import collect_regmean_stats_ray
from tiny_bert import WORDS, build_tiny_bert
from transformers import AutoTokenizer, BertForSequenceClassification

ray = pytest.importorskip("ray")
pytestmark = [pytest.mark.usefixtures("one_torch_thread"), pytest.mark.slow]  # Ray starts

N_TEXTS, BATCH = 40, 8
HANG = 300  # seconds after which the watchdog ends a test that hangs
WAIT = 240  # seconds the helpers here wait for a run's event


@pytest.fixture(autouse=True)
def watchdog() -> Iterator[None]:
    faulthandler.dump_traceback_later(HANG, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``m0``, ``m1`` (tiny BERT classifiers), ``texts.txt``, ``s0``/``s1`` (their
    single-process statistics) and ``merge.yaml`` (their RegMean merge)."""
    root = tmp_path_factory.mktemp("cluster")
    tiny = build_tiny_bert(root / "tokenizer-source")
    rng = np.random.default_rng(27)
    texts = [" ".join(rng.choice(WORDS, size=rng.integers(2, 14))) for _ in range(N_TEXTS)]
    (root / "texts.txt").write_text("\n".join(texts) + "\n")
    tokenizer = AutoTokenizer.from_pretrained(str(tiny))
    batches = text_batches(texts, tokenizer, batch_size=BATCH)
    for i in range(2):
        torch.manual_seed(i + 1)
        model = BertForSequenceClassification.from_pretrained(str(tiny), num_labels=2)
        model.save_pretrained(root / f"m{i}")
        tokenizer.save_pretrained(root / f"m{i}")
        collect_regmean_stats(model, batches, progress=False, n_threads=1).save(
            root / f"s{i}.safetensors"
        )
    (root / "merge.yaml").write_text(
        "method: regmean\nmodels:\n  - {path: m0, stats: s0.safetensors}\n"
        "  - {path: m1, stats: s1.safetensors}\nalpha: 0.9\n"
        "heads: {patterns: ['classifier.*'], policy: keep}\n"
    )
    return root


@pytest.fixture(scope="module")
def batches(workspace: Path) -> list[dict[str, Any]]:
    texts = (workspace / "texts.txt").read_text().splitlines()
    tokenizer = AutoTokenizer.from_pretrained(str(workspace / "m0"))
    return text_batches(texts, tokenizer, batch_size=BATCH)


MERGE = {"alpha": 0.9, "heads": ["classifier.*"], "progress": False}


def _merge(workspace: Path, out: Path, **kwargs: Any) -> Any:
    models = [workspace / "m0", workspace / "m1"]
    stats = [workspace / "s0.safetensors", workspace / "s1.safetensors"]
    return stream_merge(models, out, stats=stats, **MERGE, **kwargs)


@pytest.fixture(scope="module")
def local_merge(workspace: Path) -> Path:
    """The merge without Ray: what every merge on the cluster must reproduce bit for bit."""
    return Path(_merge(workspace, workspace / "local").out_dir)


def _same_merge(got: Path, ref: Path) -> None:
    a, b = Checkpoint(got), Checkpoint(ref)
    assert a.names() == b.names()
    for name in b.names():
        x, y = a.read(name), b.read(name)
        assert x.dtype == y.dtype and np.array_equal(x, y), name


def _same_statistics(got: Statistics, ref: Statistics) -> None:
    """Counts equal, Grams and sums ≤ 1e-12 relative (float64 sums in another order)."""
    assert got.modules == ref.modules and got.padding == ref.padding
    for module in ref.modules:
        assert got.count(module) == ref.count(module), module
        for a, b in ((got.gram(module), ref.gram(module)), (got.sum(module), ref.sum(module))):
            assert np.linalg.norm(a - b) <= 1e-12 * np.linalg.norm(b), module


# --------------------------------------------------------------------------- no cluster yet


def test_unreachable_address_fails_at_once_and_writes_nothing(
    workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing listens on port 1: one line within seconds (ray.init would retry for
    minutes), before any temporary output exists. Run before this module starts Ray."""
    assert not ray.is_initialized()
    out = tmp_path / "stats.safetensors"
    argv = ["stats", str(workspace / "m0"), str(workspace / "texts.txt"), "--out", str(out)]
    assert main([*argv, "--ray", "127.0.0.1:1", "--no-progress"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nothing answers at 127.0.0.1:1" in err[0], err
    argv = ["merge", str(workspace / "merge.yaml"), "--out", str(tmp_path / "merged")]
    assert main([*argv, "--ray-workers", "2", "--ray-address", "127.0.0.1:1"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lmdx merge: error: Ray cluster 127.0.0.1:1" in err[0], err
    with pytest.raises(RayClusterError, match=r"expected HOST:PORT, ray://HOST:PORT or auto"):
        collect_regmean_stats_ray(workspace / "m0", [{}], address="no-port-here")
    assert list(tmp_path.iterdir()) == [] and not ray.is_initialized()


def _run_until_ray_starts(argv: list[str], cwd: Path, sig: int) -> tuple[int, str]:
    """Run ``lmdx ARGV`` in a new process; send ``sig`` once its local Ray has started."""
    # Ctrl-C handled as in a terminal: a job a shell starts in the background (as CI
    # runners may start the tests) inherits SIGINT ignored, and so would this process.
    code = (
        "import signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
        "from lmdx.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", code, *argv],
        cwd=cwd,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            lines.append(line)
            if "Started a local Ray instance" in line:
                started.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        assert started.wait(WAIT), "".join(lines)[-3000:]
        proc.send_signal(sig)
        rc = proc.wait(WAIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        reader.join(WAIT)
        assert proc.stderr is not None
        proc.stderr.close()
    return rc, "".join(lines)


@pytest.mark.parametrize("command", ["stats", "merge"])
def test_interrupt_with_ray_running_keeps_the_promise(
    workspace: Path, tmp_path: Path, command: str
) -> None:
    """SIGTERM (stats) or Ctrl-C (merge) once Ray runs: exit 130, lmdx's line, nothing
    written (ray.init replaces the SIGTERM handler; lmdx puts its own back)."""
    if command == "stats":
        argv = [str(workspace / "m0"), str(workspace / "texts.txt"), "--ray", "--workers", "2"]
        argv = ["stats", *argv, "--out", str(tmp_path / "out.safetensors")]
        sig = signal.SIGTERM
    else:
        argv = ["merge", str(workspace / "merge.yaml"), "--out", str(tmp_path / "out")]
        argv = [*argv, "--ray-workers", "2", "--no-progress"]
        sig = signal.SIGINT
    rc, err = _run_until_ray_starts(argv, workspace, sig)
    assert rc == 130, err[-3000:]
    assert f"lmdx {command}: interrupted; nothing was written" in err.splitlines()[-1], err
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- on the cluster


def _trap_hook(trap: str) -> Callable[[], None]:
    """A worker process's setup: wrap the statistics shard and the RegMean group solver so
    that, while ``trap/armed`` exists, the first call anywhere writes its node to
    ``trap/sprung`` and sleeps (until its node is removed); while ``trap/die`` exists,
    every call kills its own process."""

    def hook() -> None:
        import os
        import time

        import lmdx.merge.builtin.regmean as merge_regmean
        import lmdx.stats.ray as stats_ray
        import ray

        def trapped(fn: Any) -> Any:
            def call(*args: Any, **kwargs: Any) -> Any:
                if os.path.exists(os.path.join(trap, "die")):
                    os._exit(1)
                if os.path.exists(os.path.join(trap, "armed")):
                    try:
                        fd = os.open(os.path.join(trap, "claim"), os.O_CREAT | os.O_EXCL)
                    except FileExistsError:
                        pass
                    else:
                        os.close(fd)
                        node = ray.get_runtime_context().get_node_id()
                        with open(os.path.join(trap, "sprung.tmp"), "w") as f:
                            f.write(node)
                        os.rename(os.path.join(trap, "sprung.tmp"), os.path.join(trap, "sprung"))
                        time.sleep(3600)
                return fn(*args, **kwargs)

            return call

        merge_regmean.solve_step = trapped(merge_regmean.solve_step)
        stats_ray.collect_regmean_stats = trapped(stats_ray.collect_regmean_stats)

    return hook


class Nodes:
    """The cluster, its trap folder, and node surgery."""

    def __init__(self, cluster: Any, trap: Path) -> None:
        self.cluster, self.trap = cluster, trap

    def add(self) -> None:
        self.cluster.add_node(num_cpus=1, object_store_memory=10**8)
        self.cluster.wait_for_nodes()

    def reset(self, n: int) -> None:
        """Exactly ``n`` worker nodes, the trap disarmed."""
        for f in self.trap.iterdir():
            f.unlink()
        while len(self.cluster.worker_nodes) > n:
            self.cluster.remove_node(next(iter(self.cluster.worker_nodes)))
        while len(self.cluster.worker_nodes) < n:
            self.add()

    def lose_trapped_node(self, everything: bool = False) -> threading.Thread:
        """Arm the trap; a thread removes the node it catches (``everything``: every worker
        node, the caught one last). The thread's ``removed`` attribute counts the nodes removed."""
        (self.trap / "armed").touch()
        thread = threading.Thread(target=self._remove, args=(everything,), daemon=True)
        thread.removed = 0  # type: ignore[attr-defined]
        thread.start()
        return thread

    def _remove(self, everything: bool) -> None:
        sprung, deadline = self.trap / "sprung", time.monotonic() + WAIT
        while not sprung.exists():
            if time.monotonic() > deadline:
                return
            time.sleep(0.05)
        node_id = sprung.read_text()
        caught = [n for n in self.cluster.worker_nodes if n.node_id == node_id]
        rest = [n for n in self.cluster.worker_nodes if n.node_id != node_id]
        # Every node: the others first. The caught node's one CPU is held by the sleeping
        # call, so nothing else can run there; removed first, its retried work could
        # finish on a node not yet removed (a tiny group takes milliseconds).
        for node in (rest + caught) if everything else caught:
            self.cluster.remove_node(node)
            threading.current_thread().removed += 1  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nodes]:
    from ray.cluster_utils import Cluster

    trap = tmp_path_factory.mktemp("trap")
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        nodes = Nodes(c, trap)
        nodes.reset(2)
        # log_to_driver=False: Ray's own processes' log lines (a raylet's warning that
        # /tmp is nearly full, say) would reach this process's stderr at any moment, among
        # the lines of lmdx's that the tests count.
        ray.init(
            address=c.address,
            runtime_env={"worker_process_setup_hook": _trap_hook(str(trap))},
            log_to_driver=False,
        )
        yield nodes
    finally:
        ray.shutdown()
        c.shutdown()


@pytest.fixture
def nodes(cluster: Nodes, monkeypatch: pytest.MonkeyPatch) -> Nodes:
    """The cluster with two worker nodes of one CPU each, the trap disarmed."""
    monkeypatch.setenv("LMDX_RAY_WAIT", "60")
    cluster.reset(2)
    return cluster


def test_more_workers_than_cpus_equal_one_process(
    nodes: Nodes, workspace: Path, batches: list, local_merge: Path, tmp_path: Path
) -> None:
    """3 shards and 3 merge workers on 2 CPUs: slower, never stuck, and the results of one
    process (2 workers: the same)."""
    single = Statistics.load(workspace / "s0.safetensors")
    for workers in (3, 2):
        got = collect_regmean_stats_ray(
            workspace / "m0", batches, num_workers=workers, progress=False
        )
        assert got.extra["ray"]["workers"] == workers
        _same_statistics(got, single)
        res = _merge(workspace, tmp_path / f"w{workers}", ray_workers=workers)
        assert res.report["ray_workers"] == workers
        _same_merge(res.out_dir, local_merge)


@pytest.mark.parametrize("spare", [True, False], ids=["spare", "no-spare"])
def test_lost_node_work_is_redone_elsewhere(
    nodes: Nodes,
    workspace: Path,
    batches: list,
    local_merge: Path,
    tmp_path: Path,
    spare: bool,
) -> None:
    """The node running a shard (then a group) is removed: its work runs again on a spare
    node, or, with none, on the node that remains once its own work is done; the results
    are those of one process."""
    if spare:
        nodes.add()
    remover = nodes.lose_trapped_node()
    got = collect_regmean_stats_ray(workspace / "m0", batches, num_workers=2, progress=False)
    remover.join(WAIT)
    assert remover.removed == 1  # type: ignore[attr-defined]
    _same_statistics(got, Statistics.load(workspace / "s0.safetensors"))

    nodes.reset(3 if spare else 2)
    remover = nodes.lose_trapped_node()
    res = _merge(workspace, tmp_path / "merged", ray_workers=2)
    remover.join(WAIT)
    assert remover.removed == 1  # type: ignore[attr-defined]
    _same_merge(res.out_dir, local_merge)


def test_no_node_left_stops_with_one_line_and_writes_nothing(
    nodes: Nodes,
    workspace: Path,
    batches: list,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Every worker node lost mid-run: after LMDX_RAY_WAIT seconds without a node that
    can take the work, one line names what was lost; nothing is written."""
    monkeypatch.setenv("LMDX_RAY_WAIT", "3")
    remover = nodes.lose_trapped_node(everything=True)
    with pytest.raises(RayClusterError, match=r"collect_regmean_stats_ray: shard \d of 2 .*lost"):
        collect_regmean_stats_ray(workspace / "m0", batches, num_workers=2, progress=False)
    remover.join(WAIT)
    assert remover.removed == 2  # type: ignore[attr-defined]

    nodes.reset(2)
    remover = nodes.lose_trapped_node(everything=True)
    out = tmp_path / "merged"
    argv = ["merge", str(workspace / "merge.yaml"), "--out", str(out), "--no-progress"]
    assert main([*argv, "--ray-workers", "2"]) == 1
    remover.join(WAIT)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "lmdx merge: error: the regmean group of 'bert." in err[0], err
    # the group's task asked for the memory the plan estimates for it
    assert re.search(
        r"lost; no node of the Ray cluster has had 1 CPU\(s\) and [\d.]+ MB of memory to run it "
        r"for 3 s",
        err[0],
    ), err
    assert list(tmp_path.iterdir()) == []


def test_worker_dying_twice_in_a_merge_is_a_cluster_error(
    nodes: Nodes, workspace: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every worker process solving a group dies: after the retry, one line naming the
    group, exit status 1 (not 2, bad input), no statistics wording; nothing written."""
    (nodes.trap / "die").touch()
    out = tmp_path / "merged"
    argv = ["merge", str(workspace / "merge.yaml"), "--out", str(out), "--no-progress"]
    assert main([*argv, "--ray-workers", "2"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "lmdx merge: error: the regmean group of 'bert." in err[0], err
    assert (
        "failed on its Ray worker: its Ray worker process or node was lost on the retry" in err[0]
    )
    assert "shard" not in err[0]
    assert list(tmp_path.iterdir()) == []


def test_missing_model_on_a_node_says_what_each_node_must_see(
    nodes: Nodes, batches: list, tmp_path: Path
) -> None:
    """A folder no node sees (as on a cluster without a shared filesystem): the error
    names the node and the path it must see."""
    with pytest.raises(RuntimeError, match=r"model folder .*nowhere is not on Ray node .*every"):
        collect_regmean_stats_ray(tmp_path / "nowhere", batches, address="auto", progress=False)
