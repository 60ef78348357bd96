"""The LoRA of the merged update (``lora_rank``): a merge of LoRA adapters written back as
a rank-r LoRA.

(How RegMean is solved on the adapters' low-rank structure, and why the merged update
then has rank ``Σ r_i``: :mod:`lmdx.merge.builtin.regmean`.)

**LoRA of the merged update** (``lora_rank``): the best rank-r approximation of
``W_M − W₀`` per adapted weight in the Frobenius norm (truncated SVD; from the merged
update's factors through two QR factorizations when the layer was solved low-rank), written as a
PEFT adapter folder with ``lora_alpha = r`` (scaling 1), with its relative error per layer
and overall.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._errors import MergeError
from .._tensors import as_float64
from ..files.peft import PEFT_PREFIX, write_adapter
from .source import AdapterSource, TensorSource

__all__ = [
    "LORA_DIR",
    "Factors",
    "LoraExport",
    "check_lora_export",
    "lora_errors",
    "truncated_factors",
]

#: A low-rank update ``B A`` as its factors ``(B, A)`` (``[out, in]`` orientation).
Factors = tuple[NDArray[np.float64], NDArray[np.float64]]


def truncated_factors(
    update: NDArray[np.float64] | Factors, rank: int
) -> tuple[NDArray[np.float64], NDArray[np.float64], float, float]:
    """The best rank-``rank`` approximation ``B A`` of an update (a matrix, or factors
    ``(B₀, A₀)`` of it), in the Frobenius norm (truncated SVD; of factors through QR).

    Returns ``(B, A, error, norm)``: ``B`` (d_out, rank) and ``A`` (rank, d_in) with the
    singular values split evenly (zero columns beyond the update's rank), the Frobenius
    norm of what is left out and of the whole update.
    """
    if isinstance(update, tuple):
        b0, a0 = update
        d_out, d_in = b0.shape[0], a0.shape[1]
        if b0.shape[1] == 0:
            u, s, vt = np.zeros((d_out, 0)), np.zeros(0), np.zeros((0, d_in))
        else:
            qb, rb = np.linalg.qr(b0)
            qa, ra = np.linalg.qr(a0.T)
            uc, s, vct = np.linalg.svd(rb @ ra.T)
            u, vt = qb @ uc, (qa @ vct.T).T
    else:
        d_out, d_in = update.shape
        u, s, vt = np.linalg.svd(update, full_matrices=False)
    keep = min(rank, s.size)
    root = np.sqrt(s[:keep])
    b = np.zeros((d_out, rank))
    a = np.zeros((rank, d_in))
    b[:, :keep] = u[:, :keep] * root
    a[:keep] = root[:, None] * vt[:keep]
    return b, a, float(np.sqrt(np.sum(s[keep:] ** 2))), float(np.sqrt(np.sum(s**2)))


def check_lora_export(sources: Sequence[TensorSource], rank: int) -> list[AdapterSource]:
    """The adapters of a merge that writes a rank-``rank`` LoRA (every model a LoRA adapter
    over one base; :class:`MergeError` otherwise)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise MergeError(f"lora_rank: expected a positive whole number, got {rank!r}")
    adapters = [s for s in sources if isinstance(s, AdapterSource)]
    if len(adapters) != len(sources) or any(a.base is not adapters[0].base for a in adapters):
        raise MergeError(
            "lora_rank: a LoRA of the merged update needs every model to be a LoRA adapter "
            "over one base (models[].adapter with base:)"
        )
    return adapters


class LoraExport:
    """The merged model's update from the base as a rank-``rank`` LoRA, built as the merge
    produces each tensor (:meth:`observe`, :meth:`add_update`) and written as a PEFT adapter
    folder (:meth:`write`), in float32 (float64 for a float64 base).

    Adapted weights (the union of the adapters' targets) become LoRA factors; tensors an
    adapter replaces whole (``modules_to_save``, biases, the first model's head) are
    carried whole, as PEFT saves them; every other tensor is the base's in every model and
    so in the merge.
    """

    def __init__(self, adapters: Sequence[AdapterSource], rank: int) -> None:
        self.rank = rank
        self.base = adapters[0].base
        self.targets: dict[str, Any] = {}
        self.carried: dict[str, str] = {}
        for src in adapters:
            for name, t in src.adapter.targets.items():
                self.targets.setdefault(name, t)
        modules = {t.module for t in self.targets.values()}
        for src in adapters:
            for name in src.adapter.overrides:
                module, _, param = name.rpartition(".")
                key = f"{module}.base_layer.{param}" if module in modules else name
                self.carried.setdefault(name, PEFT_PREFIX + key)
        first = adapters[0].adapter.config
        biases = [a.adapter.config.get("bias") or "none" for a in adapters]
        to_save = sorted(
            {m for a in adapters for m in a.adapter.config.get("modules_to_save") or []}
        )
        self.config = {
            "peft_type": "LORA",
            "task_type": first.get("task_type"),
            "base_model_name_or_path": first.get("base_model_name_or_path"),
            "r": rank,
            "lora_alpha": rank,
            "use_rslora": False,
            "lora_dropout": 0.0,
            "fan_in_fan_out": bool(first.get("fan_in_fan_out")),
            "init_lora_weights": True,
            "inference_mode": True,
            "target_modules": sorted(modules),
            "modules_to_save": to_save or None,
            "bias": "all"
            if "all" in biases
            else ("lora_only" if "lora_only" in biases else "none"),
        }
        # A replaced weight that is adapted too is carried whole (its LoRA left at zero).
        self.whole = sorted(set(self.targets) & set(self.carried))
        self.tensors: dict[str, NDArray[Any]] = {}
        for name in self.whole:
            t, shape = self.targets[name], self.base.shape(name)
            out, inp = shape[::-1] if t.transposed else shape
            dtype = self._dtype(name)
            self._store(t, np.zeros((out, rank), dtype), np.zeros((rank, inp), dtype))
        self.layers: dict[str, float] = {}
        self._left = 0.0
        self._total = 0.0

    def observe(self, name: str, value: Any) -> None:
        """A merged tensor (float64 for merged ones): an adapted weight's update is
        approximated, a carried tensor kept."""
        if name in self.carried:
            self.tensors[self.carried[name]] = as_float64(value, name).astype(self._dtype(name))
        elif name in self.targets:
            update = as_float64(value, name) - as_float64(self.base.read(name), name)
            self._add(name, update.T if self.targets[name].transposed else update)

    def add_update(self, name: str, factors: Factors) -> None:
        """An adapted weight's merged update as factors (``[out, in]`` orientation)."""
        if name in self.targets and name not in self.carried:
            self._add(name, factors)

    def _dtype(self, name: str) -> type[np.floating[Any]]:
        """What the adapter stores for tensor ``name``: float64 for a float64 base
        weight, else float32 (as PEFT trains adapters)."""
        return np.float64 if self.base.dtype(name) == "float64" else np.float32

    def _store(self, t: Any, b: NDArray[Any], a: NDArray[Any]) -> None:
        embedding = ("lora_embedding_B", "lora_embedding_A")
        keys = embedding if t.embedding else ("lora_B.weight", "lora_A.weight")
        self.tensors[f"{PEFT_PREFIX}{t.module}.{keys[0]}"] = b
        self.tensors[f"{PEFT_PREFIX}{t.module}.{keys[1]}"] = a

    def _add(self, name: str, update: NDArray[np.float64] | Factors) -> None:
        b, a, left, norm = truncated_factors(update, self.rank)
        self._store(self.targets[name], b.astype(self._dtype(name)), a.astype(self._dtype(name)))
        self.layers[name] = left / norm if norm > 0 else 0.0
        self._left += left**2
        self._total += norm**2

    def report(self) -> dict[str, Any]:
        """Rank, folder and relative Frobenius errors ``‖ΔW − B A‖ / ‖ΔW‖`` per adapted
        weight and over all of them (ΔW: the merged update in float64)."""
        overall = math.sqrt(self._left / self._total) if self._total > 0 else 0.0
        return {
            "rank": self.rank,
            "folder": LORA_DIR,
            "relative_error": overall,
            "layers": dict(self.layers),
            "carried": sorted(self.carried),
        }

    def write(self, folder: Path) -> dict[str, Any]:
        """Write the adapter folder ``folder / LORA_DIR``; return :meth:`report`."""
        missing = [n for n in self.targets if n not in self.layers and n not in self.carried]
        missing += [n for n, k in self.carried.items() if k not in self.tensors]
        if missing:
            raise MergeError(f"lora_rank: no merged value reached the LoRA for {missing[:3]}")
        write_adapter(folder / LORA_DIR, self.config, dict(sorted(self.tensors.items())))
        return self.report()


#: The folder of a merged model holding the LoRA of its update (``output.lora_rank``).
LORA_DIR = "lora"


def lora_errors(report: Mapping[str, Any]) -> str:
    """The LoRA's errors in words (for summaries)."""
    worst = max(report["layers"].items(), key=lambda kv: kv[1], default=("", 0.0))
    return (
        f"rank {report['rank']}: relative error {report['relative_error']:.3g} overall, "
        f"{worst[1]:.3g} at worst ({worst[0]})"
    )
