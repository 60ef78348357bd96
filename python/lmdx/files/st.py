"""sentence-transformers folders: a Hugging Face encoder plus the modules that turn its
token embeddings into a sentence embedding.

A sentence-transformers folder has ``modules.json``, a list of modules run in order
(``{"idx", "name", "path", "type"}``), of which the first is a ``Transformer``: a Hugging
Face model folder at ``path`` (``""``: the folder itself, as sentence-transformers 3 and
later save it; ``"0_Transformer"`` in older folders) with its ``sentence_bert_config.json``
(``max_seq_length``, ``do_lower_case``). The others (``1_Pooling``, ``2_Normalize``,
``2_Dense``, ...) are folders of their own settings and, for some, weights.

lmdx merges the Transformer; every other module must be the same in every model (the
same files, byte for byte) and is written unchanged beside the merged encoder, so that
``SentenceTransformer(merged_folder)`` loads it. The merged folder always has the
Transformer at its root (``modules.json`` says ``"path": ""``), so it is also a plain
Hugging Face model folder.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from .._errors import MergeError
from .parse import read_json

__all__ = [
    "MODULES_FILE",
    "ST_CONFIG",
    "SentenceTransformerFolder",
    "check_same_modules",
    "hf_model_of",
    "model_folder",
    "sentence_transformer",
]

MODULES_FILE = "modules.json"
#: The Transformer module's settings (in its folder).
ST_CONFIG = "sentence_bert_config.json"
#: The model's own settings (prompts, similarity function), in the root folder.
MODEL_CONFIG = "config_sentence_transformers.json"
#: Largest file of a module folder that is copied (a Dense layer's weights are far less).
MAX_MODULE_FILE = 2 * 10**9


@dataclass(frozen=True)
class SentenceTransformerFolder:
    """A sentence-transformers folder read from ``modules.json``.

    Attributes
    ----------
    root
        The folder.
    transformer
        The folder of its Transformer module (``root`` or a subfolder).
    modules
        The entries of ``modules.json``, in order (the Transformer first).
    """

    root: Path
    transformer: Path
    modules: tuple[dict[str, Any], ...]

    def settings(self) -> dict[str, Any]:
        """The Transformer module's ``sentence_bert_config.json`` (``{}`` without one)."""
        path = self.transformer / ST_CONFIG
        if not path.is_file():
            return {}
        value = read_json(path, "sentence-transformers configuration", MergeError)
        if not isinstance(value, dict):
            raise MergeError(f"sentence-transformers configuration {path}: expected an object")
        return value

    def max_seq_length(self) -> int | None:
        """The length texts are cut at (``max_seq_length``; None: the tokenizer's)."""
        value = self.settings().get("max_seq_length")
        return value if isinstance(value, int) and not isinstance(value, bool) else None

    def do_lower_case(self) -> bool:
        """Whether sentence-transformers lowercases texts before tokenizing them."""
        return self.settings().get("do_lower_case") is True

    def module_files(self) -> dict[str, bytes]:
        """Every file of every module but the Transformer: relative path -> contents.
        Only regular files; a symbolic link or anything else is a :class:`MergeError`."""
        out: dict[str, bytes] = {}
        for entry in self.modules[1:]:
            folder = self.root / entry["path"]
            if not entry["path"] or not os.path.lexists(folder):
                continue  # a module without settings (e.g. Normalize saved without a folder)
            if folder.is_symlink() or not folder.is_dir():
                raise MergeError(
                    f"sentence-transformers model {self.root}: module {entry['path']} is not a "
                    "folder (a symbolic link or a file); replace it by a copy"
                )
            for dirpath, dirnames, filenames in os.walk(folder):
                for name in sorted(dirnames):
                    if Path(dirpath, name).is_symlink():
                        raise MergeError(
                            f"sentence-transformers model {self.root}: {Path(dirpath, name)} is "
                            "a symbolic link; lmdx copies only regular files"
                        )
                for name in sorted(filenames):
                    path = Path(dirpath, name)
                    out[path.relative_to(self.root).as_posix()] = _read_regular(path)
        return out

    def output_files(self) -> dict[str, bytes]:
        """What a merged folder gets beside the merged Transformer: ``modules.json`` with
        the Transformer at the root, its ``sentence_bert_config.json``, the model's
        ``config_sentence_transformers.json`` and every other module's files."""
        modules = [dict(self.modules[0], path=""), *self.modules[1:]]
        out = {MODULES_FILE: (json.dumps(modules, indent=2) + "\n").encode()}
        for name, folder in ((ST_CONFIG, self.transformer), (MODEL_CONFIG, self.root)):
            if os.path.lexists(folder / name):
                out[name] = _read_regular(folder / name)
        out.update(self.module_files())
        return out


