"""Texts from a data file (.txt, .jsonl, .csv) or a named corpus (``corpus:NAME``)."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from .._errors import DataError
from . import corpora

__all__ = ["load_corpus", "read_data"]


def load_corpus(name: str, option: str) -> Any:
    """A corpus of :mod:`lmdx.data.corpora` by reader name; errors name ``option``."""
    if name not in corpora.CORPORA:
        raise DataError(
            f"{option}: unknown corpus {name!r}; known: {', '.join(sorted(corpora.CORPORA))} "
            f"(installed: {', '.join(corpora.available_corpora()) or 'none'})"
        )
    try:
        return getattr(corpora, name)()
    except (ImportError, FileNotFoundError) as exc:
        raise DataError(f"{option} {name}: {exc}") from exc


def read_data(
    spec: str,
    *,
    text_field: str = "text",
    label_field: str = "label",
    max_texts: int | None = None,
) -> tuple[list[str], list[Any] | None, str]:
    """Texts (and labels when present) from a file or ``corpus:NAME``; and a description."""
    labels: list[Any] | None = None
    if spec.startswith("corpus:"):
        corpus = load_corpus(spec.removeprefix("corpus:"), "DATA")
        texts, labels, source = list(corpus.texts), list(corpus.labels), corpus.source
    else:
        path = Path(spec)
        if not path.is_file():
            raise DataError(f"DATA {spec}: no such file (or use corpus:NAME)")
        source = str(path)
        if path.suffix == ".jsonl":
            texts, labels = [], []
            for i, line in enumerate(path.read_text(encoding="utf-8").splitlines()):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"DATA {spec}: line {i + 1} is not JSON ({exc})") from None
                if not isinstance(row, dict) or text_field not in row:
                    raise DataError(f"DATA {spec}: line {i + 1} has no field {text_field!r}")
                texts.append(str(row[text_field]))
                labels.append(row.get(label_field))
        elif path.suffix == ".csv":
            with open(path, newline="", encoding="utf-8") as f:
                reader = csv.DictReader(f)
                if reader.fieldnames is None or text_field not in reader.fieldnames:
                    raise DataError(f"DATA {spec}: no column {text_field!r} (--text-field)")
                rows = list(reader)
            texts = [r[text_field] for r in rows]
            labels = [r.get(label_field) for r in rows]
        else:
            texts = [t.strip() for t in path.read_text(encoding="utf-8").splitlines()]
            texts = [t for t in texts if t]
        if labels is not None and any(v is None for v in labels):
            labels = None
    if max_texts is not None:
        if max_texts < 1:
            raise DataError(f"--max-texts: must be >= 1, got {max_texts}")
        texts = texts[:max_texts]
        labels = None if labels is None else labels[:max_texts]
    if not texts:
        raise DataError(f"DATA {spec}: no texts")
    return texts, labels, source
