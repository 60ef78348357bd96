"""PEFT LoRA adapters: adapter folders read strictly and mapped onto the base model's
tensor names, what the identity of a model with an adapter is made of, and adapter folders
written.

A PEFT LoRA folder holds ``adapter_config.json`` and ``adapter_model.safetensors``, whose
tensors are named ``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight`` (and
``.lora_embedding_A`` / ``.lora_embedding_B`` for embeddings), plus whole tensors that
replace the base model's (``modules_to_save``, biases with ``bias="lora_only"`` or
``"all"``; ``.base_layer`` is dropped from their names). The adapted weight is exactly
what PEFT's ``merge_and_unload`` computes::

    W = W₀ + scaling · B A        (transposed for Conv1D and embedding weights)

with ``scaling = lora_alpha / r`` (``lora_alpha / √r`` with ``use_rslora``), ``r`` and
``lora_alpha`` per module from ``rank_pattern`` / ``alpha_pattern`` by PEFT's rule (a
pattern matches a module name ``m`` when ``m`` ends with it after a dot). LoRA variants
whose update is not that (DoRA, LoRA biases, QA-LoRA, aLoRA, layer replication, ...) and
initializations that change the base weights (PiSSA, OLoRA, CorDA, LoftQ, ...) are
refused, naming the key.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._errors import MergeError, MissingFileError
from .._tensors import as_float64
from .checkpoint import Checkpoint
from .digest import DIGEST
from .parse import read_json

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "PEFT_PREFIX",
    "LoraAdapter",
    "LoraTarget",
    "adapter_identity",
    "is_adapter_folder",
    "is_peft_model",
    "load_peft_model",
    "pattern_key",
    "peft_base_name",
    "peft_modules",
    "peft_parts",
    "write_adapter",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
#: Prefix of every tensor name in a PEFT adapter file (PeftModel.base_model.model).
PEFT_PREFIX = "base_model.model."

#: adapter_config.json keys that switch on a LoRA variant whose update is not
#: ``scaling · B A``: refused when set.
VARIANT_KEYS = (
    "use_dora",
    "lora_bias",
    "use_qalora",
    "alora_invocation_tokens",
    "layer_replication",
    "target_parameters",
    "trainable_token_indices",
    "use_bdlora",
    "velora_config",
    "monteclora_config",
    "arrow_config",
    "kasa_config",
    "megatron_config",
    "ensure_weight_tying",
)
#: Keys that do not change the adapted weights beyond what is read here (any other key,
#: from a PEFT newer than lmdx knows, is refused when set).
PLAIN_KEYS = frozenset(
    (
        "peft_type",
        "peft_version",
        "task_type",
        "base_model_name_or_path",
        "revision",
        "auto_mapping",
        "inference_mode",
        "r",
        "lora_alpha",
        "use_rslora",
        "rank_pattern",
        "alpha_pattern",
        "fan_in_fan_out",
        "target_modules",
        "exclude_modules",
        "layers_to_transform",
        "layers_pattern",
        "modules_to_save",
        "bias",
        "lora_dropout",
        "init_lora_weights",
        "megatron_core",
        "qalora_group_size",
        "loftq_config",
        "eva_config",
        "corda_config",
        "lora_ga_config",
        "runtime_config",
    )
)
#: init_lora_weights values that leave the base weights as they were (the others, e.g.
#: "pissa", "olora", "corda", "loftq", subtract from or quantize the base).
PLAIN_INITS: tuple[Any, ...] = (True, False, "gaussian", "eva", "orthogonal")
#: The configuration entries that decide the adapted weights (recorded in identities).
SCALING_KEYS = ("r", "lora_alpha", "use_rslora", "rank_pattern", "alpha_pattern", "fan_in_fan_out")

#: Tensor-name suffixes of LoRA factors: suffix -> (factor, embedding).
_FACTORS = {
    ".lora_A.weight": ("A", False),
    ".lora_B.weight": ("B", False),
    ".lora_embedding_A": ("A", True),
    ".lora_embedding_B": ("B", True),
}


def is_adapter_folder(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a PEFT adapter folder (it has ``adapter_config.json``)."""
    return (Path(path) / ADAPTER_CONFIG).is_file()


