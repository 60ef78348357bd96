"""Pages generated when the site is built, so they cannot drift from what they describe.

* ``reference/cli.md``: the ``--help`` of ``lmdx`` and of every command and sub-command, as
  the installed argparse parsers print it (commands found in ``lmdx --help``, sub-commands
  such as ``lmdx stats add`` in their command's help, each confirmed by its own usage line),
  and the merge methods as ``lmdx methods`` lists them.
  It replaces the stub of that name in ``docs/`` (which says how to see the same help).
* ``index.md``: the repository's README.md, its links into ``docs/`` made relative to the
  site (one text for GitHub and the site's home page).
* ``bench/README.md`` and ``bench/RESULTS.md``: the benchmark conventions and the raw runs,
  copied from the repository's ``bench/`` folder, so the benchmarks page can link to them.
* ``css/pygments.css``: the colours of the code blocks, which Pygments highlights when the
  site is built (``pymdownx.highlight``), so the site needs no script from a CDN.

Registered in ``mkdocs.yml`` (``hooks:``); run by ``mkdocs build``.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
#: Width of the generated help (argparse reads it from COLUMNS).
HELP_COLUMNS = "100"
#: Pygments' colours for the code blocks.
PYGMENTS_STYLE = "friendly"


def _help(argv: list[str], *, strict: bool = True) -> str:
    """What ``lmdx ARGV --help`` prints (argparse exits 0 after printing); with
    ``strict``, anything else stops the build."""
    from lmdx.cli import main

    out, err = io.StringIO(), io.StringIO()
    code: object = None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main([*argv, "--help"])
        except SystemExit as done:
            code = done.code
    if strict and code not in (0, None):
        raise RuntimeError(f"`lmdx {' '.join(argv)} --help` exited {code}: {err.getvalue()}")
    return out.getvalue().rstrip()


def _commands(top_help: str) -> list[str]:
    """The command names listed under ``COMMAND`` in ``lmdx --help``."""
    block = top_help.split("\n  COMMAND\n", 1)[1].split("\n\n", 1)[0]
    return re.findall(r"^    (\w[\w-]*)", block, flags=re.M)


def _sub_commands(command: str, text: str) -> list[str]:
    """Words written as ``lmdx COMMAND WORD ...`` in a command's help whose own ``--help``
    is a separate parser (its usage line names ``lmdx COMMAND WORD``)."""
    words = re.findall(rf"^\s+lmdx {command} ([a-z][\w-]*)(?=\s|$)", text, flags=re.M)
    return [
        w
        for w in dict.fromkeys(words)
        if _help([command, w], strict=False).startswith(f"usage: lmdx {command} {w}")
    ]


def cli_reference() -> str:
    """The CLI reference page: every command's help, generated from the parsers."""
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        top = _help([])
        sections = [(["lmdx"], top)]
        for command in _commands(top):
            text = _help([command])
            sections.append((["lmdx", command], text))
            sections += [
                (["lmdx", command, w], _help([command, w])) for w in _sub_commands(command, text)
            ]
    finally:
        if previous is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = previous
    page = [
        "# Command line reference",
        "",
        "Generated when this site is built from the `lmdx` command's own argument parsers "
        "(`lmdx COMMAND --help` prints the same). Every option shows its default.",
        "",
    ]
    for argv, text in sections:
        page += [f"## `{' '.join(argv)}`", "", "```text", text, "```", ""]
    from lmdx.cli.methods import methods_text

    page += [
        "## The merge methods (`lmdx methods`)",
        "",
        "What `lmdx methods` prints: every registered method, what it needs and its options "
        "with their defaults; `lmdx methods NAME` adds an example config to start from.",
        "",
        "```text",
        methods_text(),
        "```",
        "",
    ]
    return "\n".join(page)


def on_files(files: Files, config: Any) -> Files:
    stub = files.get_file_from_path("reference/cli.md")
    if stub is not None:
        files.remove(stub)
    files.append(File.generated(config, "reference/cli.md", content=cli_reference()))
    readme = (ROOT / "README.md").read_text(encoding="utf-8").replace("](docs/", "](")
    files.append(File.generated(config, "index.md", content=readme))
    for name in ("README.md", "RESULTS.md"):
        text = (ROOT / "bench" / name).read_text(encoding="utf-8")
        files.append(File.generated(config, f"bench/{name}", content=text))
    files.append(File.generated(config, "css/pygments.css", content=pygments_css()))
    return files


def pygments_css() -> str:
    """The style sheet of the code blocks Pygments highlighted (class ``highlight``)."""
    from pygments.formatters import HtmlFormatter

    return str(HtmlFormatter(style=PYGMENTS_STYLE).get_style_defs(".highlight"))
