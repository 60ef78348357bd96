"""Command line: ``lmdx info``."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="lmdx", description="Fast, exact RegMean merging and LMD on CPU."
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser("info", help="print version, SIMD path, OpenMP and thread settings")
    args = parser.parse_args(argv)
    if args.command == "info":
        from .config import show_config

        show_config()
        return 0
    parser.print_help(sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
