"""``lmdx ... | head -1``: when the reader of the output goes away before the command has
written it all, the command stops quietly (no error line, no traceback) with exit status
1, as Python's documentation of SIGPIPE recommends. The reader here closes its end of the
pipe before the command starts, so every run meets the closed pipe at its first write."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import hf_models as H
import pytest


@pytest.fixture(scope="module")
def stats_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pipe") / "s.safetensors"
    _, models, batches = H.cached_family("bert", k=1)
    H.collect(models[0], batches[0]).save(path)
    return path


@pytest.mark.parametrize(
    "argv", [["stats", "show", "{stats}"], ["stats", "show", "--json", "{stats}"]]
)
def test_a_closed_pipe_ends_the_command_quietly(stats_file: Path, argv: list[str]) -> None:
    args = [a.format(stats=stats_file) for a in argv]
    with subprocess.Popen(
        [sys.executable, "-m", "lmdx", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        proc.stdout.close()  # the reader is gone before the first line is written
        err = proc.stderr.read().decode()
        assert proc.wait(timeout=120) == 1
    assert err == ""


def test_the_same_commands_print_when_read(stats_file: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lmdx", "stats", "show", str(stats_file)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert str(stats_file) in done.stdout.splitlines()[0]