def pattern_key(patterns: Iterable[str], key: str) -> str | None:
    """The first of ``patterns`` (regular expressions) that module name ``key`` ends with
    after a dot (or equals): PEFT's rule for ``rank_pattern`` and ``alpha_pattern``."""
    for pattern in patterns:
        try:
            if re.match(rf"(.*\.)?({pattern})$", key):
                return pattern
        except re.error as exc:
            raise MergeError(f"pattern {pattern!r} is not a regular expression ({exc})") from None
    return None


def _is_set(value: Any) -> bool:
    return value not in (None, False, [], {}, "", 0)


def checked_config(config: Any, where: str) -> dict[str, Any]:
    """An adapter configuration checked to describe a plain LoRA (:class:`MergeError`
    naming the key otherwise)."""
    if not isinstance(config, dict):
        raise MergeError(f"{where}: expected a JSON object")
    if config.get("peft_type") != "LORA":
        raise MergeError(
            f"{where}: peft_type {config.get('peft_type')!r}; lmdx merges LoRA adapters "
            "(peft_type LORA) only"
        )
    for key in VARIANT_KEYS:
        if _is_set(config.get(key)):
            raise MergeError(
                f"{where}: {key} = {config[key]!r}: this LoRA variant does not update weights "
                "as scaling · B A, which is what lmdx merges; merge it with PEFT first "
                "(merge_and_unload) and merge the full models"
            )
    unknown = sorted(k for k, v in config.items() if k not in PLAIN_KEYS and k not in VARIANT_KEYS)
    unknown = [k for k in unknown if _is_set(config[k])]
    if unknown:
        raise MergeError(
            f"{where}: {unknown[0]} = {config[unknown[0]]!r} is a PEFT option lmdx does not "
            "know, and it may change the adapted weights; merge the adapter with PEFT first "
            "(merge_and_unload) and merge the full models"
        )
    init = config.get("init_lora_weights", True)
    if not any(init is p or (isinstance(p, str) and init == p) for p in PLAIN_INITS):
        raise MergeError(
            f"{where}: init_lora_weights = {init!r} changes the base model's weights, so the "
            "adapter does not apply to the base as saved; convert it to a plain LoRA (PEFT: "
            "save_pretrained(..., path_initial_model_for_weight_conversion=...))"
        )
    for key, kind in (("r", int), ("lora_alpha", (int, float))):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, kind) or not value > 0:
            raise MergeError(f"{where}: {key} must be a positive number, got {value!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        patterns = config.get(key) or {}
        if not isinstance(patterns, dict) or not all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0
            for v in patterns.values()
        ):
            raise MergeError(f"{where}: {key} must map patterns to positive numbers")
    return dict(config)


def module_scaling(config: Mapping[str, Any], module: str) -> tuple[int, float]:
    """(r, scaling) of ``module`` as PEFT sets them: ``rank_pattern`` / ``alpha_pattern``
    by :func:`pattern_key`, ``lora_alpha / r`` or ``lora_alpha / √r`` (``use_rslora``)."""
    ranks = config.get("rank_pattern") or {}
    alphas = config.get("alpha_pattern") or {}
    rk = pattern_key(ranks, module)
    ak = pattern_key(alphas, module)
    r = int(ranks[rk]) if rk is not None else int(config["r"])
    alpha = float(alphas[ak]) if ak is not None else float(config["lora_alpha"])
    return r, alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r


@dataclass(frozen=True)
class LoraTarget:
    """One adapted weight: ``weight`` (the base's name) changes by ``scaling · B A`` of
    the adapter tensors ``a`` and ``b`` (``transposed``: by its transpose, as stored for
    Conv1D and embedding weights)."""

    weight: str
    module: str
    a: str
    b: str
    rank: int
    scaling: float
    embedding: bool
    transposed: bool = False


