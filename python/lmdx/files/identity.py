"""Who a tensor file belongs to: per-tensor content hashes of a model, file hashes.

:func:`model_identity` is what a statistics file records about the model it was
collected on; :func:`describe_mismatch` says in words how two identities differ.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any

import numpy as np

from .saved import saved_state

__all__ = ["describe_mismatch", "file_sha256", "model_identity", "tensor_sha256"]


def tensor_bytes(t: Any) -> memoryview:
    """Raw bytes of a CPU tensor or array, without a copy when it is contiguous."""
    if hasattr(t, "detach"):
        import torch

        t = t.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
    return memoryview(np.ascontiguousarray(t).reshape(-1).view(np.uint8))  # type: ignore[arg-type]


def model_identity(model: Any) -> dict[str, Any]:
    """Architecture and per-parameter name, shape, dtype and SHA-256 of a model.

    ``model`` is a torch module (its tensors as ``save_pretrained`` stores them:
    :func:`lmdx.files.saved.saved_state`) or a mapping name -> tensor.
    ``weights_sha256`` hashes the per-parameter hashes in name order.
    """
    if hasattr(model, "state_dict") and not isinstance(model, Mapping):
        state = saved_state(model)
        architecture = type(model).__name__
        model_type = getattr(getattr(model, "config", None), "model_type", None)
    else:
        state = dict(model)
        architecture, model_type = "state_dict", None
    params: dict[str, Any] = {}
    total = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        dtype = str(t.dtype).removeprefix("torch.")
        h = hashlib.sha256(tensor_bytes(t)).hexdigest()
        params[name] = {"shape": list(t.shape), "dtype": dtype, "sha256": h}
        total.update(f"{name}:{dtype}:{list(t.shape)}:{h};".encode())
    return {
        "architecture": architecture,
        "model_type": model_type,
        "weights_sha256": total.hexdigest(),
        "parameters": params,
    }


def describe_mismatch(expected: Mapping[str, Any], actual: Mapping[str, Any]) -> str:
    """First difference between two :func:`model_identity` dicts, in words."""
    if expected.get("architecture") != actual.get("architecture"):
        return (
            f"architecture {expected.get('architecture')} (statistics) vs "
            f"{actual.get('architecture')} (model)"
        )
    p_exp, p_act = expected["parameters"], actual["parameters"]
    for name in sorted(set(p_exp) | set(p_act)):
        if name not in p_act:
            return f"parameter {name!r} is in the statistics' model but not in this model"
        if name not in p_exp:
            return f"parameter {name!r} is in this model but not in the statistics' model"
        a, b = p_exp[name], p_act[name]
        if a["shape"] != b["shape"]:
            return f"parameter {name!r} has shape {a['shape']} there and {b['shape']} here"
        if a["dtype"] != b["dtype"]:
            return f"parameter {name!r} has dtype {a['dtype']} there and {b['dtype']} here"
        if a["sha256"] != b["sha256"]:
            return (
                f"parameter {name!r} has different values (sha256 {a['sha256'][:12]}… there, "
                f"{b['sha256'][:12]}… here)"
            )
    return "content hashes differ"


def tensor_sha256(t: Any) -> str:
    """Hex SHA-256 of a tensor's (or array's) bytes in C order."""
    return hashlib.sha256(tensor_bytes(t)).hexdigest()


def file_sha256(path: str | os.PathLike[str], chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
