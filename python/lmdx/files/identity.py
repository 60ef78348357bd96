"""Who a tensor file belongs to: per-tensor content hashes of a model, file hashes.

:func:`model_identity` is what a statistics file records about the model it was
collected on; :func:`describe_mismatch` says in words how two identities differ. The
per-tensor hashes are :mod:`lmdx.files.digest`'s (BLAKE3; SHA-256 in identities an lmdx
before statistics format 3 recorded); the identity's own ``weights_sha256`` is SHA-256
over them.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any

from .._errors import ModelMismatchError
from .digest import DIGEST, identity_digest, tensor_digest
from .peft import adapter_identity, is_peft_model, peft_parts
from .saved import saved_state

__all__ = [
    "check_same_model",
    "describe_mismatch",
    "file_sha256",
    "model_identity",
    "state_identity",
]


def model_identity(model: Any, algorithm: str = DIGEST) -> dict[str, Any]:
    """Architecture and per-parameter name, shape, dtype and content hash of a model.

    ``model`` is a torch module (its tensors as ``save_pretrained`` stores them:
    :func:`lmdx.files.saved.saved_state`) or a mapping name -> tensor. Each parameter's
    hash is ``algorithm``'s (:mod:`lmdx.files.digest`: BLAKE3 unless an older identity
    is to be reproduced), under that name; ``weights_sha256`` is SHA-256 over the
    per-parameter hashes in name order. A PEFT LoRA model is its base model's tensors
    under their own names (each as the adapter leaves it) plus its adapter
    (:func:`lmdx.files.peft.adapter_identity` of the tensors PEFT saves), with
    ``weights_sha256`` over both.
    """
    if is_peft_model(model):
        inner, state, config, saved = peft_parts(model)
        ident = state_identity(
            state, type(inner).__name__, getattr(inner.config, "model_type", None), algorithm
        )
        ident["adapter"] = adapter_identity(
            config,
            {
                k: (
                    tuple(t.shape),
                    str(t.dtype).removeprefix("torch."),
                    tensor_digest(t, algorithm),
                )
                for k, t in saved.items()
            },
            algorithm,
        )
        combined = f"{ident['weights_sha256']}:{ident['adapter']['sha256']}"
        ident["weights_sha256"] = hashlib.sha256(combined.encode()).hexdigest()
        return ident
    if hasattr(model, "state_dict") and not isinstance(model, Mapping):
        model_type = getattr(getattr(model, "config", None), "model_type", None)
        return state_identity(saved_state(model), type(model).__name__, model_type, algorithm)
    return state_identity(dict(model), "state_dict", None, algorithm)


def state_identity(
    state: Mapping[str, Any],
    architecture: str,
    model_type: str | None,
    algorithm: str = DIGEST,
) -> dict[str, Any]:
    """:func:`model_identity` of the tensors ``state`` (name -> tensor) of a model of class
    ``architecture``."""
    params: dict[str, Any] = {}
    total = hashlib.sha256()
    for name in sorted(state):
        t = state[name]
        dtype = str(t.dtype).removeprefix("torch.")
        h = tensor_digest(t, algorithm)
        params[name] = {"shape": list(t.shape), "dtype": dtype, algorithm: h}
        total.update(f"{name}:{dtype}:{list(t.shape)}:{h};".encode())
    return {
        "architecture": architecture,
        "model_type": model_type,
        "weights_sha256": total.hexdigest(),
        "parameters": params,
    }


def _hash_kinds_differ(expected: Mapping[str, Any], actual: Mapping[str, Any]) -> str | None:
    """Why two identities cannot be compared tensor by tensor (their per-tensor hashes are
    of different kinds), or None."""
    hashed, here = identity_digest(expected), identity_digest(actual)
    if hashed is None or here is None or hashed == here:
        return None
    return (
        f"their model identities hold different content hashes ({hashed} there, {here} "
        "here; an lmdx before statistics format 3 recorded sha256): collect the older "
        "statistics again with this lmdx"
    )


def check_same_model(
    action: str, first: Mapping[str, Any], other: Mapping[str, Any], names: tuple[str, str]
) -> None:
    """Raise :class:`ModelMismatchError` (``"cannot {action} ..."``, naming ``names``)
    unless identities ``first`` and ``other`` are of one model."""
    if first.get("weights_sha256") == other.get("weights_sha256"):
        return
    kinds = _hash_kinds_differ(first, other)
    if kinds is not None:
        raise ModelMismatchError(f"cannot {action} {names[0]} and {names[1]}: {kinds}")
    raise ModelMismatchError(
        f"cannot {action} statistics of different models: {names[0]} vs {names[1]}: "
        f"{describe_mismatch(first, other)}"
    )


def describe_mismatch(expected: Mapping[str, Any], actual: Mapping[str, Any]) -> str:
    """First difference between two :func:`model_identity` dicts, in words."""
    kinds = _hash_kinds_differ(expected, actual)
    if kinds is not None:
        return kinds
    key = identity_digest(expected) or identity_digest(actual) or DIGEST
    if expected.get("architecture") != actual.get("architecture"):
        return (
            f"architecture {expected.get('architecture')} (statistics) vs "
            f"{actual.get('architecture')} (model)"
        )
    ad_exp, ad_act = expected.get("adapter"), actual.get("adapter")
    if ad_exp is None and ad_act is not None:
        return "the statistics' model has no adapter; this model is a base with a LoRA adapter"
    if ad_exp is not None and ad_act is None:
        return "the statistics' model is a base with a LoRA adapter; this model has none"
    if ad_exp is not None and ad_act is not None and ad_exp["sha256"] != ad_act["sha256"]:
        return _adapter_mismatch(ad_exp, ad_act)
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
        if a.get(key) != b.get(key):
            return (
                f"parameter {name!r} has different values ({key} {str(a.get(key))[:12]}… "
                f"there, {str(b.get(key))[:12]}… here)"
            )
    return "content hashes differ"


def _adapter_mismatch(expected: Mapping[str, Any], actual: Mapping[str, Any]) -> str:
    """First difference between two LoRA adapter identities, in words."""
    if expected["scaling"] != actual["scaling"]:
        return (
            f"the LoRA adapters differ in their scaling ({expected['scaling']} there, "
            f"{actual['scaling']} here)"
        )
    t_exp, t_act = expected["tensors"], actual["tensors"]
    for name in sorted(set(t_exp) | set(t_act)):
        if t_exp.get(name) != t_act.get(name):
            return f"the LoRA adapters differ in tensor {name!r}"
    return "the LoRA adapters differ"


def file_sha256(path: str | os.PathLike[str], chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of a file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