class LoraAdapter:
    """A PEFT LoRA adapter: its checked configuration and tensors, mapped onto the names
    of the base model it adapts.

    Parameters
    ----------
    config
        The adapter configuration (``adapter_config.json``).
    tensors
        The adapter's tensors: a :class:`~lmdx.files.Checkpoint` of
        ``adapter_model.safetensors`` (or anything with ``names``, ``shape``, ``dtype``,
        ``read`` and ``digest``).
    label
        The adapter in messages (its folder).
    path
        The adapter folder, if any.

    Attributes
    ----------
    targets
        Base weight name -> :class:`LoraTarget`.
    overrides
        Base tensor name -> adapter tensor name, for tensors the adapter replaces whole
        (``modules_to_save``, trained biases, embeddings PEFT saves with their LoRA; an
        adapted weight that is replaced too is the replacement plus the update).
    """

    def __init__(
        self, config: Mapping[str, Any], tensors: Any, label: str, path: Path | None = None
    ) -> None:
        self.label = label
        self.path = path
        self.config = checked_config(dict(config), f"adapter {label}: configuration")
        self.tensors = tensors
        self.targets: dict[str, LoraTarget] = {}
        self.overrides: dict[str, str] = {}
        factors: dict[str, dict[str, str]] = {}
        kinds: dict[str, bool] = {}
        for key in tensors.names():
            if not key.startswith(PEFT_PREFIX):
                raise MergeError(
                    f"adapter {label}: tensor {key!r} is not named {PEFT_PREFIX}...; not a PEFT "
                    "adapter file"
                )
            rest = key[len(PEFT_PREFIX) :]
            for suffix, (factor, embedding) in _FACTORS.items():
                if rest.endswith(suffix):
                    module = rest[: -len(suffix)]
                    factors.setdefault(module, {})[factor] = key
                    if kinds.setdefault(module, embedding) != embedding:
                        raise MergeError(f"adapter {label}: module {module!r} mixes LoRA kinds")
                    break
            else:
                if any(p.startswith("lora_") for p in rest.split(".")):
                    raise MergeError(
                        f"adapter {label}: tensor {key!r} is not a plain LoRA factor (lora_A, "
                        "lora_B, lora_embedding_A/B); merge the adapter with PEFT first"
                    )
                self.overrides[rest.replace(".base_layer.", ".")] = key
        for module, pair in sorted(factors.items()):
            if set(pair) != {"A", "B"}:
                missing = ({"A", "B"} - set(pair)).pop()
                raise MergeError(f"adapter {label}: module {module!r} has no lora_{missing}")
            a_shape, b_shape = tensors.shape(pair["A"]), tensors.shape(pair["B"])
            if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1]:
                raise MergeError(
                    f"adapter {label}: module {module!r}: lora_A {list(a_shape)} and lora_B "
                    f"{list(b_shape)} are not factors of one rank"
                )
            r, scaling = module_scaling(self.config, module)
            if r != a_shape[0]:
                raise MergeError(
                    f"adapter {label}: module {module!r} has rank {a_shape[0]} but the "
                    f"configuration gives it r = {r}; the files are from different adapters"
                )
            weight = f"{module}.weight"
            self.targets[weight] = LoraTarget(
                weight, module, pair["A"], pair["B"], r, scaling, kinds[module]
            )

    @classmethod
    def load(cls, path: str | os.PathLike[str], label: str | None = None) -> LoraAdapter:
        """Read the adapter folder ``path`` (``adapter_config.json`` and
        ``adapter_model.safetensors``, strictly; no pickle)."""
        folder = Path(path)
        label = label or str(folder)
        if not folder.is_dir():
            raise MissingFileError(f"adapter {folder}: no such folder")
        if not (folder / ADAPTER_CONFIG).is_file():
            raise MergeError(f"adapter {folder}: no {ADAPTER_CONFIG}; not a PEFT adapter folder")
        weights = folder / ADAPTER_WEIGHTS
        if not weights.is_file():
            found = sorted(p.name for p in folder.iterdir() if p.suffix in (".bin", ".pt"))
            hint = f" (it has {found[0]}: a pickle file, which lmdx does not read)" if found else ""
            raise MergeError(f"adapter {folder}: no {ADAPTER_WEIGHTS}{hint}")
        config = read_json(folder / ADAPTER_CONFIG, "adapter configuration", MergeError)
        return cls(config, Checkpoint(weights, label), label, folder)

    def bind(self, shape: Callable[[str], tuple[int, ...]], names: Iterable[str]) -> None:
        """Check the adapter against its base model (``shape(name)`` of each of ``names``)
        and decide each target's orientation; :class:`MergeError` names what does not fit."""
        have = set(names)
        for name, key in self.overrides.items():
            if name not in have:
                raise MergeError(
                    f"adapter {self.label}: replaces {name!r}, which the base model does not "
                    "have; the adapter is for another model"
                )
            if tuple(self.tensors.shape(key)) != tuple(shape(name)):
                raise MergeError(
                    f"adapter {self.label}: {name!r} has shape {list(self.tensors.shape(key))} "
                    f"but {list(shape(name))} in the base model; the adapter is for another model"
                )
        for name, t in list(self.targets.items()):
            if name not in have:
                raise MergeError(
                    f"adapter {self.label}: adapts {t.module!r}, which the base model does not "
                    "have; the adapter is for another model"
                )
            b_rows, a_cols = self.tensors.shape(t.b)[0], self.tensors.shape(t.a)[1]
            stored = tuple(shape(name))
            if t.embedding:
                transposed = True
            elif b_rows == a_cols:
                transposed = bool(self.config.get("fan_in_fan_out"))
            else:
                transposed = stored == (a_cols, b_rows)
            expected = (a_cols, b_rows) if transposed else (b_rows, a_cols)
            if stored != expected:
                raise MergeError(
                    f"adapter {self.label}: {t.module!r}: LoRA update of shape {list(expected)} "
                    f"for a base weight of shape {list(stored)}; the adapter is for another model"
                )
            self.targets[name] = LoraTarget(**{**t.__dict__, "transposed": transposed})

    def factors(self, name: str) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """(``scaling · B``, ``A``) of target ``name`` in float64: the update is their
        product (transposed where :attr:`LoraTarget.transposed`)."""
        t = self.targets[name]
        b = as_float64(self.tensors.read(t.b), t.b) * t.scaling
        a = as_float64(self.tensors.read(t.a), t.a)
        return b, a

    def delta(self, name: str) -> NDArray[np.float64]:
        """The update of target ``name`` as stored (float64)."""
        b, a = self.factors(name)
        d = b @ a
        return np.ascontiguousarray(d.T) if self.targets[name].transposed else d

    def read_override(self, name: str) -> Any:
        """The tensor that replaces base tensor ``name``."""
        return self.tensors.read(self.overrides[name])

    def identity(self, algorithm: str = DIGEST) -> dict[str, Any]:
        """What a statistics file records of this adapter (:func:`adapter_identity`), its
        tensors hashed with ``algorithm`` (:mod:`lmdx.files.digest`)."""
        t = self.tensors
        return adapter_identity(
            self.config,
            {k: (tuple(t.shape(k)), t.dtype(k), t.digest(k, algorithm)) for k in t.names()},
            algorithm,
        )

    def total_bytes(self) -> int:
        return int(sum(self.tensors.nbytes(k) for k in self.tensors.names()))


