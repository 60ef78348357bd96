"""Every error and warning lmdx raises (a leaf module: it imports nothing from lmdx).

All errors derive from :class:`LmdxError`, so ``except lmdx.LmdxError`` catches any of
them; each also keeps the built-in base users caught before (``ValueError``,
``OSError``), so existing handlers keep working.
"""

from __future__ import annotations

__all__ = [
    "CliError",
    "DataError",
    "DiskFullError",
    "LmdxError",
    "MergeError",
    "MissingFileError",
    "MissingStatisticsError",
    "ModelMismatchError",
    "NotPositiveDefiniteError",
    "RayClusterError",
    "RegularizationWarning",
    "SampleSizeWarning",
    "StatisticsFileError",
]


class LmdxError(Exception):
    """Base of every lmdx error. The message names the file, tensor, layer or argument
    at fault and says what to do."""


class NotPositiveDefiniteError(LmdxError, ValueError):
    """A system could not be factored: not positive definite and regularization forbidden
    or exhausted. The message names the system (e.g. the layer) and the failing pivot."""


class StatisticsFileError(LmdxError, ValueError):
    """A statistics file is unreadable, truncated, foreign or inconsistent."""


class MissingStatisticsError(StatisticsFileError, KeyError):
    """A statistics file has no statistics for a module or parameter that is asked for
    (the message names the file and the module)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class ModelMismatchError(LmdxError, ValueError):
    """Statistics were computed on a different model than the one they are used with."""


class MergeError(LmdxError, ValueError):
    """The models, statistics or options cannot be merged as asked (message says why)."""


class DataError(LmdxError, ValueError):
    """A data file or corpus cannot be read as texts (the message names it)."""


class DiskFullError(LmdxError, OSError):
    """No space left for an output file; nothing was written (the message says where)."""


class MissingFileError(LmdxError, FileNotFoundError):
    """An input file or folder does not exist (the message names it)."""

    def __str__(self) -> str:  # OSError would prefix an errno
        return str(self.args[0]) if self.args else ""


class RayClusterError(LmdxError, ConnectionError):
    """A Ray cluster cannot be reached, or lost work that no node could take over, or a
    worker died twice; nothing was written (the message names the address or the work)."""


class CliError(LmdxError):
    """A problem with a command's arguments; the CLI prints it without a traceback."""


class RegularizationWarning(UserWarning):
    """The solver had to raise the ridge above the requested one to factor a system."""


class SampleSizeWarning(UserWarning):
    """Too few train rows for the basis dimension: in-sample R² is optimistic."""
