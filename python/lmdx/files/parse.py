"""JSON and YAML documents received from other people, parsed strictly.

Every JSON or YAML text lmdx reads (safetensors headers, statistics metadata and
indexes, checkpoint indexes and configurations, merge configurations) goes through
:func:`parse_json` / :func:`read_json` / :func:`read_yaml`: whatever is wrong with it
(bytes that are not UTF-8, a syntax error, nesting deep enough to exhaust the parser's
stack, a number too long to convert, a key given twice, ``NaN``/``Infinity``, a YAML
alias) becomes one ``error`` naming the file and what is wrong. Typed documents are then
checked by a pydantic schema; :func:`schema_message` turns its first complaint into one
line.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pydantic import ConfigDict

__all__ = [
    "MAX_DOCUMENT_BYTES",
    "STRICT",
    "parse_json",
    "read_json",
    "read_text",
    "read_yaml",
    "schema_message",
]

#: Largest configuration, index or metadata document read (bytes): far above any real
#: one, far below what would exhaust memory once parsed.
MAX_DOCUMENT_BYTES = 64 * 10**6

#: The model configuration of every schema lmdx checks documents and options with: types
#: as given (no ``true`` for 1, no ``"3"`` for 3), unknown keys refused, nothing infinite.
STRICT: ConfigDict = {"strict": True, "extra": "forbid", "allow_inf_nan": False}


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} is given twice")
        out[key] = value
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(
    data: bytes | str, where: str, error: type[Exception], *, allow_nonfinite: bool = False
) -> Any:
    """The JSON value in ``data``, or ``error(f"{where} is not ...")`` saying why not.

    Keys given twice are refused; so are ``NaN`` and ``Infinity`` unless
    ``allow_nonfinite`` (Hugging Face configurations may hold them).
    """
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as exc:
        raise error(f"{where} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    try:
        return json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_constant=None if allow_nonfinite else _no_constant,
        )
    except RecursionError:
        raise error(f"{where} is not valid JSON (nested too deeply)") from None
    except ValueError as exc:  # JSONDecodeError, key twice, int too long, NaN
        raise error(f"{where} is not valid JSON ({exc})") from None


def read_text(path: Path, what: str, error: type[Exception]) -> str:
    """A UTF-8 text file of at most :data:`MAX_DOCUMENT_BYTES`; ``error`` names it."""
    try:
        size = path.stat().st_size
        if size > MAX_DOCUMENT_BYTES:
            raise error(f"{what} {path}: {size} bytes, more than any {what} lmdx reads")
        raw = path.read_bytes()
    except OSError as exc:
        raise error(f"{what} {path}: cannot be read ({exc.strerror or exc})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise error(f"{what} {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def read_json(
    path: str | os.PathLike[str],
    what: str,
    error: type[Exception],
    *,
    allow_nonfinite: bool = False,
) -> Any:
    """The JSON value in file ``path`` (``what`` names it in messages)."""
    path = Path(path)
    return parse_json(
        read_text(path, what, error), f"{what} {path}", error, allow_nonfinite=allow_nonfinite
    )


def read_yaml(path: str | os.PathLike[str], what: str, error: type[Exception]) -> Any:
    """The YAML value in file ``path``, loaded with PyYAML's safe loader; aliases
    (``*name``, which let a small file expand to gigabytes) are refused."""
    import yaml

    class NoAliasLoader(yaml.SafeLoader):  # type: ignore[misc]
        def compose_node(self, parent: Any, index: Any) -> Any:
            if self.check_event(yaml.AliasEvent):
                mark = self.peek_event().start_mark
                raise yaml.YAMLError(
                    f"aliases (*name) are not allowed (line {mark.line + 1}); write the value out"
                )
            return super().compose_node(parent, index)

    path = Path(path)
    stream = io.StringIO(read_text(path, what, error))
    stream.name = path.name  # PyYAML's messages name the file, not "<unicode string>"
    try:
        return yaml.load(stream, Loader=NoAliasLoader)  # a SafeLoader subclass
    except RecursionError:
        raise error(f"{what} {path}: cannot parse (nested too deeply)") from None
    except (yaml.YAMLError, ValueError) as exc:
        detail = " ".join(str(exc).split())
        raise error(f"{what} {path}: cannot parse ({detail})") from None


def _key(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def schema_message(exc: Any, labels: Mapping[str, str] | None = None) -> str:
    """One line from a pydantic ``ValidationError``: its first complaint as ``KEY: what
    is wrong, got VALUE`` (``labels`` replace a complaint's message by its key)."""
    err = exc.errors(include_url=False)[0]
    loc = tuple(p for p in err["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    key = _key(loc) or "document"
    msg = str(err["msg"]).removeprefix("Value error, ")
    if labels and key in labels:
        msg = labels[key]
    value = err.get("input")
    shown = repr(value)
    if len(shown) > 60:
        shown = shown[:57] + "..."
    return f"{key} {msg[0].lower()}{msg[1:]}, got {shown}"
