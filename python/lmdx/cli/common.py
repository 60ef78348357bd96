"""What the commands share: one way to report errors, sizes of outputs on disk."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

from .._errors import LmdxError

__all__ = ["report_errors", "size_of"]


def report_errors(
    command: str, body: Callable[[], int], usage: tuple[type[BaseException], ...]
) -> int:
    """Run a command's ``body`` and turn errors into one line on stderr and an exit code:
    2 for the user's mistakes (``usage``: bad arguments, config, data, statistics that do
    not fit), 1 for other errors (an unreadable or corrupted file, a full disk), 130 for
    Ctrl-C or SIGTERM (outputs are written atomically, so nothing was written)."""
    try:
        return body()
    except usage as exc:
        print(f"lmdx {command}: error: {exc}", file=sys.stderr)
        return 2
    except (LmdxError, ValueError, RuntimeError, OSError) as exc:
        print(f"lmdx {command}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"lmdx {command}: interrupted; nothing was written", file=sys.stderr)
        return 130


def size_of(path: Path) -> int:
    """Bytes of a file, or of every file under a folder."""
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size
