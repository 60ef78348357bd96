"""Statistics of one model collected in parts over disjoint modules, used as one.

A Llama-3.1-8B statistics file holds ≈ 33 GB of float64 Gram triangles (≈ 26 GB of them
the 14336-wide ``down_proj`` inputs). A contributor can collect it in parts, each a file
of its own (``lmdx stats --include 'model.layers.*.mlp.down_proj'``, then ``--exclude``
the same), store and send them one at a time, and the merge reads the parts of one model
as one set of statistics, group by group, with nothing rounded: the numbers are the
float64 ones a single collection writes (the same activations and the same additions).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from numpy.typing import NDArray

from .._errors import StatisticsFileError
from ..files.identity import check_same_model
from .file import Statistics, coarsest_accumulation

__all__ = ["join_statistics"]


def join_statistics(parts: Iterable[Statistics]) -> Statistics:
    """RegMean statistics of one model on one data set, collected in ``parts`` over
    disjoint modules, as one :class:`Statistics`.

    Each group's tensors are read from the part holding them when asked for (and checked
    against that file's hashes): nothing is copied, added or held. The parts must be of
    one model (same weights hash), one data description and one padding policy, and no
    module or input group may be in two parts. ``accumulation`` is the coarsest of the
    parts' (the merge's noise floor follows it); ``extra["joined_from"]`` names them, and
    :attr:`~Statistics.files` are the parts' files where every part is read from files.
    ``save`` writes the joined statistics as one file or folder, one group at a time.
    """
    parts = list(parts)
    if not parts:
        raise StatisticsFileError("join_statistics: no statistics to join")
    names = [p.source or f"statistics #{i}" for i, p in enumerate(parts)]
    first = parts[0]
    for p, n in zip(parts, names, strict=True):
        if p.kind != "regmean-gram":
            raise StatisticsFileError(
                f"cannot join {n}: it holds {p.kind} statistics; only RegMean Grams join"
            )
        check_same_model("join", first.model, p.model, (names[0], n))
        for field, value, want in (
            ("data", p.data, first.data),
            ("padding policy", p.padding, first.padding),
        ):
            if value != want:
                raise StatisticsFileError(
                    f"cannot join {names[0]} and {n}: their {field} differs ({want!r} vs "
                    f"{value!r}); collect every part with the same data options"
                )
    modules: dict[str, dict[str, Any]] = {}
    groups: dict[str, dict[str, Any]] = {}
    owner: dict[str, str] = {}
    tensors: dict[str, Callable[[], NDArray[Any]]] = {}
    for p, n in zip(parts, names, strict=True):
        for m, info in p.modules.items():
            if m in modules:
                raise StatisticsFileError(
                    f"cannot join: module {m!r} is in {owner[m]} and in {n}; collect the "
                    "parts over disjoint modules (--include / --exclude)"
                )
            modules[m], owner[m] = dict(info), n
        for g, info in p.groups.items():
            if g in groups:
                raise StatisticsFileError(
                    f"cannot join: input group {g!r} is in {owner['group/' + g]} and in {n}"
                )
            groups[g] = {"dim": int(info["dim"]), "count": p.group_count(g)}
            owner["group/" + g] = n
        for spec in p.specs():
            tensors[spec.name] = (lambda q, t: lambda: q.packed(t))(p, spec.name)
    extra: dict[str, Any] = {"joined_from": names}
    files: list[str] | None = []
    for p in parts:
        files = None if files is None or p.files is None else [*files, *p.files]
    accumulation = coarsest_accumulation(parts)
    if accumulation is not None:
        extra["accumulation"] = accumulation
    if "share_inputs" in first.extra:
        extra["share_inputs"] = first.extra["share_inputs"]
    experts = {g: v for p in parts for g, v in dict(p.extra.get("experts") or {}).items()}
    if experts:
        extra["experts"] = experts
    not_solved = {m: why for p in parts for m, why in p.not_solved.items() if m not in modules}
    if not_solved:
        extra["not_solved"] = not_solved
    return first.rebuilt(tensors, modules=modules, groups=groups, extra=extra, files=files)
