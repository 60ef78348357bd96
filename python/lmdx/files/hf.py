"""Hugging Face model folders: loading one, its backbone, the files beside its weights."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .._errors import MergeError

__all__ = ["TOKENIZER_FILES", "base_model_info", "copy_model_files", "hf_progress", "load_model"]

#: Files copied from the first model's folder so the output loads with its tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
)


def load_model(path: str | os.PathLike[str], *, dtype: Any = None, progress: bool = True) -> Any:
    """Load a Hugging Face model folder with the class named in its ``config.json``."""
    import transformers

    path = Path(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise MergeError(f"model {path}: no config.json; expected a save_pretrained folder")
    try:
        cfg = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as exc:
        raise MergeError(f"model {path}: config.json is not valid JSON ({exc})") from None
    archs = cfg.get("architectures") or []
    cls = getattr(transformers, archs[0], None) if archs else None
    if cls is None:
        cls = transformers.AutoModel
    kwargs: dict[str, Any] = {"dtype": dtype} if dtype is not None else {}
    with hf_progress(progress):
        return cls.from_pretrained(str(path), **kwargs)


@contextlib.contextmanager
def hf_progress(enabled: bool) -> Iterator[None]:
    """Hide transformers' own progress bars (loading, saving) unless ``enabled``."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    if not enabled and was:
        hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    try:
        yield
    finally:
        if not enabled and was:
            hf_logging.enable_progress_bar()  # type: ignore[no-untyped-call]


def base_model_info(config: Mapping[str, Any]) -> tuple[str, str | None]:
    """(prefix of the backbone's parameters, class name of the backbone)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    archs = config.get("architectures") or []
    cls = getattr(transformers, archs[0], None) if archs else None
    prefix = getattr(cls, "base_model_prefix", "") if cls is not None else ""
    base = MODEL_MAPPING_NAMES.get(str(config.get("model_type")))
    if isinstance(base, (list, tuple)):
        base = base[0]
    return str(prefix), None if base is None else str(base)


def copy_model_files(src: Path, dest: Path) -> None:
    """Copy the tokenizer and generation files of model folder ``src`` into ``dest``."""
    for fname in (*TOKENIZER_FILES, "generation_config.json"):
        path = src / fname
        if path.is_file():
            shutil.copy2(path, dest / fname)
