"""The statistics file format: its names, version, metadata schema and content hashes.

Version 3 (what this lmdx writes) records a BLAKE3 hash of every tensor's stored bytes
and of the metadata itself (``blake3: {tensors: {name: hex}, metadata: hex}``); a file
whose numbers or counts changed after it was written is refused when read. Version 2
files, the same with SHA-256 (``sha256: {...}``), are read and checked with SHA-256
(:mod:`lmdx.files.digest` says why BLAKE3; ``lmdx stats add OLD --out NEW`` rewrites a
version 2 file as version 3). The model identity's per-tensor hashes are BLAKE3 too, or
SHA-256 in identities an lmdx before format 3 recorded (kept as they are by such a
rewrite). Version 1 files (no hashes) are refused with a message saying to collect them
again.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Annotated, Any, Literal

import numpy as np
from numpy.typing import NDArray
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from .._errors import StatisticsFileError
from .._tensors import TORCH_OF_ST
from ..files.digest import digest, identity_digest, tensor_digest
from ..files.parse import schema_message

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "HASHES",
    "INDEX_FORMAT",
    "INDEX_NAME",
    "KINDS",
    "MAX_DIM",
    "PADDING_POLICIES",
    "check_content",
    "content_sha256",
    "metadata_hash",
    "stored_hash",
    "validate_metadata",
]

FORMAT = "lmdx-stats"
FORMAT_VERSION = 3
#: The format versions this lmdx reads, each with the hash of its content hashes (also
#: the name of the metadata entry that holds them).
HASHES = {2: "sha256", 3: "blake3"}
INDEX_FORMAT = "lmdx-stats-index"
#: The index of a sharded statistics folder (shards ``stats-00001-of-0000N.safetensors``).
INDEX_NAME = "lmdx_stats.index.json"
KINDS = ("regmean-gram", "fisher")
PADDING_POLICIES = ("excluded", "included")
#: Largest input dimension of a Gram (its packed triangle stays far within int64 bytes).
MAX_DIM = 2**24


def stored_hash(arr: NDArray[Any], version: int = FORMAT_VERSION) -> str:
    """The content hash of a statistics tensor as stored (little-endian float64, C order)
    in format ``version``: BLAKE3 (3) or SHA-256 (2)."""
    return tensor_digest(np.ascontiguousarray(arr, dtype="<f8"), HASHES[version])


def content_sha256(meta: Mapping[str, Any]) -> str:
    """The statistics' identity: SHA-256 over their content hashes (the metadata's, then
    every tensor's ``name:hash;`` in name order), the way a model's ``weights_sha256`` is
    formed from its tensors' hashes. Any change to the metadata or to a tensor changes it
    (a changed tensor also fails its own hash when read), whether the statistics are one
    file or a sharded folder; computed from the metadata alone, without reading a tensor."""
    hashes = meta[HASHES[meta["format_version"]]]
    total = hashlib.sha256(f"metadata:{hashes['metadata']};".encode())
    for name in sorted(hashes["tensors"]):
        total.update(f"{name}:{hashes['tensors'][name]};".encode())
    return total.hexdigest()


def metadata_hash(meta: Mapping[str, Any]) -> str:
    """The hash of the metadata without its content hashes (canonical JSON), with the hash
    of its ``format_version``."""
    version = meta["format_version"]
    body = {k: v for k, v in meta.items() if k != HASHES[version]}
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return digest(text.encode(), HASHES[version])


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
    # the content hash: BLAKE3, or SHA-256 in identities an lmdx before format 3 recorded
    blake3: _Sha | None = None
    sha256: _Sha | None = None

    @model_validator(mode="after")
    def _one_hash(self) -> _Parameter:
        if (self.blake3 is None) == (self.sha256 is None):
            raise ValueError("needs exactly one content hash (blake3 or sha256)")
        return self


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
    format_version: Literal[2, 3]
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
    sha256: _Hashes | None = None  # format 2
    blake3: _Hashes | None = None  # format 3


_LABELS = {
    "model": "model identity (architecture, weights_sha256, parameters) is missing or malformed",
    "sha256": "content hashes are missing or malformed",
    "blake3": "content hashes are missing or malformed",
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
    if not isinstance(version, int) or isinstance(version, bool) or version not in HASHES:
        raise fail(
            f"format version {version!r} is not supported (this lmdx reads "
            f"{' and '.join(map(str, HASHES))}; if a newer lmdx wrote it, upgrade lmdx)"
        )
    if set(HASHES.values()) & set(meta) != {HASHES[version]}:
        raise fail(
            f"content hashes are missing or malformed (format {version} keeps them in "
            f"{HASHES[version]!r})"
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
    if identity_digest(meta["model"]) == "mixed":
        raise fail("model identity mixes content hashes of different kinds (blake3, sha256)")
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
    tensor name -> hash of its stored bytes (:func:`stored_hash` in the file's version)."""
    hashes = meta[HASHES[meta["format_version"]]]
    if hashes["metadata"] != metadata_hash(meta):
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
