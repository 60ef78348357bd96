"""Load the native core compiled for the best instruction set this CPU supports.

The extension is built several times (``_core_baseline`` runs on any CPU of its family,
``_core_avx2`` needs x86-64-v3, ``_core_avx512`` needs x86-64-v4). At import the best
supported one is chosen; ``LMDX_SIMD=baseline|avx2|avx512`` forces one (for testing).
The variants share one interface, typed by the generated stub ``_core_baseline.pyi``
(``scripts/check_stubs.sh`` keeps it in sync), so mypy checks every call into the core;
every argument is passed by keyword.

Only the baseline is an importable extension (``lmdx/_core_baseline*.so``). The others live
in ``lmdx/_native/``, a folder that is not a package, behind the small modules
``lmdx/_core_avx2.py`` and ``lmdx/_core_avx512.py``: those check the CPU (with the
baseline's detection) *before* the compiled file is opened, so importing a variant this CPU
cannot run raises :class:`ImportError` instead of dying of an illegal instruction (static
initializers run as soon as a library is opened, before any check inside it could).
``LMDX_DISABLE_CPU_FEATURES`` (names from ``cpu_features()``, comma separated) makes lmdx
treat the CPU as lacking them, to test that path or to avoid AVX-512 on purpose.
"""

from __future__ import annotations

import functools
import importlib
import importlib.machinery
import importlib.util
import os
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

__all__ = [
    "VARIANTS",
    "bf16_dot",
    "built_variants",
    "core",
    "cpu_features",
    "gram_paths",
    "load",
    "load_native",
    "missing_features",
    "supported_variants",
]

#: All variants, best first, with the CPU feature level each needs.
VARIANTS: dict[str, str | None] = {"avx512": "x86-64-v4", "avx2": "x86-64-v3", "baseline": None}

#: The features of ``cpu_features()`` each variant needs (its level implies them all).
_NEEDS: dict[str, tuple[str, ...]] = {
    "avx2": ("avx2", "fma", "f16c", "bmi2", "x86-64-v3"),
    "avx512": (
        *("avx2", "fma", "f16c", "bmi2", "x86-64-v3"),
        *("avx512f", "avx512bw", "avx512dq", "avx512vl", "avx512cd", "x86-64-v4"),
    ),
    "baseline": (),
}

_NATIVE = Path(__file__).resolve().parent / "_native"
_DISABLE = "LMDX_DISABLE_CPU_FEATURES"


def _native_file(variant: str) -> Path | None:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = _NATIVE / f"_core_{variant}{suffix}"
        if path.is_file():
            return path
    return None


def _import(variant: str) -> ModuleType:
    return importlib.import_module(f"lmdx._core_{variant}")


def built_variants() -> list[str]:
    """Variants present in this installation, best first."""
    return [
        v
        for v in VARIANTS
        if (importlib.util.find_spec("lmdx._core_baseline") if v == "baseline" else _native_file(v))
        is not None
    ]


def _baseline() -> ModuleType:
    try:
        return _import("baseline")
    except ImportError as exc:
        raise ImportError(
            "lmdx's native core (lmdx._core_baseline) is missing or cannot be loaded. "
            "Install a wheel, or build from a checkout with `pip install .` (needs a C++17 "
            "compiler; docs/install.md: where lmdx comes from), rather than importing lmdx "
            "from the source tree."
        ) from exc


def cpu_features() -> dict[str, bool]:
    """This CPU's features as the baseline core detects them, less those named in
    ``$LMDX_DISABLE_CPU_FEATURES``."""
    features: dict[str, bool] = dict(_baseline().cpu_features())
    disabled = [f.strip() for f in os.environ.get(_DISABLE, "").split(",") if f.strip()]
    unknown = [f for f in disabled if f not in features]
    if unknown:
        raise ValueError(
            f"{_DISABLE}: unknown CPU feature(s) {', '.join(unknown)}; known: {', '.join(features)}"
        )
    features = {name: present and name not in disabled for name, present in features.items()}
    for variant, level in reversed(VARIANTS.items()):  # a level needs all its features
        if level is not None:
            features[level] = all(features.get(f, False) for f in _NEEDS[variant])
    return features


def missing_features(variant: str, features: dict[str, bool] | None = None) -> list[str]:
    """The CPU features ``variant`` needs that ``features`` (default: this CPU's) lack."""
    have = cpu_features() if features is None else features
    return [f for f in _NEEDS[variant] if not have.get(f, False)]


def supported_variants() -> list[str]:
    """Built variants whose instruction set this CPU supports, best first."""
    features = cpu_features()
    return [v for v in built_variants() if not missing_features(v, features)]


def load_native(variant: str) -> ModuleType:
    """Open the compiled ``lmdx/_native/_core_<variant>`` after checking this CPU runs it.

    Called by ``lmdx/_core_<variant>.py``; raises :class:`ImportError` naming the variant
    and the CPU's features when the CPU lacks one it needs, before the file is opened.
    """
    name = f"lmdx._core_{variant}"
    features = cpu_features()
    missing = missing_features(variant, features)
    if missing:
        present = [f for f, ok in features.items() if ok]
        raise ImportError(
            f"{name}: this CPU cannot run the {variant} build of lmdx's core (it needs "
            f"{VARIANTS[variant]}); missing: {', '.join(missing)}; this CPU has: "
            f"{', '.join(present) or 'none of the features lmdx checks'}. "
            "Import lmdx itself: it picks a build this CPU runs.",
            name=name,
        )
    path = _native_file(variant)
    if path is None:
        raise ImportError(
            f"{name}: the {variant} build of lmdx's core is not in this installation "
            f"(built: {', '.join(built_variants())}); import lmdx itself to use the best one",
            name=name,
        )
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None  # a file with an extension suffix
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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


@functools.cache
def bf16_dot() -> bool:
    """Whether bfloat16 rows go to the core's bf16 dot-product Gram kernel: the variant in
    use has it, this CPU runs it (AVX512_BF16) and ``$LMDX_DISABLE_CPU_FEATURES`` does not
    name ``avx512bf16``. Decided once per process, like the variant."""
    return bool(core.bf16_dot_available()) and cpu_features().get("avx512bf16", False)


def gram_paths() -> dict[str, str]:
    """How the Gram kernel multiplies rows of each input dtype in this process (in the SIMD
    path of :data:`core`)."""
    return {
        "float32": "fma",
        "float64": "fma",
        "bfloat16": "avx512bf16 dot product" if bf16_dot() else "widened to float32",
        "float16": "widened to float32",
    }
