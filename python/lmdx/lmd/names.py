"""Renamed LMD names: the old spellings still work, with a DeprecationWarning naming the new.

The relative ridge is ``ridge`` (as in :func:`lmdx.spd_solve`), its grid ``ridge_grid``;
the absolute ridge is ``ridge_absolute`` (as in the solver's ``SolveInfo``). They were
``rho``, ``rho_grid`` and ``alpha`` (a name RegMean uses for its off-diagonal scale). The
keys of ``result.json`` and ``results.csv`` and the CLI flags keep the old names.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

__all__ = ["RENAMED", "Renamed", "new_name", "renamed_keywords"]

#: Old name -> new name, for keywords, attributes and module constants of :mod:`lmdx.lmd`.
RENAMED: dict[str, str] = {
    "rho": "ridge",
    "rho_grid": "ridge_grid",
    "rho_scores": "ridge_scores",
    "alpha": "ridge_absolute",
    "lam": "ridge_absolute",
    "DEFAULT_RHO_GRID": "DEFAULT_RIDGE_GRID",
    "COMPAT_ALPHA": "COMPAT_RIDGE_ABSOLUTE",
}


def new_name(old: str, where: str, *, stacklevel: int = 3) -> str:
    """The new name of ``old``, after a DeprecationWarning that names it.

    ``stacklevel`` counts from the caller of this function (3: the caller's caller).
    """
    new = RENAMED[old]
    warnings.warn(
        f"{where}.{old} is deprecated; use {where}.{new} (same meaning)",
        DeprecationWarning,
        stacklevel=stacklevel,
    )
    return new


def renamed_keywords(where: str, old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """``new`` (keyword -> value as passed, None when not passed) with the deprecated
    keywords ``old`` moved to their new names, each with a DeprecationWarning.

    Raises
    ------
    TypeError
        A keyword that is neither a parameter nor a deprecated name of one, or an old and
        a new spelling of the same parameter passed together.
    """
    out = dict(new)
    for key, value in old.items():
        target = RENAMED.get(key)
        if target is None or target not in new:
            raise TypeError(f"{where}() got an unexpected keyword argument {key!r}")
        if new[target] is not None:
            raise TypeError(f"{where}(): pass {target}= only ({key}= is its deprecated name)")
        warnings.warn(
            f"{where}({key}=...) is deprecated; use {target}= (same meaning)",
            DeprecationWarning,
            stacklevel=3,
        )
        out[target] = value
    return out


class Renamed:
    """A deprecated attribute: reading it warns and returns the attribute's new name.

    Use as a class attribute named by the old name (a key of :data:`RENAMED`).
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self.owner = owner.__name__
        self.old = name

    def __get__(self, obj: object, objtype: type | None = None) -> Any:
        if obj is None:
            return self
        return getattr(obj, new_name(self.old, self.owner))
