"""LoRA adapters in a merge: RegMean solved on their low-rank structure, and the merged
update written back as a rank-r LoRA.

**RegMean of K adapters over one base** ``W_i = W₀ + B_i A_i`` (``B_i`` with PEFT's
scaling, ``[out, in]`` orientation). lmdx solves RegMean for the deviation from the
coefficient-weighted average ``W̄ = W₀ + D̄``, ``D̄ = Σ c_i B_i A_i / C`` (``C = Σ c_i``)::

    W_Mᵀ = W̄ᵀ + (S̃ + λI)⁻¹ Σ c_i G̃_i (B_i A_i − D̄)ᵀ,     S̃ = Σ c_i G̃_i

(:func:`lmdx.regmean_merge_layer`). With ``S = S̃ + λI`` and ``S⁻¹S̃ = I − λS⁻¹`` this is
exactly ``W₀ᵀ + S⁻¹ [Σ c_i G̃_i A_iᵀ B_iᵀ + λ D̄ᵀ]``, so the merged update is itself of
rank ``R = Σ r_i``::

    W_M − W₀ = [B_1 … B_K] Fᵀ,   F = S⁻¹ [U_1 … U_K] + λ S⁻¹ [c_1 A_1ᵀ/C … c_K A_Kᵀ/C],
    U_i = c_i G̃_i A_iᵀ = (c_i / n_i) (α G_i A_iᵀ + (1 − α) diag(G_i) A_iᵀ)

The products ``G_i A_iᵀ`` cost ``O(d_in² r_i)`` instead of the dense right-hand side's
``O(d_in² d_out)`` per model. ``F`` comes from the native core
(:func:`lmdx.regmean.regmean_low_rank_solve`: the Grams reduced by α with the helper the
dense merge uses, the same Cholesky, ridge and escalation, so ``λ`` is the ridge it used,
with ``2R`` right-hand sides). Weights equal in every model come back as they are
(``precision: identical``).

**LoRA of the merged update** (``lora_rank``): the best rank-r approximation of
``W_M − W₀`` per adapted weight in the Frobenius norm (truncated SVD; from the factors
above through two QR factorizations when the layer was solved low-rank), written as a
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
from ..regmean import regmean_low_rank_solve
from ..stats.file import Statistics
from .options import MergeOptions
from .plan import Step
from .source import AdapterSource, TensorSource

__all__ = [
    "LoraExport",
    "check_lora_export",
    "low_rank_inputs",
    "regmean_low_rank",
    "solve_group_low_rank",
    "truncated_factors",
]

Factors = tuple[NDArray[np.float64], NDArray[np.float64]]


def regmean_low_rank(
    grams: Sequence[NDArray[np.float64]],
    counts: Sequence[float],
    base: NDArray[np.float64],
    factors: Sequence[Factors],
    *,
    alpha: float = 1.0,
    coefficients: Sequence[float] | None = None,
    ridge: float = 0.0,
    allow_regularization: bool = True,
    name: str = "layer",
    n_threads: int | None = None,
) -> tuple[NDArray[np.float64], Factors, dict[str, Any]]:
    """RegMean of one layer of K low-rank updates of one base weight.

    Parameters
    ----------
    grams
        K input Grams ``G_i = Σ x xᵀ``, full (d_in, d_in) or packed upper triangles.
    counts
        K row counts ``n_i``.
    base
        ``W₀``, shape (d_out, d_in).
    factors
        K pairs ``(B_i, A_i)``, shapes (d_out, r_i) and (r_i, d_in): model i's weight is
        ``W₀ + B_i A_i`` (``r_i = 0``: the base itself).
    alpha, coefficients, ridge, allow_regularization, name, n_threads
        As in :func:`lmdx.regmean_merge_layer`.

    Returns
    -------
    (merged, (B, A), info)
        The merged weight ``W₀ + B A`` (float64, (d_out, d_in)); the factors of its update
        (rank ``Σ r_i``; rank 0 for identical weights); the solver's information (``ridge``,
        ``attempts``, ``precision``, ``rcond_estimate``, ``condition_estimate`` (0: not
        estimated), ``relative_spread``, ``rank``).
    """
    k = len(grams)
    if not (len(counts) == len(factors) == k):
        raise ValueError(f"{name}: need one Gram, count and pair of factors per model")
    coef = [1.0] * k if coefficients is None else [float(c) for c in coefficients]
    total = sum(coef)
    used = [i for i in range(k) if coef[i] > 0]
    # The average W̄ = W₀ + D̄ and the spread max_i max |B_i A_i − D̄| / max |W̄|, as the
    # dense merge reports them (in place: these are the path's only dense passes).
    pivot = max(used, key=lambda i: coef[i])  # D̄ = D_p + Σ_{i≠p} (c_i/C)(D_i − D_p): D_p
    pivot_delta = factors[pivot][0] @ factors[pivot][1]  # exactly where all agree
    mean_delta = pivot_delta.copy()
    for i in used:
        if i != pivot:
            work = factors[i][0] @ factors[i][1]
            work -= pivot_delta
            work *= coef[i] / total
            mean_delta += work
    del pivot_delta
    spread = 0.0
    for i in used:
        work = factors[i][0] @ factors[i][1]
        work -= mean_delta
        spread = max(spread, float(np.abs(work, out=work).max(initial=0.0)))
    del work
    merged_mean = mean_delta
    merged_mean += base
    scale = float(np.abs(merged_mean).max(initial=0.0))
    info: dict[str, Any] = {
        "relative_spread": spread / scale if scale > 0 else (math.inf if spread > 0 else 0.0),
        "rank": 0,
    }
    if spread == 0.0:  # equal in every model: nothing to solve, W̄ = W₀ + B_p A_p
        info.update(ridge=0.0, attempts=0, precision="identical")
        info.update(rcond_estimate=1.0, condition_estimate=1.0, rank=factors[used[0]][1].shape[0])
        return merged_mean, factors[used[0]], info
    del merged_mean
    b_parts = [factors[i][0] for i in used if factors[i][1].shape[0] > 0]
    f, solved = regmean_low_rank_solve(
        grams,
        [factors[i][1] for i in range(k)],
        counts,
        alpha=alpha,
        coefficients=coef,
        ridge=ridge,
        allow_regularization=allow_regularization,
        name=name,
        n_threads=n_threads,
    )
    rank = f.shape[1]
    b_all = np.concatenate(b_parts, axis=1)
    merged = b_all @ f.T
    merged += base
    info.update(
        ridge=float(solved.ridge),
        attempts=int(solved.attempts),
        precision="float64",
        rcond_estimate=float(solved.rcond_estimate),
        condition_estimate=0.0,
        rank=rank,
    )
    return merged, (b_all, np.ascontiguousarray(f.T)), info


# --------------------------------------------------------------------------- the merge step


def low_rank_inputs(step: Step, sources: Sequence[TensorSource]) -> list[list[Factors]] | None:
    """Per model, per member of RegMean group ``step``, the factors of its update over the
    one base every model adapts; None unless every model is a LoRA adapter over the same
    base whose update of every member is low-rank (not a replaced weight)."""
    if not sources or not all(isinstance(s, AdapterSource) for s in sources):
        return None
    adapters = [s for s in sources if isinstance(s, AdapterSource)]
    if any(s.base is not adapters[0].base for s in adapters):
        return None
    out = []
    for src in adapters:
        per_member = []
        for w in step.tensors:
            f = src.low_rank(w, step.layout)
            if f is None:
                return None
            per_member.append(f)
        out.append(per_member)
    return out


def solve_group_low_rank(
    step: Step,
    sources: Sequence[TensorSource],
    factors: Sequence[Sequence[Factors]],
    stats: Sequence[Statistics],
    labels: Sequence[str],
    options: MergeOptions,
) -> tuple[dict[str, NDArray[np.float64]], dict[str, Factors], dict[str, Any]]:
    """RegMean of one group of LoRA-adapted weights (:func:`regmean_low_rank`; members that
    share an input are joined along their outputs: ``B`` block-diagonal, ``A`` stacked).

    Returns weight name -> merged float64 weight (as stored), weight name -> factors of its
    update (``[out, in]`` orientation) and module name -> the solver's information."""
    assert isinstance(sources[0], AdapterSource)
    base_source = sources[0].base
    conv1d = step.layout == "conv1d"
    bases = []
    for w in step.tensors:
        b0 = as_float64(base_source.read(w), w)
        bases.append(b0.T if conv1d else b0)
    sizes = [b.shape[0] for b in bases]
    base = np.concatenate(bases, axis=0) if len(bases) > 1 else bases[0]
    joined = []
    for per_member in factors:
        a = np.concatenate([a for _, a in per_member], axis=0)
        b = np.zeros((sum(sizes), a.shape[0]))
        row = col = 0
        for (bm, am), size in zip(per_member, sizes, strict=True):
            b[row : row + size, col : col + am.shape[0]] = bm
            row, col = row + size, col + am.shape[0]
        joined.append((b, a))
    counts = [s.count(step.modules[0]) for s in stats]
    for i, n in enumerate(counts):
        if n <= 0:
            raise MergeError(f"statistics of {labels[i]}: module {step.modules[0]!r} saw no rows")
    members = step.modules
    name = (
        members[0] if len(members) == 1 else f"{members[0]} (+{len(members) - 1} sharing its input)"
    )
    merged, (b_all, a_all), info = regmean_low_rank(
        [s.gram_stored(members[0]) for s in stats],
        counts,
        base,
        joined,
        alpha=options.alpha,
        coefficients=options.coefficients,
        ridge=options.ridge,
        allow_regularization=options.allow_regularization,
        name=name,
        n_threads=options.n_threads,
    )
    solved = {
        **{k: info[k] for k in ("ridge", "attempts", "precision", "rcond_estimate")},
        "condition_estimate": info["condition_estimate"],
        "output_error_estimate": 0.0,  # float64 solves (see lmdx.regmean_merge_layer)
        "relative_spread": info["relative_spread"],
        "rows": min(counts),
        "dim": int(base.shape[1]),
        "low_rank": int(info["rank"]),
    }
    out, updates, layers = {}, {}, {}
    row = 0
    for m, w, size in zip(members, step.tensors, sizes, strict=True):
        part = merged[row : row + size]
        out[w] = np.ascontiguousarray(part.T) if conv1d else part
        updates[w] = (b_all[row : row + size], a_all)
        row += size
        layers[m] = {**solved, "shared_with": members[0] if m != members[0] else None}
    return out, updates, layers


# --------------------------------------------------------------------------- LoRA export


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