def adapter_identity(
    config: Mapping[str, Any],
    tensors: Mapping[str, tuple[tuple[int, ...], str, str]],
    algorithm: str = DIGEST,
) -> dict[str, Any]:
    """An adapter's identity: its type, the configuration entries that decide the
    adapted weights, and every tensor's shape, dtype and content hash (``tensors``: name
    -> (shape, dtype, hash), the hash ``algorithm``'s, recorded under that name), with
    ``sha256`` (SHA-256) over all of it."""
    out: dict[str, Any] = {
        "peft_type": "LORA",
        "scaling": {k: config.get(k) for k in SCALING_KEYS},
        "tensors": {
            k: {"shape": list(shape), "dtype": dtype, algorithm: h}
            for k, (shape, dtype, h) in sorted(tensors.items())
        },
    }
    text = json.dumps(out, sort_keys=True, separators=(",", ":"))
    out["sha256"] = hashlib.sha256(text.encode()).hexdigest()
    return out


# --------------------------------------------------------------------------- in memory


def is_peft_model(model: Any) -> bool:
    """Whether ``model`` is a PEFT ``PeftModel`` (checked without importing peft)."""
    return type(model).__module__.startswith("peft.") and hasattr(model, "get_base_model")


def _active_adapter(model: Any) -> str:
    active = model.active_adapters if hasattr(model, "active_adapters") else model.active_adapter
    names = [active] if isinstance(active, str) else list(active)
    if len(names) != 1:
        raise MergeError(
            f"PEFT model: {len(names)} active adapters {names}; activate one (set_adapter)"
        )
    return str(names[0])


