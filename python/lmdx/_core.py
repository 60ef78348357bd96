"""Load the native core compiled for the best instruction set this CPU supports.

The extension is built several times (``_core_baseline`` runs on any x86-64,
``_core_avx2`` needs x86-64-v3, ``_core_avx512`` needs x86-64-v4). At import the best
supported one is chosen; ``LMDX_SIMD=baseline|avx2|avx512`` forces one (for testing).
The variants share one interface, typed by the generated stub ``_core_baseline.pyi``
(``scripts/check_stubs.sh`` keeps it in sync), so mypy checks every call into the core;
every argument is passed by keyword.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from types import ModuleType
from typing import TYPE_CHECKING

__all__ = ["VARIANTS", "built_variants", "core", "load", "supported_variants"]

#: All variants, best first, with the CPU feature level each needs.
VARIANTS: dict[str, str | None] = {"avx512": "x86-64-v4", "avx2": "x86-64-v3", "baseline": None}


def _import(variant: str) -> ModuleType:
    return importlib.import_module(f"lmdx._core_{variant}")


def built_variants() -> list[str]:
    """Variants present in this installation, best first."""
    return [v for v in VARIANTS if importlib.util.find_spec(f"lmdx._core_{v}") is not None]


def _baseline() -> ModuleType:
    try:
        return _import("baseline")
    except ImportError as exc:
        raise ImportError(
            "lmdx's native core (lmdx._core_baseline) is missing or cannot be loaded. "
            "Install lmdx with `pip install .` from a source checkout (it needs a C++17 "
            "compiler) rather than importing it from the source tree."
        ) from exc


def supported_variants() -> list[str]:
    """Built variants whose instruction set this CPU supports, best first."""
    features = _baseline().cpu_features()
    return [v for v in built_variants() if VARIANTS[v] is None or features.get(VARIANTS[v], False)]


def load(variant: str | None = None) -> ModuleType:
    """Import a core variant: ``variant``, else ``$LMDX_SIMD``, else the best supported."""
    requested = variant or os.environ.get("LMDX_SIMD") or None
    supported = supported_variants()
    if requested is None:
        return _import(supported[0])
    if requested not in VARIANTS:
        raise ValueError(
            f"LMDX_SIMD / variant must be one of {', '.join(VARIANTS)}; got {requested!r}"
        )
    if requested not in supported:
        raise RuntimeError(
            f"lmdx core variant {requested!r} cannot run here: built {built_variants()}, "
            f"supported by this CPU {supported}. Unset LMDX_SIMD to choose automatically."
        )
    return _import(requested)


if TYPE_CHECKING:  # every variant has the interface of the stub
    from . import _core_baseline as core
else:
    #: The variant used by the lmdx API.
    core = load()
