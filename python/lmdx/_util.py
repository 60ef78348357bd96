"""Small helpers every part of lmdx shares: progress bars, sizes, name patterns, the
process's memory, suggestions for mistyped names."""

from __future__ import annotations

import contextlib
import difflib
import fnmatch
import os
import resource
import sys
from collections.abc import Sequence
from typing import Any

__all__ = [
    "current_rss_bytes",
    "did_you_mean",
    "matches",
    "parse_size",
    "peak_rss_bytes",
    "progress_bar",
    "split_in_order",
]


def progress_bar(total: int, desc: str, enabled: bool, unit: str = "it") -> Any:
    """A tqdm bar when tqdm is installed and ``enabled`` (tqdm hides itself off a TTY);
    otherwise an object with the same ``update``/``close`` that does nothing."""
    if enabled:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            pass
        else:
            return tqdm(total=total, desc=desc, unit=unit, disable=None, leave=False)
    return _NoProgress()


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def parse_size(size: int | str) -> int:
    """Bytes from ``"2GB"``, ``"500MB"``, ``"64KB"``, ``"10B"`` (decimal units) or an int;
    at least 1 byte (``"infGB"``, ``"nanMB"`` and negative sizes are refused)."""
    if isinstance(size, int) and not isinstance(size, bool) and size >= 1:
        return size
    text = str(size).strip().upper()
    for unit, mult in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if text.endswith(unit) and not isinstance(size, int):
            with contextlib.suppress(ValueError, OverflowError):
                value = int(float(text[: -len(unit)]) * mult)
                if value >= 1:
                    return value
            break
    raise ValueError(f"size: expected e.g. '2GB' or a number of bytes, got {size!r}")


def matches(name: str, patterns: Sequence[str] | None) -> bool:
    """``name`` matches one of the shell-style ``patterns`` (``fnmatch``, case-sensitive)."""
    return any(fnmatch.fnmatchcase(name, p) for p in patterns or ())


def split_in_order(sizes: Sequence[int], limit: int) -> list[list[int]]:
    """Indices of ``sizes``, in order, cut into consecutive parts whose sizes add up to at
    most ``limit`` (an item larger than ``limit`` is a part of its own): output shards,
    statistics shards, collection passes."""
    parts: list[list[int]] = [[]]
    total = 0
    for i, size in enumerate(sizes):
        if parts[-1] and total + size > limit:
            parts.append([])
            total = 0
        parts[-1].append(i)
        total += size
    return parts


def peak_rss_bytes() -> int:
    """Peak resident set size of this process so far (bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def current_rss_bytes() -> int:
    """Resident set size of this process now (bytes; the peak where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return peak_rss_bytes()


def did_you_mean(word: str, known: Sequence[str]) -> str:
    """``"; did you mean X?"`` when ``word`` is a likely typo of one of ``known`` (the
    closest, by difflib's ratio), else ``""``: appended to an error naming ``word``."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close and close[0] != word else ""
