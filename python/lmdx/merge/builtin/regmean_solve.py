"""One RegMean group solved: whole, or in blocks of output rows when its weights would
not fit the merge's memory budget; and the memory model of a RegMean solve.

:func:`solve_group` solves ``W_Mᵀ = (Σ c_i G̃_i)⁻¹ Σ c_i G̃_i W_iᵀ`` with
``G̃_i = α·G_i/n_i + (1−α)·diag(G_i/n_i)`` for the modules of one group (modules that
share an input Gram, q/k/v, in one system: one factorization) with the native
:func:`lmdx.regmean_merge_layer`.

The merged weight's output rows (the columns of ``W_Mᵀ = S⁻¹ Σ_i G̃_i W_iᵀ``) are
independent of each other given the system ``S``: a group whose K weights would not fit
is solved block by block (:func:`solve_in_output_blocks`), each block's rows read from the
checkpoints alone, widened, solved and cast to the stored dtype before the next block is
read. The result equals the whole solve's to rounding (tests/merge/test_output_blocks.py,
against NumPy float64); each block refactors the system, which costs at most a sixth of
its products (a block has at least as many rows as the layer has inputs).

Peak memory while a group is solved (:func:`group_memory`, the one memory model of a
RegMean solve: the blocks here, the dry run's estimate and the memory a Ray task asks
for) is about ``(4K + 20)·d²`` bytes (``(4K + 24)·d²`` at K = 3 on the float32 path) for
the K packed input Grams and the solver's ``d × d`` matrices, plus
``d·(K·(b + 8) + 20 + b)`` bytes per output row solved at once (``b``: the stored bytes
per weight; the float32 path, 16-bit weights). The budget is the
merge's ``solve_memory`` option (:func:`lmdx.merge.options.solve_memory_budget`: default
``LMDX_SOLVE_MEMORY`` or 4 GB).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Annotated, Any, get_args

import numpy as np
from numpy.typing import NDArray
from pydantic import Field

from ..._errors import MergeError
from ..._tensors import as_tensor_array, itemsize
from ...files import Checkpoint
from ...regmean import PRECISION_DESCRIPTION, SolvePrecision, regmean_merge_layer
from ...stats.file import Statistics
from ..method import NoOptions, Step, StepSizes, cast_merged
from ..options import MergeOptions
from ..source import StateDictSource, TensorSource, read_rows
from .regmean_prior import PriorSystem

__all__ = [
    "GRAM_ROUNDOFF",
    "SolveOptions",
    "group_memory",
    "noise_floor",
    "output_block_rows",
    "output_block_size",
    "regmean_memory",
    "solve_group",
    "solve_in_output_blocks",
    "solve_precision",
    "solve_report",
]

_IGNORED = "ignored"  # given to a method that solves nothing: accepted, no effect


class SolveOptions(NoOptions):
    """RegMean's α and how its systems are solved (see :func:`lmdx.regmean_merge_layer`),
    shared by ``regmean`` and ``regmean_plusplus``."""

    alpha: Annotated[
        float,
        Field(
            ge=0.0,
            le=1.0,
            description="off-diagonal scaling of the Grams in [0, 1] (the paper uses 0.9 "
            "for transformers)",
            json_schema_extra={"label": "must be in [0, 1]", "elsewhere": _IGNORED},
        ),
    ] = 1.0
    ridge: Annotated[
        float,
        Field(
            ge=0.0,
            description="relative ridge added to every system",
            json_schema_extra={"label": "must be a number >= 0", "elsewhere": _IGNORED},
        ),
    ] = 0.0
    allow_regularization: Annotated[
        bool,
        Field(
            description="whether the solver may raise the ridge of a system that is not "
            "positive definite",
            json_schema_extra={"label": "must be true or false", "elsewhere": _IGNORED},
        ),
    ] = True
    precision: Annotated[
        SolvePrecision,
        Field(
            description=PRECISION_DESCRIPTION,
            json_schema_extra={
                "label": "must be one of " + ", ".join(get_args(SolvePrecision)),
                "elsewhere": _IGNORED,
            },
        ),
    ] = "auto"


#: Relative rounding of a Gram's entries for each statistics accumulation precision
#: (``Statistics.accumulation``): float32 products summed in float64 ("mixed" by lmdx's
#: kernel, "torch-float32" by torch on the collecting device), or float64 throughout.
#: Statistics that record none are taken as exact.
GRAM_ROUNDOFF = {"torch-float32": 2.0**-24, "mixed": 2.0**-24, "float64": 2.0**-53}


def noise_floor(stats: Sequence[Statistics]) -> float:
    """The RegMean solves' ``noise_floor``: the coarsest accumulation precision of
    ``stats`` (see :func:`lmdx.regmean_merge_layer`)."""
    return max(GRAM_ROUNDOFF.get(str(s.accumulation), 0.0) for s in stats)


def solve_group(
    members: Sequence[str],
    weights: Sequence[Sequence[Any]],
    grams: Sequence[NDArray[np.float64]],
    stats: Sequence[Statistics],
    labels: Sequence[str],
    options: MergeOptions,
    prior: PriorSystem | None = None,
) -> tuple[dict[str, NDArray[np.float64]], dict[str, Any]]:
    """RegMean of one group: ``weights[i]`` are model i's weights of ``members``,
    ``grams[i]`` its input Gram as :meth:`Statistics.gram_stored` returns it; ``prior``:
    the anchor as a (K + 1)-th model (:mod:`lmdx.merge.builtin.regmean_prior`).

    Returns weight name -> merged float64 weight, and module name -> the solver's
    information (ridge used, attempts, which module's input it shares).
    """
    layout = stats[0].modules[members[0]]["layout"]
    axis = 0 if layout == "linear" else 1
    weights_k = []
    sizes: list[int] = []
    for ws in weights:
        arrays = [as_tensor_array(w, f"{m}.weight") for m, w in zip(members, ws, strict=True)]
        sizes = [int(a.shape[axis]) for a in arrays]
        weights_k.append(np.concatenate(arrays, axis=axis) if len(arrays) > 1 else arrays[0])
        del arrays
    counts = [s.rows_seen(members[0], label) for s, label in zip(stats, labels, strict=True)]
    name = (
        members[0] if len(members) == 1 else f"{members[0]} (+{len(members) - 1} sharing its input)"
    )
    own = options.own(SolveOptions)
    dim = int(weights_k[0].shape[1 - axis])  # the layer's input dimension
    grams_k, coefficients, named = list(grams), options.coefficients, list(labels)
    if prior is not None:  # one more model: Gram Λ over one row, coefficient 1
        grams_k.append(prior.gram)
        weights_k.append(prior.weight)
        coefficients = (*(coefficients or (1.0,) * len(grams)), 1.0)
        named.append("the prior")
    try:
        res = regmean_merge_layer(
            grams_k,
            weights_k,
            [*counts, 1.0] if prior is not None else counts,
            alpha=own.alpha,
            coefficients=coefficients,
            layout=layout,
            precision=own.precision,
            noise_floor=noise_floor(stats),
            ridge=own.ridge,
            allow_regularization=own.allow_regularization,
            name=name,
            n_threads=options.threads,
        )
    except ValueError as exc:  # the core's input checks: one MergeError naming the model
        raise MergeError(_named(str(exc), named)) from None
    del weights_k
    solved = {
        **solve_report(res.info),
        "relative_spread": float(res.info.relative_spread),
        "rows": min(counts),
        "dim": dim,
    }
    if prior is not None:
        solved["prior_strength"] = prior.strength
    out = {}
    layers = {}
    start = 0
    for m, size in zip(members, sizes, strict=True):
        part = slice(start, start + size)
        out[stats[0].modules[m]["weight"]] = res.weight[part] if axis == 0 else res.weight[:, part]
        start += size
        layers[m] = {**solved, "shared_with": members[0] if m != members[0] else None}
    return out, layers


def solve_precision(options: MergeOptions) -> str:
    """The ``precision`` of a merge's RegMean solves."""
    return options.own(SolveOptions).precision


_CHUNK = 1024  # outputs per chunk of the core's float64 deviations


def group_memory(
    d_in: int,
    rows: int,
    k: int,
    stored: int,
    *,
    packed: bool = True,
    members: int = 1,
    out: int | None = None,
    float32: bool = True,
) -> int:
    """Bytes while ``rows`` output rows of a RegMean group are solved (``d_in`` inputs,
    ``k`` models, ``stored`` bytes per stored weight, ``members`` weights joined): per
    model its rows read (+ float32 widenings of 16-bit ones, + the members joined) and its
    input Gram (a packed triangle from a file, else a full matrix); the core's ``d × d``
    buffers (the summed system and its factor; on the float32 path, which
    ``float32=False``, precision float64, never takes, its float32 factor and the Gram
    differences in float32: both at K = 3, from K = 4 one block of rows at a time) and
    per output row the float64 average, the deviations in chunks of 1024 outputs (the
    float32 path: all K − 1 in float32), the result and its copy out of the core; the
    cast result (``out`` bytes per weight, default ``stored``). Measured
    (``regmean_merge_layer``, d_in 2048, 64 output rows): 15–18 d² bytes above the inputs
    in either precision at K = 2–8, 22 d² on the float32 path at K = 3. Not counted: the
    matrices the core keeps between layers (at most 1 GiB, :func:`lmdx.release_memory`),
    which a layer that falls back from float32 to float64 also holds while it solves."""
    n = d_in * rows
    per_weight = stored + (4 if stored < 4 else 0) + (4 if members > 1 else 0)
    gram = 4 * d_in * (d_in + 1) if packed else 8 * d_in * d_in
    square = 24 if float32 and k == 3 else 20  # K = 3: both differences held at once
    per_output = 24 + (4 * (k - 1) if float32 else 0)
    core = square * d_in * d_in + per_output * n + 8 * d_in * min(_CHUNK, max(rows, 1))
    return k * (per_weight * n + gram) + core + (stored if out is None else out) * n


def regmean_memory(
    step: Step, sizes: StepSizes, rows: int | None = None, precision: str = "auto"
) -> int:
    """:func:`group_memory` of RegMean group ``step`` (its sizes from the plan), solved
    ``rows`` output rows at a time (None: whole) at ``precision``."""
    d = step.dim
    total = max(sizes.n // max(d, 1), 1)
    return group_memory(
        d,
        total if rows is None else rows,
        sizes.k,
        max(sizes.read // max(sizes.n, 1), 1),
        packed=sizes.packed,
        members=len(step.tensors),
        out=sizes.out // max(sizes.n, 1),
        float32=precision != "float64",
    )


def _named(message: str, labels: Sequence[str]) -> str:
    """The core's message with its argument indices (``grams[1]``) said as the models'
    labels (``the Gram of bbc``)."""
    nouns = {"grams": "the Gram", "weights": "the weight", "counts": "the row count"}
    return re.sub(
        r"\b(grams|weights|counts)\[(\d+)\]",
        lambda m: f"{nouns[m.group(1)]} of {labels[int(m.group(2))]}",
        message,
    )


def output_block_rows(
    d_in: int,
    rows: int,
    k: int,
    stored_bytes: int,
    budget: int,
    members: int = 1,
    precision: str = "auto",
) -> int:
    """How many output rows of a RegMean group (``rows`` in all, ``d_in`` inputs, ``k``
    models, ``stored_bytes`` per stored weight, Grams from files, solved at
    ``precision``) to solve at once within ``budget`` bytes (:func:`group_memory`):
    ``rows`` when the whole group fits, else as many as fit but at least ``d_in`` (so
    that refactoring the system stays cheap next to the block's products)."""

    def memory(r: int) -> int:
        return group_memory(
            d_in, r, k, stored_bytes, members=members, float32=precision != "float64"
        )

    if memory(rows) <= budget:
        return rows
    lo, hi = 0, rows  # memory(lo) <= budget or lo == 0; memory(hi) > budget
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if memory(mid) <= budget else (lo, mid)
    return int(min(rows, max(d_in, lo)))


def output_block_size(
    step: Step, sources: Sequence[TensorSource], options: MergeOptions
) -> int | None:
    """The output rows of RegMean group ``step`` to solve at once within the merge's
    ``solve_memory`` (at its ``precision``), or None when the group fits whole (or is not
    a ``linear`` group of checkpoints or in-memory models) and is solved the usual way."""
    if step.layout != "linear" or not all(
        isinstance(s, (Checkpoint, StateDictSource)) for s in sources
    ):
        return None
    first = sources[0]
    rows = sum(int(first.shape(w)[0]) for w in step.tensors)
    d_in = int(first.shape(step.tensors[0])[1])
    stored = max(itemsize(s.dtype(w)) for s in sources for w in step.tensors)
    block = output_block_rows(
        d_in,
        rows,
        len(sources),
        stored,
        options.solve_memory,
        len(step.tensors),
        solve_precision(options),
    )
    return block if block < rows else None


def _combined(layers: list[dict[str, Any]], blocks: int) -> dict[str, Any]:
    """One module's solver report from its blocks': the least precise precision used
    (float32 over float32-rhs over float64 over identical), the largest estimates and
    spreads, the solved blocks' factorization (the same system each time)."""
    rank = {"float32": 3, "float32-rhs": 2, "float64": 1}
    out = dict(max(layers, key=lambda info: rank.get(str(info["precision"]), 0)))
    for key in ("output_error_estimate", "relative_spread", "unseen_directions", "attempts"):
        out[key] = max(info[key] for info in layers)
    out["output_blocks"] = blocks
    return out


def solve_in_output_blocks(
    step: Step,
    sources: Sequence[TensorSource],
    stats: Sequence[Statistics],
    grams: Sequence[NDArray[np.float64]],
    labels: Sequence[str],
    options: MergeOptions,
    block: int,
    prior: PriorSystem | None = None,
) -> tuple[dict[str, NDArray[Any]], dict[str, Any]]:
    """RegMean of ``step`` solved ``block`` output rows at a time (from
    :func:`output_block_size`), each block's weights read alone: the merged weights cast
    to their stored dtypes and the solver's report per module (with ``output_blocks``).
    ``grams``: the K models' input Grams as stored; ``prior``: the anchor's system (its
    rows taken block by block)."""
    first = sources[0]
    starts = np.cumsum([0] + [int(first.shape(w)[0]) for w in step.tensors]).tolist()
    merged: dict[str, NDArray[Any]] = {}
    parts: dict[str, list[dict[str, Any]]] = {m: [] for m in step.modules}
    n_blocks = 0
    for r0 in range(0, starts[-1], block):
        r1 = min(starts[-1], r0 + block)
        spans = [
            (w, min(max(r0 - a, 0), b - a), min(max(r1 - a, 0), b - a))
            for w, a, b in zip(step.tensors, starts[:-1], starts[1:], strict=True)
        ]
        weights = [[read_rows(s, w, lo, hi) for w, lo, hi in spans] for s in sources]
        part_prior = None if prior is None else prior.rows(r0, r1)
        solved, layers = solve_group(
            step.modules, weights, grams, stats, labels, options, part_prior
        )
        del weights
        for w, lo, hi in spans:
            if hi > lo:
                part = cast_merged(w, solved[w], first.dtype(w))
                if w not in merged:
                    merged[w] = np.empty(first.shape(w), dtype=part.dtype)
                merged[w][lo:hi] = part
        for m, info in layers.items():
            parts[m].append(info)
        n_blocks += 1
    return merged, {m: _combined(infos, n_blocks) for m, infos in parts.items()}


def solve_report(info: Any) -> dict[str, Any]:
    """A RegMean solve's report entries from the core's ``info``: the ridge it ended with,
    its attempts, the precision chosen and the certificate's estimates."""
    return {
        "ridge": float(info.ridge),
        "attempts": int(info.attempts),
        "precision": str(info.precision),
        "rcond_estimate": float(info.rcond_estimate),
        "condition_estimate": float(info.condition_estimate),
        "output_error_estimate": float(info.output_error_estimate),
        "unseen_directions": int(info.unseen_directions),
    }