def _read_regular(path: Path) -> bytes:
    """A regular file's bytes, opened without following a symbolic link."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError as exc:
        what = "is a symbolic link" if path.is_symlink() else f"cannot be read ({exc.strerror})"
        raise MergeError(
            f"sentence-transformers model: {path} {what}; lmdx copies only regular files"
        ) from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise MergeError(f"sentence-transformers model: {path} is not a regular file")
        if info.st_size > MAX_MODULE_FILE:
            raise MergeError(f"sentence-transformers model: {path} is larger than 2 GB")
        return f.read()


def sentence_transformer(path: str | os.PathLike[str]) -> SentenceTransformerFolder | None:
    """The sentence-transformers folder at ``path`` (None where there is no
    ``modules.json``); :class:`MergeError` for a ``modules.json`` that is not one lmdx can
    merge (no Transformer first, a path leaving the folder)."""
    root = Path(path)
    file = root / MODULES_FILE
    if not file.is_file():
        return None
    where = f"sentence-transformers modules {file}"
    entries = read_json(file, "sentence-transformers modules", MergeError)
    if not isinstance(entries, list) or not entries:
        raise MergeError(f"{where}: expected a list of modules")
    for e in entries:
        if not (
            isinstance(e, dict)
            and isinstance(e.get("path"), str)
            and isinstance(e.get("type"), str)
            and isinstance(e.get("name", ""), str)
        ):
            raise MergeError(f"{where}: every module needs a path and a type (strings)")
        rel = PurePosixPath(e["path"])
        if rel.is_absolute() or ".." in rel.parts or "\\" in e["path"]:
            raise MergeError(f"{where}: module path {e['path']!r} leaves the model folder")
    first = entries[0]["type"].rsplit(".", 1)[-1]
    if first != "Transformer":
        raise MergeError(
            f"{where}: the first module is a {entries[0]['type']}; lmdx merges "
            "sentence-transformers models whose first module is a Transformer"
        )
    transformer = root / entries[0]["path"]
    if not (transformer / "config.json").is_file():
        raise MergeError(
            f"{where}: the Transformer module's folder {transformer} has no config.json"
        )
    return SentenceTransformerFolder(root, transformer, tuple(entries))


def model_folder(path: str | os.PathLike[str]) -> Path:
    """The Hugging Face model folder of ``path``: its Transformer module's folder for a
    sentence-transformers folder, else ``path`` itself."""
    st = sentence_transformer(path)
    return Path(path) if st is None else st.transformer


def check_same_modules(
    folders: Sequence[SentenceTransformerFolder | None], labels: Sequence[str]
) -> None:
    """Every model is a sentence-transformers folder with the same modules after the
    Transformer (same types, paths and files), or none is; :class:`MergeError` names the
    first difference."""
    if all(f is None for f in folders):
        return
    first = folders[0]
    for f, label in zip(folders, labels, strict=True):
        if f is None or first is None:
            odd = label if f is None else labels[0]
            raise MergeError(
                f"model {odd} is not a sentence-transformers folder (no {MODULES_FILE}) but "
                "other models are; merge models of one kind"
            )
    assert first is not None
    kinds = [(e["type"], e["path"]) for e in first.modules[1:]]
    files = first.module_files()
    for f, label in zip(folders[1:], labels[1:], strict=True):
        assert f is not None
        if [(e["type"], e["path"]) for e in f.modules[1:]] != kinds:
            raise MergeError(
                f"sentence-transformers models {labels[0]} and {label} have different modules "
                f"({MODULES_FILE}); merge models of one pipeline"
            )
        other = f.module_files()
        for name in sorted(set(files) | set(other)):
            if files.get(name) != other.get(name):
                raise MergeError(
                    f"sentence-transformers models {labels[0]} and {label} differ in {name}; "
                    "lmdx merges the Transformer and needs every other module to be the same"
                )


def hf_model_of(model: Any) -> Any:
    """The Hugging Face model of a ``SentenceTransformer`` (its first module's), else
    ``model`` itself."""
    if type(model).__module__.startswith("sentence_transformers") and hasattr(model, "__getitem__"):
        first = model[0]
        inner = getattr(first, "auto_model", None)
        if inner is None:
            raise MergeError(
                "SentenceTransformer: its first module has no Hugging Face model (auto_model)"
            )
        return inner
    return model
