"""Statistics of disjoint data shards added into the statistics of their union."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from numpy.typing import NDArray

from .._errors import StatisticsFileError
from ..files.identity import check_same_model
from .file import Statistics, coarsest_accumulation

__all__ = ["add_statistics"]


def _same(field: str, values: Sequence[Any], names: Sequence[str]) -> None:
    for v, n in zip(values[1:], names[1:], strict=True):
        if v != values[0]:
            raise StatisticsFileError(
                f"cannot add statistics: {field} differs between {names[0]} and {n}"
            )


def add_statistics(parts: Iterable[Statistics], *, data: str | None = None) -> Statistics:
    """Statistics of the union of disjoint data shards: counts, sums and Grams add.

    All parts must be of one kind, one model (same weights hash), one padding policy and
    one module/group layout. Tensors are summed lazily when read or saved (one group at a
    time), so adding large files does not hold them all in memory. Grams keep the
    coarsest accumulation of their parts (``"torch-float32"`` if any part is, else
    ``"mixed"`` if any part is), so that a merge
    from the sum knows the same noise floor as a merge from the parts.
    """
    parts = list(parts)
    if not parts:
        raise StatisticsFileError("add_statistics: nothing to add")
    names = [p.source or f"statistics #{i}" for i, p in enumerate(parts)]
    _same("kind", [p.kind for p in parts], names)
    for p, n in zip(parts[1:], names[1:], strict=True):
        check_same_model("add", parts[0].model, p.model, (names[0], n))
    first = parts[0]

    def summed(name: str) -> Callable[[], NDArray[Any]]:
        def read() -> NDArray[Any]:
            total = np.array(parts[0].packed(name), dtype=np.float64)
            for p in parts[1:]:
                total += p.packed(name)
            return total

        return read

    kwargs: dict[str, Any] = {}
    if first.kind == "regmean-gram":
        _same("padding policy", [p.padding for p in parts], names)
        _same("module layout", [p.modules for p in parts], names)
        _same(
            "group dimensions", [{g: v["dim"] for g, v in p.groups.items()} for p in parts], names
        )
        kwargs["padding"] = first.padding
        kwargs["modules"] = first.modules
        kwargs["groups"] = {
            g: {"dim": v["dim"], "count": sum(p.group_count(g) for p in parts)}
            for g, v in first.groups.items()
        }
    else:
        _same("parameter set", [p.parameters for p in parts], names)
        kwargs["parameters"] = first.parameters
        kwargs["count"] = sum(p.count() for p in parts)
    extra: dict[str, Any] = {"added_from": names}
    not_solved = {n: why for p in parts for n, why in p.not_solved.items()}
    if not_solved:  # what no part could collect stays said
        extra["not_solved"] = not_solved
    accumulation = coarsest_accumulation(parts) if first.kind == "regmean-gram" else None
    if accumulation is not None:  # the sum is as coarse as its coarsest part
        extra["accumulation"] = accumulation
    if "experts" in first.extra:
        extra["experts"] = first.extra["experts"]
    return first.rebuilt(
        {spec.name: summed(spec.name) for spec in first.specs()},
        data=data if data is not None else " + ".join(p.data for p in parts),
        extra=extra,
        **kwargs,
    )
