"""The ``lmdx`` command: ``info``, ``stats``, ``merge``, ``decompose`` and ``methods``."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any

from .._errors import CliError, DataError, MissingFileError
from .._util import did_you_mean
from . import decompose, merge, methods, stats
from .common import HelpFormatter, debugging, printable, report_errors

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point; a SIGTERM (e.g. from a job scheduler) is handled like Ctrl-C, so
    partial outputs are removed before the process ends. When the reader of the output
    goes away (``lmdx stats show FILE | head -1``), the command stops quietly with exit
    status 1, as Python's documentation of SIGPIPE recommends."""
    try:
        try:
            if threading.current_thread() is not threading.main_thread():
                return _main(argv)
            previous = signal.signal(signal.SIGTERM, _terminated)
            try:
                return _main(argv)
            finally:
                signal.signal(signal.SIGTERM, previous)
        finally:
            sys.stdout.flush()  # a closed pipe shows here (also after --help), not at exit
    except BrokenPipeError:
        # Python flushes stdout again at exit: point it at /dev/null so that flush has
        # nowhere to fail (the rest of the output has no reader anyway).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _terminated(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt("terminated (SIGTERM)")


def _main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "--debug":
        with debugging(True):
            return _command(argv[1:])
    return _command(argv)


def _command(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="lmdx",
        description="Fast, exact RegMean merging and LMD on CPU.",
        formatter_class=HelpFormatter,
    )
    parser.add_argument(
        "--debug",
        action="store_true",
        help="show errors with their traceback (before COMMAND; or LMDX_DEBUG=1)",
    )
    if argv and argv[0] == "stats":
        return stats.run_stats_cli(argv[1:])
    # the commands that have a module: (name, module, its parser's builder)
    modules = (
        ("stats", stats, stats.add_stats_parser),
        ("merge", merge, merge.add_merge_parser),
        ("decompose", decompose, decompose.add_decompose_parser),
        ("methods", methods, methods.add_methods_parser),
    )
    commands = ("info", *(name for name, _, _ in modules))
    if argv and not argv[0].startswith("-") and argv[0] not in commands:
        print(
            f"lmdx: error: no command {printable(argv[0])!r}"
            f"{did_you_mean(argv[0], commands)} (commands: {', '.join(commands)})",
            file=sys.stderr,
        )
        return 2
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("info", help="print version, SIMD path, OpenMP and thread settings")
    # only the command that runs gets its full parser (building merge's imports the merge)
    for name, module, add in modules:
        if argv and argv[0] == name:
            add(sub)
        else:
            sub.add_parser(name, help=module.HELP)
    args = parser.parse_args(argv)
    args.argv = argv  # the command line, recorded by lmdx merge
    if args.command == "merge":
        return merge.run_merge_cli(args)
    if args.command == "methods":
        return methods.run_methods(args)
    if args.command == "info":
        from ..config import show_config

        show_config()
        return 0
    if args.command == "decompose":
        return report_errors(
            "decompose",
            lambda: decompose.run_decompose(args),
            usage=(CliError, DataError, MissingFileError),
        )
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