def peft_base_name(name: str, adapter: str) -> str | None:
    """The base model's name for a module or tensor name of a PEFT model (relative to
    its ``get_base_model()``): ``.base_layer`` and ``.modules_to_save.<adapter>`` dropped;
    None for LoRA factors, other adapters' copies and the original modules that
    ``modules_to_save`` replaces."""
    parts = name.split(".") if name else []
    if any(p.startswith("lora_") for p in parts) or "original_module" in parts:
        return None
    if "modules_to_save" in parts:
        i = parts.index("modules_to_save")
        if i + 1 >= len(parts) or parts[i + 1] != adapter:
            return None
        parts = parts[:i] + parts[i + 2 :]
    return ".".join(p for p in parts if p != "base_layer")


def peft_modules(model: Any) -> tuple[Any, Callable[[str], str | None]]:
    """The module tree of a PEFT model whose modules are named as in its base model, and
    the renaming: (``get_base_model()``, name -> base name or None)."""
    adapter = _active_adapter(model)
    _check_unmerged(model)
    return model.get_base_model(), lambda n: peft_base_name(n, adapter)


def _check_unmerged(model: Any) -> None:
    for name, module in model.named_modules():
        if getattr(module, "merged", False) and hasattr(module, "base_layer"):
            raise MergeError(
                f"PEFT model: the adapter is merged into {name!r} (merge_adapter); call "
                "unmerge_adapter() first, so the base weights are the base model's"
            )


def peft_parts(model: Any) -> tuple[Any, dict[str, Any], dict[str, Any], dict[str, Any]]:
    """A PEFT LoRA model in memory, checked (one active adapter, not merged into the base
    weights), as what its identity is made of: (the base model, its tensors under their
    own names — each as the adapter leaves it: replaced tensors are the adapter's —, the
    adapter's configuration, the adapter's tensors as PEFT saves them)."""
    from peft.utils import get_peft_model_state_dict

    adapter = _active_adapter(model)
    _check_unmerged(model)
    config = model.peft_config[adapter].to_dict()
    checked_config(config, "PEFT model: adapter configuration")
    inner = model.get_base_model()
    state: dict[str, Any] = {}
    for key, tensor in inner.state_dict().items():
        name = peft_base_name(key, adapter)
        if name is None:
            continue
        if name in state:
            raise MergeError(f"PEFT model: two tensors map to the base model's {name!r}")
        state[name] = tensor
    return inner, state, config, dict(get_peft_model_state_dict(model, adapter_name=adapter))


def load_peft_model(adapter: str | os.PathLike[str], base: Any) -> Any:
    """A PEFT model: the adapter folder ``adapter`` (read and checked by
    :meth:`LoraAdapter.load` first: a plain LoRA in ``adapter_model.safetensors``) over
    the loaded Hugging Face model ``base``, for inference."""
    from peft import PeftModel

    checked = LoraAdapter.load(adapter)
    state = base.state_dict()
    checked.bind(lambda n: tuple(state[n].shape), state)
    return PeftModel.from_pretrained(base, str(adapter), is_trainable=False).eval()


# --------------------------------------------------------------------------- writing


def write_adapter(
    folder: Path, config: Mapping[str, Any], tensors: Mapping[str, NDArray[Any]]
) -> None:
    """Write a PEFT adapter folder (``adapter_config.json``, ``adapter_model.safetensors``
    with ``tensors`` under their PEFT names) into the new folder ``folder``."""
    from .safetensors import TensorSpec, write_safetensors

    folder.mkdir()
    specs = [TensorSpec(k, v.dtype, v.shape) for k, v in tensors.items()]
    write_safetensors(folder / ADAPTER_WEIGHTS, specs, tensors.__getitem__, {"format": "pt"})
    (folder / ADAPTER_CONFIG).write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
