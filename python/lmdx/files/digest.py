"""Content hashes of tensors and bytes: what ties a statistics file to its model and to
its own numbers.

lmdx records BLAKE3 (:data:`DIGEST`): as strong as SHA-256 and about 4x its speed on one
core, which matters because every merge hashes every tensor of every model (to check the
statistics belong to them) and every Gram it reads. Statistics written by an lmdx before
statistics format 3 hold SHA-256 hashes, which are still checked (:data:`DIGESTS`). Both
functions release the GIL while hashing, so threads hash in parallel.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Any, Protocol

import blake3
import numpy as np

__all__ = [
    "DIGEST",
    "DIGESTS",
    "Hasher",
    "digest",
    "hasher",
    "identity_digest",
    "tensor_bytes",
    "tensor_digest",
]

#: The hash lmdx records of a tensor's contents.
DIGEST = "blake3"
#: The hashes lmdx checks: its own, and SHA-256 (statistics of format 2 and earlier).
DIGESTS = ("blake3", "sha256")


class Hasher(Protocol):
    def update(self, data: Any, /) -> Any: ...

    def hexdigest(self) -> str: ...


def hasher(algorithm: str = DIGEST) -> Hasher:
    """A fresh incremental hash (``update`` then ``hexdigest``) of ``algorithm``."""
    if algorithm == "blake3":
        return blake3.blake3()  # type: ignore[no-any-return]
    if algorithm == "sha256":
        return hashlib.sha256()
    raise ValueError(f"unknown content hash {algorithm!r} (lmdx knows {DIGESTS})")


def digest(data: Any, algorithm: str = DIGEST) -> str:
    """Hex hash of a bytes-like object (any contiguous buffer) with ``algorithm``."""
    h = hasher(algorithm)
    h.update(data)
    return h.hexdigest()


def tensor_bytes(t: Any) -> memoryview:
    """Raw bytes of a CPU tensor or array, without a copy when it is contiguous."""
    if hasattr(t, "detach"):
        import torch

        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return memoryview(np.ascontiguousarray(t).reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def tensor_digest(t: Any, algorithm: str = DIGEST) -> str:
    """Hex hash of a tensor's (or array's) bytes in C order."""
    return digest(tensor_bytes(t), algorithm)


def identity_digest(identity: Mapping[str, Any]) -> str | None:
    """The hash a model identity's per-tensor entries hold (the entry key they share:
    ``"blake3"``, or ``"sha256"`` in identities an lmdx before format 3 recorded); None
    where it has no entries, ``"mixed"`` where they do not share one."""
    entries = list((identity.get("parameters") or {}).values())
    adapter = identity.get("adapter")
    if adapter:
        entries += list((adapter.get("tensors") or {}).values())
    if not entries:
        return None
    for algorithm in DIGESTS:
        if all(isinstance(e, Mapping) and algorithm in e for e in entries):
            return algorithm
    return "mixed"
