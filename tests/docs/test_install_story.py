"""Where lmdx and torch come from, told one way everywhere.

* lmdx is not on PyPI yet: no page, example, script or message tells a user to
  ``pip install lmdx`` (or ``'lmdx[...]'``) except the install page's section that says
  where lmdx comes from and what changes at the first release;
* torch's CPU build comes from PyTorch's CPU index: every ``pip install torch`` shown names
  it, and the scripts install torch only through ``scripts/install_torch.sh``, which falls
  back to pip's configured index, saying so in one line, where that index cannot be
  reached (run here against a local index that answers and a host that does not exist).
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from doc_blocks import CODE, ROOT, blocks, command_lines, pages

CPU_INDEX = "https://download.pytorch.org/whl/cpu"
#: ``pip install lmdx``, ``pip install "lmdx[merge,lmd]"``: lmdx from an index.
FROM_INDEX = re.compile(r"pip install\s+(?:-\S+\s+)*['\"]?lmdx(?:\[[\w,]+\])?['\"]?(?![\w.-])")


def _told_where() -> str:
    """The install page's section on where lmdx comes from (the one place allowed to name
    a future ``pip install lmdx``)."""
    text = (ROOT / "docs" / "install.md").read_text(encoding="utf-8")
    start = text.index("## Where lmdx comes from")
    return text[start : text.index("\n## ", start + 1)]


def _texts() -> Iterator[tuple[Path, str]]:
    files = [
        *pages(),
        *sorted((ROOT / "python" / "lmdx").rglob("*.py")),
        *sorted((ROOT / "examples").glob("*.py")),
        *sorted((ROOT / "scripts").glob("*.sh")),
        ROOT / "bench" / "README.md",
    ]
    for path in files:
        yield path, path.read_text(encoding="utf-8")


def test_lmdx_is_never_installed_from_an_index() -> None:
    allowed = _told_where()
    assert FROM_INDEX.search(allowed)  # the release sentence is there (and the regex works)
    found = []
    for path, text in _texts():
        if path.name == "install.md":
            text = text.replace(allowed, "")
        found += [f"{path.relative_to(ROOT)}: {m.group(0)}" for m in FROM_INDEX.finditer(text)]
    assert not found, "\n".join(found)


def test_torch_comes_from_the_cpu_index_everywhere() -> None:
    shown = [
        line
        for page in pages()
        for block in blocks(page)
        if block.lang in CODE
        for line in command_lines(block.text)
        if re.match(r"pip install\s+(?:-\S+\s+)*['\"]?torch\b", line)
    ]
    assert len(shown) >= 1  # the install page's (the README runs install_torch.sh)
    assert all(f"--index-url {CPU_INDEX}" in line for line in shown), shown
    scripts = [p for p in (ROOT / "scripts").glob("*.sh") if p.name != "install_torch.sh"]
    assert not [p.name for p in scripts if re.search(r"torch[=<>]", p.read_text())]
    users = {p.name for p in scripts if "install_torch.sh" in p.read_text()}
    assert {"venv.sh", "check_wheel.sh"} <= users


@pytest.fixture
def local_index(tmp_path: Path) -> Iterator[str]:
    """An HTTP server on this machine answering for an (empty) package index."""
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *args: None  # type: ignore[attr-defined]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


#: The installed torch's release, without its local label (``2.13.0`` of ``2.13.0+cpu``).
_RELEASE = torch.__version__.split("+")[0]


def _install_torch(index: str, pin: bool = False) -> subprocess.CompletedProcess[str]:
    # A range the installed torch satisfies: pip is asked and has nothing to fetch. The
    # installed version pinned (``pin``): the script sees it installed and asks no index.
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "LMDX_TORCH": f"torch=={torch.__version__}" if pin else f"torch>={_RELEASE}",
        "LMDX_TORCH_INDEX": index,
    }
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "install_torch.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_install_torch_uses_the_index_when_it_answers(local_index: str) -> None:
    done = _install_torch(local_index)
    assert done.returncode == 0, done.stderr
    assert "cannot be reached" not in done.stderr


def test_install_torch_falls_back_in_one_line_when_the_index_is_unreachable() -> None:
    done = _install_torch("https://download.invalid/whl/cpu")  # .invalid never resolves
    assert done.returncode == 0, done.stderr
    said = [ln for ln in done.stderr.splitlines() if ln.startswith("install_torch:")]
    assert said == [
        "install_torch: PyTorch's CPU index (https://download.invalid/whl/cpu) cannot be "
        f"reached; installing torch>={_RELEASE} from pip's configured index "
        "instead (PyPI's is the CUDA build on Linux x86-64)"
    ]


def test_install_torch_asks_no_index_when_the_pinned_torch_is_there() -> None:
    """A second set-up (venv.sh reused) spends no time on PyTorch's index."""
    done = _install_torch("https://download.invalid/whl/cpu", pin=True)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
