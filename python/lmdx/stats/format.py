"""The statistics file format: its names, version, metadata schema and content hashes.

Version 2 (this lmdx) records a SHA-256 of every tensor's stored bytes and of the
metadata itself (``sha256: {tensors: {name: hex}, metadata: hex}``); a file whose
numbers or counts changed after it was written is refused when read. Version 1 files
(no hashes) are refused with a message saying to collect them again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from .._errors import StatisticsFileError
from .._tensors import TORCH_OF_ST
from ..files.identity import tensor_sha256
from ..files.parse import schema_message

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "INDEX_FORMAT",
    "INDEX_NAME",
    "KINDS",
    "MAX_DIM",
    "PADDING_POLICIES",
    "check_content",
    "content_sha256",
    "metadata_sha256",
    "stored_sha256",
    "validate_metadata",
]

FORMAT = "lmdx-stats"
FORMAT_VERSION = 2
INDEX_FORMAT = "lmdx-stats-index"
#: The index of a sharded statistics folder (shards ``stats-00001-of-0000N.safetensors``).
INDEX_NAME = "lmdx_stats.index.json"
KINDS = ("regmean-gram", "fisher")
PADDING_POLICIES = ("excluded", "included")
#: Largest input dimension of a Gram (its packed triangle stays far within int64 bytes).
MAX_DIM = 2**24


def stored_sha256(arr: NDArray[Any]) -> str:
    """SHA-256 of a statistics tensor as stored: little-endian float64, C order."""
    return tensor_sha256(np.ascontiguousarray(arr, dtype="<f8"))


def content_sha256(meta: Mapping[str, Any]) -> str:
    """The statistics' identity: SHA-256 over their content hashes (the metadata's, then
    every tensor's ``name:hash;`` in name order), the way a model's ``weights_sha256`` is
    formed from its tensors' hashes. Any change to the metadata or to a tensor changes it
    (a changed tensor also fails its own hash when read), whether the statistics are one
    file or a sharded folder; computed from the metadata alone, without reading a tensor."""
    hashes = meta["sha256"]
    total = hashlib.sha256(f"metadata:{hashes['metadata']};".encode())
    for name in sorted(hashes["tensors"]):
        total.update(f"{name}:{hashes['tensors'][name]};".encode())
    return total.hexdigest()


def metadata_sha256(meta: Mapping[str, Any]) -> str:
    """SHA-256 of the metadata without its ``sha256`` entry (canonical JSON)."""
    body = {k: v for k, v in meta.items() if k != "sha256"}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False)


_Sha = Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
_Size = Annotated[int, Field(ge=0, le=2**63 - 1)]
_Dim = Annotated[int, Field(ge=1, le=MAX_DIM)]
_Count = Annotated[float, Field(ge=0.0)]
_TorchDtype = Literal[tuple(TORCH_OF_ST.values())]  # type: ignore[valid-type]  # the table's


class _Parameter(_Strict):
    shape: list[_Size]
    dtype: _TorchDtype  # type: ignore[valid-type]
    sha256: _Sha


class _Adapter(_Strict):
    peft_type: Literal["LORA"]
    scaling: dict[str, Any]
    tensors: dict[str, _Parameter]
    sha256: _Sha


class _Identity(_Strict):
    architecture: str
    model_type: str | None = None
    weights_sha256: _Sha
    parameters: dict[str, _Parameter]
    adapter: _Adapter | None = None  # a base model with a PEFT LoRA adapter


class _Module(_Strict):
    group: str
    layout: Literal["linear", "conv1d"]
    weight: str
    dim: _Dim


class _Group(_Strict):
    dim: _Dim
    count: _Count


class _FisherParameter(_Strict):
    shape: list[_Size]


class _Hashes(_Strict):
    tensors: dict[str, _Sha]
    metadata: _Sha


class _Metadata(_Strict):
    format: Literal["lmdx-stats"]
    format_version: Literal[2]
    lmdx_version: str
    kind: Literal["regmean-gram", "fisher"]
    dtype: Literal["float64"]
    data: str
    model: _Identity
    extra: dict[str, Any]
    padding: Literal["excluded", "included"] | None = None
    modules: dict[str, _Module] | None = None
    groups: dict[str, _Group] | None = None
    count: _Count | None = None
    parameters: dict[str, _FisherParameter] | None = None
    sha256: _Hashes


_LABELS = {
    "model": "model identity (architecture, weights_sha256, parameters) is missing or malformed",
    "sha256": "content hashes are missing or malformed",
}


def validate_metadata(meta: Any, where: str) -> None:
    """Check statistics metadata (a parsed JSON object) against the format's schema and
    its own content hash; :class:`StatisticsFileError` names ``where`` and the field."""

    def fail(msg: str) -> StatisticsFileError:
        return StatisticsFileError(f"{where}: {msg}")

    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise fail("not an lmdx statistics file (format field missing or foreign)")
    version = meta.get("format_version")
    if version == 1:
        raise fail(
            "format version 1 (written by an lmdx before statistics had content hashes) is "
            "no longer read; collect the statistics again with this lmdx (lmdx stats MODEL "
            "DATA --out FILE)"
        )
    if not isinstance(version, int) or isinstance(version, bool) or version != FORMAT_VERSION:
        raise fail(
            f"format version {version!r} is not supported (this lmdx reads {FORMAT_VERSION})"
        )
    if meta.get("kind") not in KINDS:
        raise fail(f"kind {meta.get('kind')!r} is not one of {KINDS}")
    model = meta.get("model")
    if not isinstance(model, dict) or not {"weights_sha256", "parameters"} <= set(model):
        raise fail("model identity (weights_sha256, parameters) missing")
    if meta["kind"] == "regmean-gram" and meta.get("padding") not in PADDING_POLICIES:
        raise fail(f"padding policy {meta.get('padding')!r} is not one of {PADDING_POLICIES}")
    try:
        checked = _Metadata.model_validate(meta)
    except ValidationError as exc:
        raise fail(f"metadata field {schema_message(exc, _LABELS)}") from None
    if checked.kind == "regmean-gram":
        if checked.groups is None or checked.modules is None:
            raise fail("groups/modules tables missing")
        for m, v in checked.modules.items():
            group = checked.groups.get(v.group)
            if group is None:
                raise fail(f"module {m!r}: refers to an unknown group {v.group!r}")
    elif checked.parameters is None or checked.count is None:
        raise fail("parameters table or example count missing")


def check_content(meta: Mapping[str, Any], names: set[str], where: str) -> dict[str, str]:
    """Verify the metadata's own hash and that every tensor in ``names`` has one; return
    tensor name -> SHA-256 of its stored bytes."""
    hashes = meta["sha256"]
    if hashes["metadata"] != metadata_sha256(meta):
        raise StatisticsFileError(
            f"{where}: the metadata (counts, shapes, identity) does not match its content "
            "hash; the file was corrupted or edited after it was written: get an intact copy"
        )
    tensors: dict[str, str] = hashes["tensors"]
    if set(tensors) != names:
        odd = sorted(set(tensors) ^ names)[0]
        raise StatisticsFileError(
            f"{where}: content hashes do not list exactly the file's tensors (e.g. {odd!r})"
        )
    return dict(tensors)
