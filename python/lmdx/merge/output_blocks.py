"""RegMean groups too large for memory, solved in blocks of output rows.

The merged weight's output rows (the columns of ``W_Mᵀ = S⁻¹ Σ_i G̃_i W_iᵀ``) are
independent of each other given the system ``S``: a group whose K weights would not fit
is solved block by block, each block's rows read from the checkpoints alone, widened,
solved and cast to the stored dtype before the next block is read. The result equals the
whole solve's to rounding (tests/merge/test_output_blocks.py, against NumPy float64);
each block refactors the system, which costs at most a sixth of its products (a block has
at least as many rows as the layer has inputs).

Averaged tensors larger than the budget (a Llama-3.1-8B's embeddings: 128256 × 4096) are
averaged the same way, block by block of rows; an average is element-wise, so the blocks
give the whole average's numbers.

Peak memory while a group is solved is about ``(4K + 24)·d²`` bytes for the K packed
input Grams and the solver's ``d × d`` matrices, plus ``d·(K·(b + 4) + 30)`` bytes per
output row solved at once (``b``: the stored bytes per weight). The budget is
:data:`SOLVE_MEMORY_ENV` (``LMDX_SOLVE_MEMORY``, e.g. ``8GB``; default
:data:`DEFAULT_SOLVE_MEMORY`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._errors import MergeError
from .._util import parse_size
from ..files import Checkpoint
from ..stats.file import Statistics
from .methods import average_tensor, cast_merged, solve_group
from .options import MergeOptions
from .plan import Step
from .source import StateDictSource, TensorSource

__all__ = [
    "DEFAULT_SOLVE_MEMORY",
    "SOLVE_MEMORY_ENV",
    "average_in_blocks",
    "output_block_rows",
    "output_block_size",
    "solve_in_output_blocks",
    "solve_memory",
]

#: The environment variable holding the memory budget of one RegMean group's solve.
SOLVE_MEMORY_ENV = "LMDX_SOLVE_MEMORY"
#: The budget without it: 4 GB.
DEFAULT_SOLVE_MEMORY = 4 * 10**9

_STORED_BYTES = {"float64": 8, "float32": 4, "bfloat16": 2, "float16": 2}


def solve_memory() -> int:
    """The memory budget of one RegMean group's solve, in bytes."""
    text = os.environ.get(SOLVE_MEMORY_ENV)
    if not text:
        return DEFAULT_SOLVE_MEMORY
    try:
        return parse_size(text)
    except ValueError:
        raise MergeError(
            f"{SOLVE_MEMORY_ENV}={text!r}: expected a size such as 8GB or 500MB"
        ) from None


def output_block_rows(d_in: int, rows: int, k: int, stored_bytes: int, budget: int) -> int:
    """How many output rows of a RegMean group (``rows`` in all, ``d_in`` inputs, ``k``
    models, ``stored_bytes`` per stored weight) to solve at once within ``budget`` bytes:
    ``rows`` when the whole group fits, else as many as fit but at least ``d_in`` (so
    that refactoring the system stays cheap next to the block's products)."""
    fixed = (4 * k + 24) * d_in * d_in
    per_row = d_in * (k * (stored_bytes + 4) + 30)
    if fixed + per_row * rows <= budget:
        return rows
    fit = max(budget - fixed, 0) // per_row
    return int(min(rows, max(d_in, fit)))


def _rows(source: TensorSource, name: str, start: int, stop: int) -> Any:
    if isinstance(source, Checkpoint):
        return source.read_rows(name, start, stop)
    return source.read(name)[start:stop]


def output_block_size(
    step: Step, sources: Sequence[TensorSource], budget: int | None = None
) -> int | None:
    """The output rows of RegMean group ``step`` to solve at once within ``budget`` bytes
    (:func:`solve_memory` when None), or None when the group fits whole (or is not a
    ``linear`` group of checkpoints or in-memory models) and is solved the usual way."""
    if step.layout != "linear" or not all(
        isinstance(s, (Checkpoint, StateDictSource)) for s in sources
    ):
        return None
    first = sources[0]
    rows = sum(int(first.shape(w)[0]) for w in step.tensors)
    d_in = int(first.shape(step.tensors[0])[1])
    stored = max(_STORED_BYTES.get(s.dtype(w), 8) for s in sources for w in step.tensors)
    block = output_block_rows(
        d_in, rows, len(sources), stored, solve_memory() if budget is None else budget
    )
    return block if block < rows else None


def _combined(layers: list[dict[str, Any]], blocks: int) -> dict[str, Any]:
    """One module's solver report from its blocks': the least precise precision used
    (float32 over float64 over identical), the largest estimates and spreads, the solved
    blocks' factorization (the same system each time)."""
    rank = {"float32": 2, "float64": 1}
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
) -> tuple[dict[str, NDArray[Any]], dict[str, Any]]:
    """RegMean of ``step`` solved ``block`` output rows at a time (from
    :func:`output_block_size`), each block's weights read alone: the merged weights cast
    to their stored dtypes and the solver's report per module (with ``output_blocks``).
    ``grams``: the K models' input Grams as stored."""
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
        weights = [[_rows(s, w, lo, hi) for w, lo, hi in spans] for s in sources]
        solved, layers = solve_group(step.modules, weights, grams, stats, labels, options)
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


def average_in_blocks(
    name: str, sources: Sequence[TensorSource], options: MergeOptions, budget: int | None = None
) -> NDArray[Any] | None:
    """The coefficient-weighted average of tensor ``name``, cast to its stored dtype,
    computed block by block of rows within ``budget`` bytes (:func:`solve_memory` when
    None), each block's rows read alone; None when the whole average fits (or the tensor
    has fewer than two dimensions, or a source is neither a checkpoint nor in memory)."""
    first = sources[0]
    shape = tuple(int(n) for n in first.shape(name))
    if len(shape) < 2 or not all(isinstance(s, (Checkpoint, StateDictSource)) for s in sources):
        return None
    stored = max(_STORED_BYTES.get(s.dtype(name), 8) for s in sources)
    per_row = int(np.prod(shape[1:])) * (len(sources) * (stored + 4) + 8 + stored)
    budget = solve_memory() if budget is None else budget
    if per_row * shape[0] <= budget:
        return None
    block = max(1, budget // per_row)
    merged: NDArray[Any] | None = None
    for r0 in range(0, shape[0], block):
        r1 = min(shape[0], r0 + block)
        value = average_tensor(name, [_rows(s, name, r0, r1) for s in sources], options)
        part = cast_merged(name, value, first.dtype(name))
        if merged is None:
            merged = np.empty(shape, dtype=part.dtype)
        merged[r0:r1] = part
    return merged
