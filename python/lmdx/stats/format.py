"""The statistics file format: its names, version and the checks its metadata must pass."""

from __future__ import annotations

from typing import Any

from .._errors import StatisticsFileError

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "INDEX_FORMAT",
    "INDEX_NAME",
    "KINDS",
    "PADDING_POLICIES",
    "validate_metadata",
]

FORMAT = "lmdx-stats"
FORMAT_VERSION = 1
INDEX_FORMAT = "lmdx-stats-index"
#: The index of a sharded statistics folder (shards ``stats-00001-of-0000N.safetensors``).
INDEX_NAME = "lmdx_stats.index.json"
KINDS = ("regmean-gram", "fisher")
PADDING_POLICIES = ("excluded", "included")


def validate_metadata(meta: Any, where: str) -> None:
    def fail(msg: str) -> None:
        raise StatisticsFileError(f"{where}: {msg}")

    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        fail("not an lmdx statistics file (format field missing or foreign)")
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION or version < 1:
        fail(f"format version {version!r} is not supported (this lmdx reads 1..{FORMAT_VERSION})")
    if meta.get("kind") not in KINDS:
        fail(f"kind {meta.get('kind')!r} is not one of {KINDS}")
    model = meta.get("model")
    if not isinstance(model, dict) or not {"weights_sha256", "parameters"} <= set(model):
        fail("model identity (weights_sha256, parameters) missing")
    if meta["kind"] == "regmean-gram":
        if meta.get("padding") not in PADDING_POLICIES:
            fail(f"padding policy {meta.get('padding')!r} is not one of {PADDING_POLICIES}")
        groups, modules = meta.get("groups"), meta.get("modules")
        if not isinstance(groups, dict) or not isinstance(modules, dict):
            fail("groups/modules tables missing")
        for g, v in groups.items():
            if not isinstance(v, dict) or not isinstance(v.get("dim"), int) or v["dim"] < 1:
                fail(f"group {g!r}: bad dimension")
            if not isinstance(v.get("count"), (int, float)) or v["count"] < 0:
                fail(f"group {g!r}: bad count")
        for m, v in modules.items():
            if not isinstance(v, dict) or v.get("group") not in groups:
                fail(f"module {m!r}: refers to an unknown group")
            if v.get("layout") not in ("linear", "conv1d"):
                fail(f"module {m!r}: unknown layout {v.get('layout')!r}")
    else:
        if not isinstance(meta.get("parameters"), dict):
            fail("parameters table missing")
        if not isinstance(meta.get("count"), (int, float)) or meta["count"] < 0:
            fail("bad example count")
