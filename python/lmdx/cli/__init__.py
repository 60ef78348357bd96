"""The ``lmdx`` command line (``lmdx info | stats | merge | decompose``)."""

from __future__ import annotations

from .main import main

__all__ = ["main"]
