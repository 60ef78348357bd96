"""Outputs that appear only when complete: temporary names beside the target, renamed
at the end; leftovers of killed runs cleaned up.

Temporary files and folders carry this host's and process's identity in their names
(``.NAME.lmdx-<host>-<pid>-*.tmp``); leftovers of a killed run (its process no longer
alive) are removed by the next run writing the same output. On any error, including
KeyboardInterrupt, the temporary is removed and the target is untouched.

Outputs get the mode of any file or folder the user creates (``0666`` / ``0777`` less
the umask), not the private mode of a temporary: :func:`output_mode`.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import hashlib
import os
import re
import shutil
import socket
import tempfile
from collections.abc import Iterator
from pathlib import Path

from .._errors import DiskFullError

__all__ = [
    "atomic_directory",
    "atomic_file",
    "check_free_space",
    "disk_full",
    "existing_parent",
    "is_disk_full",
    "output_mode",
    "remove_stale_temporaries",
]


def disk_full(path: Path, exc: OSError, needed: int | None = None) -> DiskFullError:
    """The :class:`DiskFullError` for an ENOSPC/EDQUOT ``exc`` while writing ``path``."""
    try:
        free = shutil.disk_usage(path.parent).free
        room = f"{free / 1e9:.2f} GB free"
    except OSError:
        room = "free space unknown"
    need = f"{needed / 1e9:.2f} GB needed, " if needed is not None else ""
    return DiskFullError(
        exc.errno,
        f"disk full while writing {path} ({need}{room} in {path.parent}); nothing was "
        "written: free some space or write elsewhere",
    )


def is_disk_full(exc: OSError) -> bool:
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)


def check_free_space(out: Path, nbytes: int) -> None:
    """Raise :class:`DiskFullError` before any work if ``out``'s disk lacks ``nbytes``."""
    parent = existing_parent(out)
    free = shutil.disk_usage(parent).free
    if free < nbytes * 1.01 + (1 << 20):
        raise DiskFullError(
            28,
            f"output {out}: needs {nbytes / 1e9:.2f} GB but {parent} has "
            f"{free / 1e9:.2f} GB free; nothing was written: free some space or write elsewhere",
        )


_HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
_TMP_RE = re.compile(r"\.lmdx-([0-9a-f]{8})-(\d+)-[^.]*\.tmp$")


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)  # pragma: no cover - no /proc: read it by setting it back
    os.umask(mask)  # pragma: no cover
    return mask  # pragma: no cover


def output_mode(folder: bool = False) -> int:
    """The mode outputs get: that of a new file (``0o666``) or folder (``0o777``) less
    the process's umask, as ``open`` and ``mkdir`` would give them."""
    return (0o777 if folder else 0o666) & ~_umask()


def _tmp_prefix(name: str) -> str:
    return f".{name}.lmdx-{_HOST}-{os.getpid()}-"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(path: str | os.PathLike[str]) -> list[Path]:
    """Remove temporary files/folders beside ``path`` left by killed lmdx runs on this
    host (their process is gone); return what was removed."""
    path = Path(path)
    removed: list[Path] = []
    if not path.parent.is_dir():
        return removed
    for entry in path.parent.glob(f".{glob.escape(path.name)}.lmdx-*.tmp"):
        m = _TMP_RE.search(entry.name)
        if m is None or m.group(1) != _HOST or _alive(int(m.group(2))):
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)
        else:
            entry.unlink(missing_ok=True)
        removed.append(entry)
    return removed


def existing_parent(path: str | os.PathLike[str]) -> Path:
    """The nearest existing folder at or above ``path`` (where its disk space is)."""
    found = Path(path).absolute()
    while not found.exists():
        found = found.parent
    return found


@contextlib.contextmanager
def atomic_file(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it to ``path`` if the block succeeds."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path}: is a directory; give a file name")
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    fd, tmp_name = tempfile.mkstemp(prefix=_tmp_prefix(path.name), suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        os.chmod(tmp, output_mode())
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def atomic_directory(path: str | os.PathLike[str]) -> Iterator[Path]:
    """Yield an empty temporary directory beside ``path``; rename it to ``path`` on success.

    ``path`` must not exist (nothing the user has is replaced). On any error, including
    KeyboardInterrupt, the temporary directory is removed; one left by a killed process
    is removed by the next run.
    """
    path = Path(path)
    if path.exists():
        raise FileExistsError(f"{path}: already exists; choose a new output directory")
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)
    tmp = Path(tempfile.mkdtemp(prefix=_tmp_prefix(path.name), suffix=".tmp", dir=path.parent))
    try:
        os.chmod(tmp, output_mode(folder=True))
        yield tmp
        if path.exists():
            raise FileExistsError(f"{path}: appeared while writing; the output is left at {tmp}")
        os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
