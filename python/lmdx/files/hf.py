"""Hugging Face model folders: loading one, its backbone, the files beside its weights."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from .._errors import MergeError
from .parse import read_json
from .st import model_folder

__all__ = [
    "TOKENIZER_FILES",
    "base_model_info",
    "copy_model_files",
    "hf_config",
    "hf_progress",
    "load_model",
    "may_hold_conv1d",
    "model_class",
    "model_files",
    "read_config",
]

#: Files copied from the first model's folder so the output loads with its tokenizer (or
#: image processor).
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
    "preprocessor_config.json",
)


def load_model(path: str | os.PathLike[str], *, dtype: Any = None, progress: bool = True) -> Any:
    """Load a Hugging Face model folder with the class named in its ``config.json`` (of a
    sentence-transformers folder: its Transformer module's model)."""
    path = model_folder(path)
    cls = model_class(read_config(path))
    kwargs: dict[str, Any] = {"dtype": dtype} if dtype is not None else {}
    with hf_progress(progress):
        return cls.from_pretrained(str(path), **kwargs)


def read_config(path: Path) -> dict[str, Any]:
    """The ``config.json`` of model folder ``path``, checked to be an object whose
    ``architectures`` (if any) is a list of class names (:class:`MergeError` otherwise)."""
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise MergeError(f"model {path}: no config.json; expected a save_pretrained folder")
    cfg = read_json(cfg_path, "model configuration", MergeError, allow_nonfinite=True)
    archs = (cfg.get("architectures") if isinstance(cfg, dict) else None) or []
    if not isinstance(cfg, dict) or (
        not isinstance(archs, list) or not all(isinstance(a, str) for a in archs)
    ):
        raise MergeError(
            f"model configuration {cfg_path}: architectures is not a list of class names"
        )
    return cfg


def model_class(config: Mapping[str, Any]) -> Any:
    """The transformers class a configuration names first in ``architectures``
    (``AutoModel`` where it names none that transformers has)."""
    import transformers

    archs = config.get("architectures") or []
    cls = getattr(transformers, archs[0], None) if archs else None
    return transformers.AutoModel if cls is None else cls


def hf_config(config: Mapping[str, Any], where: str) -> Any:
    """A configuration dict (``config.json``'s contents) as the transformers configuration
    object of its ``model_type``; :class:`MergeError` naming ``where`` for a type
    transformers does not know."""
    import transformers

    try:
        config_class = transformers.CONFIG_MAPPING[str(config.get("model_type"))]
    except KeyError:
        raise MergeError(
            f"model configuration {where}: model_type {config.get('model_type')!r} is not one "
            "transformers knows"
        ) from None
    return config_class.from_dict(dict(config))


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


def may_hold_conv1d(config: Mapping[str, Any]) -> bool:
    """Whether a model of ``config`` may hold Hugging Face ``Conv1D`` layers (weights stored
    ``[in, out]``): False when transformers' modeling files of its ``model_type`` never name
    ``Conv1D`` (read as text: neither transformers nor torch is imported, which takes
    seconds); True when they do, and whenever it cannot be told (no model type, code of its
    own through ``auto_map``, a type transformers has no folder for)."""
    model_type = str(config.get("model_type") or "")
    spec = importlib.util.find_spec("transformers")
    if not model_type or config.get("auto_map") or spec is None:
        return True
    folders = [Path(p) / "models" / model_type.replace("-", "_")
               for p in spec.submodule_search_locations or ()]  # fmt: skip
    files = [f for folder in folders for f in folder.glob("modeling_*.py")]
    if not files:
        return True
    return any("Conv1D" in f.read_text(encoding="utf-8", errors="replace") for f in files)


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


def model_files(src: Path) -> list[str]:
    """The tokenizer and generation files of model folder ``src`` that a merge copies.

    A symbolic link among them (which could carry a file from outside the folder into
    an output that is then published) is refused with a :class:`MergeError` naming it,
    and so is anything else that is not a regular file (a FIFO, a device)."""
    found = []
    for fname in (*TOKENIZER_FILES, "generation_config.json"):
        path = src / fname
        if not os.path.lexists(path):
            continue
        if path.is_symlink():
            raise MergeError(
                f"model {src}: {fname} is a symbolic link (to {os.readlink(path)}); lmdx copies "
                "only regular files of the model folder into the output: replace the link by "
                "a copy of the file you mean to publish"
            )
        if not path.is_file():
            raise MergeError(f"model {src}: {fname} is not a regular file")
        found.append(fname)
    return found


def copy_model_files(src: Path, dest: Path) -> None:
    """Copy the tokenizer and generation files of model folder ``src`` into ``dest``:
    only regular files (:func:`model_files`), opened without following links. Copies are
    new files (the mode of any file the user creates), not copies of the source's mode.
    """
    for fname in model_files(src):
        try:
            fd = os.open(src / fname, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        except OSError as exc:
            raise MergeError(f"model {src}: {fname} cannot be read ({exc.strerror})") from None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise MergeError(f"model {src}: {fname} is not a regular file")
            with open(dest / fname, "xb") as out:
                shutil.copyfileobj(f, out)
