"""What the commands share: sizes of outputs on disk."""

from __future__ import annotations

from pathlib import Path

__all__ = ["size_of"]


def size_of(path: Path) -> int:
    """Bytes of a file, or of every file under a folder."""
    if path.is_dir():
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return path.stat().st_size
