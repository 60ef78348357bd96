"""The code blocks of README.md and docs/ run as written (the marker convention is in
``doc_blocks.py``): every block marked ``test:`` runs, in page order, in the workspace it
names; every code block carries a marker; a ``tested:`` block names a test file that reads
its page."""

from __future__ import annotations

import contextlib
import io
import runpy
import shlex
import sys
from collections import defaultdict
from pathlib import Path

import pytest
from doc_blocks import CODE, ROOT, WORKSPACES, Block, blocks, command_lines, pages
from lmdx.cli import main

#: page -> workspace -> its test-marked blocks, in page order.
CHAINS: dict[tuple[str, str], list[Block]] = defaultdict(list)
for _page in pages():
    for _block in blocks(_page):
        if _block.kind == "test":
            CHAINS[(str(_page.relative_to(ROOT)), _block.arg)].append(_block)


def test_every_code_block_is_marked_and_every_marker_is_known() -> None:
    problems = []
    for page in pages():
        for block in blocks(page):
            if block.lang in CODE and block.kind is None:
                problems.append(
                    f"{block.where}: a {block.lang} block without a marker: put "
                    "<!-- test: WORKSPACE -->, <!-- tested: tests/FILE.py --> or "
                    "<!-- not run: WHY --> on the line above it (tests/docs/doc_blocks.py)"
                )
            if block.kind == "test" and block.arg not in WORKSPACES:
                problems.append(f"{block.where}: unknown workspace {block.arg!r}")
            if block.kind == "not run" and not block.arg:
                problems.append(f"{block.where}: 'not run:' needs a reason")
            if block.kind == "tested":
                test = ROOT / block.arg
                name = str(page.relative_to(ROOT))
                if not test.is_file() or name not in test.read_text(encoding="utf-8"):
                    problems.append(f"{block.where}: {block.arg} does not exist or read {name}")
    assert not problems, "\n".join(problems)


def test_the_readme_is_read_to_the_end() -> None:
    """The README stays a front page (the rest lives in docs/): at most 250 lines."""
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= 250, len(lines)


def test_the_pages_have_runnable_blocks() -> None:
    """The convention is in use (a parser that finds nothing would pass everything), and
    the README's quick start runs from its first step (the example that makes its inputs)."""
    assert ("docs/guide/statistics.md", "classifiers") in CHAINS
    quick = CHAINS[("README.md", "empty")]
    assert command_lines(quick[0].text)[0].startswith("python examples/quickstart.py")
    assert sum(len(c) for c in CHAINS.values()) >= 8


def run_line(line: str, where: str, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    """One command line of a shell block: ``cd DIR``; ``python examples/NAME.py ARGS`` (the
    repository's example, run as a script); or ``lmdx ARGS``, expected to exit 0."""
    argv = shlex.split(line, comments=True)
    if argv[0] == "cd" and len(argv) == 2:
        monkeypatch.chdir(argv[1])
        return
    if argv[0] == "python" and argv[1].startswith("examples/"):
        monkeypatch.setattr(sys, "argv", argv[1:])
        runpy.run_path(str(ROOT / argv[1]), run_name="__main__")
        return
    assert argv[0] == "lmdx", f"{where}: not an lmdx command: {line}"
    code = main(argv[1:])
    out, err = capsys.readouterr()
    assert code == 0, f"{where}: `{line}` exited {code}: {err}"
    if where.startswith("README.md:"):
        # The quick start shows the practice the guides teach, and so ends clean.
        notes = ("warning", "poorly determined", "not solved", "ridge")
        said = [ln for ln in (out + err).splitlines() if any(n in ln.lower() for n in notes)]
        assert not said, f"{where}: `{line}` warned: {said}"


@pytest.mark.slow  # the pages' examples fine-tune and merge real models
@pytest.mark.parametrize(
    ("page", "workspace"), sorted(CHAINS), ids=[f"{p}::{w}" for p, w in sorted(CHAINS)]
)
def test_marked_blocks_run(
    page: str,
    workspace: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    WORKSPACES[workspace](tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    namespace: dict[str, object] = {"__name__": "__doc_block__"}
    for block in CHAINS[(page, workspace)]:
        if block.lang in ("bash", "console", "sh"):
            for line in command_lines(block.text):
                run_line(line, block.where, monkeypatch, capsys)
        elif block.lang == "yaml":
            first = block.text.split("\n", 1)[0]
            assert first.startswith("# ") and first.split()[1].endswith(".yaml"), block.where
            Path(first.split()[1]).write_text(block.text, encoding="utf-8")
        elif block.lang == "python":
            with contextlib.redirect_stdout(io.StringIO()):
                exec(compile(block.text, block.where, "exec"), namespace)
        else:
            pytest.fail(f"{block.where}: a {block.lang!r} block cannot run")
