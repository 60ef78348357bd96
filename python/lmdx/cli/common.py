"""What the commands share: one way to report errors, one help layout (every default
shown), sizes of outputs on disk, and text from files shown safely on a terminal."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

from .._errors import LmdxError

__all__ = ["Claimed", "HelpFormatter", "debugging", "printable", "report_errors", "size_of"]

_debug = [os.environ.get("LMDX_DEBUG", "") not in ("", "0")]


@contextlib.contextmanager
def debugging(enabled: bool) -> Iterator[None]:
    """Within the block, errors propagate with their traceback (``lmdx --debug``, or the
    environment variable ``LMDX_DEBUG=1``) instead of being reported in one line."""
    was = _debug[0]
    _debug[0] = was or enabled
    try:
        yield
    finally:
        _debug[0] = was


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """``--help`` of every command: descriptions and examples laid out as written but
    within the width (a line of prose wrapped; an indented ``lmdx ...`` example continued
    with ``\\``; other indented lines, such as tables, kept), and each option's default
    value after its help (``(default: 128)``), unless the help already says it or there is
    none to show (a flag, an option that is unset by default)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        lines: list[str] = []
        for line in text.splitlines():
            body = line.lstrip()
            if len(indent + line) <= width or not body:
                lines.append(indent + line)
            elif line == body:  # prose
                lines += textwrap.wrap(line, width, initial_indent=indent, subsequent_indent=indent)
            elif body.startswith("lmdx "):  # a command line: continued with a backslash
                lead = indent + line[: len(line) - len(body)]
                wrapped = textwrap.wrap(
                    body,
                    width - 2,
                    initial_indent=lead,
                    subsequent_indent=lead + "    ",
                    break_long_words=False,
                    break_on_hyphens=False,
                )
                lines += [f"{ln} \\" for ln in wrapped[:-1]] + wrapped[-1:]
            else:
                lines.append(indent + line)
        return "\n".join(lines)

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        shown = (
            action.option_strings
            and default is not None
            and default is not argparse.SUPPRESS
            and not isinstance(default, bool)
            and "default" not in text
        )
        return f"{text} (default: %(default)s)" if shown else text


def printable(text: object) -> str:
    """``text`` as one line that is safe to print: line breaks, terminal escape sequences
    and other invisible characters (from names and descriptions stored in files
    received from others) are shown escaped, as Python writes them (``\\x1b``)."""
    return "".join(ch if ch.isprintable() else ascii(ch)[1:-1] for ch in str(text))


class Claimed:
    """The output a command has committed to writing (after checking it did not exist):
    a Ctrl-C that arrives after the output was renamed into place reports it as written."""

    def __init__(self) -> None:
        self.path: Path | None = None

    def claim(self, path: Path) -> Path:
        self.path = path
        return path


def report_errors(
    command: str,
    body: Callable[[], int],
    usage: tuple[type[BaseException], ...],
    claimed: Claimed | None = None,
) -> int:
    """Run a command's ``body`` and turn errors into one line on stderr and an exit code:
    2 for the user's mistakes (``usage``: bad arguments, config, data, statistics that do
    not fit), 1 for other errors (an unreadable or corrupted file, a full disk, an
    internal error), 130 for Ctrl-C or SIGTERM (outputs are written atomically: nothing
    was written, unless the output in ``claimed`` was already complete). The line
    never carries raw control characters; with :func:`debugging` errors propagate."""
    try:
        return body()
    except usage as exc:
        if _debug[0]:
            raise
        print(f"lmdx {command}: error: {printable(exc)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # the reader of stdout has gone: lmdx.cli.main stops quietly
        raise
    except (LmdxError, ValueError, RuntimeError, OSError) as exc:
        if _debug[0]:
            raise
        print(f"lmdx {command}: error: {printable(exc)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        done = claimed.path if claimed is not None else None
        if done is not None and done.exists():
            print(
                f"lmdx {command}: interrupted after {printable(done)} was written; it is "
                "complete (outputs appear only when complete)",
                file=sys.stderr,
            )
        else:
            print(f"lmdx {command}: interrupted; nothing was written", file=sys.stderr)
        return 130
    except Exception as exc:
        if _debug[0]:
            raise
        print(
            f"lmdx {command}: internal error: {type(exc).__name__}: {printable(exc)} (run "
            "with lmdx --debug for the traceback, and please report it)",
            file=sys.stderr,
        )
        return 1


def size_of(path: Path) -> int:
    """Bytes of a file, or of every file under a folder."""
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size
