"""Every compiled variant is safe to import on any CPU.

A variant the CPU cannot run must raise ImportError naming the variant and the CPU's
features, and must not even be opened (its static initializers would run at dlopen). The
machines running these tests may have AVX-512, so an older CPU is simulated with
``LMDX_DISABLE_CPU_FEATURES``, which goes through the same check as a real one.
"""

from __future__ import annotations

import json
import os
import pkgutil
import subprocess
import sys
from pathlib import Path

import lmdx
import lmdx._core as dispatch
import pytest

WALK = """
import importlib, json, pkgutil
import lmdx
errors = {}
names = []
for info in pkgutil.walk_packages(lmdx.__path__, "lmdx."):
    names.append(info.name)
    try:
        importlib.import_module(info.name)
    except ImportError as exc:
        errors[info.name] = str(exc)
with open("/proc/self/maps") as maps:
    opened = sorted({line.split()[-1] for line in maps if "_native" in line})
print(json.dumps({"names": names, "errors": errors, "chosen": lmdx.config()["simd_path"],
                  "opened": opened}))
"""


def _walk(disabled: str) -> dict:
    env = {**os.environ, "LMDX_DISABLE_CPU_FEATURES": disabled}
    env.pop("LMDX_SIMD", None)
    proc = subprocess.run(
        [sys.executable, "-c", WALK], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def _missing_under(disabled: str, variant: str) -> list[str]:
    """What ``variant`` needs that this CPU lacks once ``disabled`` is turned off too."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LMDX_DISABLE_CPU_FEATURES", disabled)
        return dispatch.missing_features(variant)


@pytest.mark.parametrize(
    ("disabled", "refused", "chosen"),
    [("x86-64-v4", ["avx512"], "avx2"), ("avx2", ["avx512", "avx2"], "baseline")],
)
def test_walking_the_package_on_a_cpu_without_a_variant(disabled, refused, chosen):
    out = _walk(disabled)
    assert "lmdx._core_baseline" in out["names"] and "lmdx.cli" in out["names"]
    assert not any("_native" in name for name in out["names"]), "the folder is not a package"
    # Only the variants the (simulated) CPU cannot run fail, each with an ImportError that
    # says which variant, what it needs and what the CPU has; every other module imports.
    assert sorted(out["errors"]) == sorted(f"lmdx._core_{v}" for v in refused)
    for variant in refused:
        message = out["errors"][f"lmdx._core_{variant}"]
        if variant in dispatch.built_variants():
            assert f"lmdx._core_{variant}: this CPU cannot run the {variant} build" in message
            assert f"it needs {dispatch.VARIANTS[variant]}" in message
            # Every feature the variant needs that the simulated CPU lacks: on an AVX-512
            # machine only the disabled level, on an AVX2-only one every AVX-512 feature too.
            missing = _missing_under(disabled, variant)
            assert disabled in missing
            assert f"missing: {', '.join(missing)};" in message
            assert "this CPU has: " in message
        else:
            assert "is not in this installation" in message
        # The check ran before the compiled file was opened: nothing of it ran.
        assert not any(f"_core_{variant}." in path for path in out["opened"]), out["opened"]
    expected = chosen if chosen in dispatch.built_variants() else "baseline"
    assert out["chosen"] == expected


def test_native_folder_holds_the_compiled_variants_outside_any_package():
    folder = Path(lmdx.__file__).parent / "_native"
    assert not (folder / "__init__.py").exists()
    assert "_native" not in {m.name for m in pkgutil.iter_modules(lmdx.__path__)}
    for variant in dispatch.supported_variants():
        if variant == "baseline":
            continue
        module = dispatch.load(variant)
        assert module.__name__ == f"lmdx._core_{variant}"
        assert Path(module.__file__).parent == folder
        assert sys.modules[f"lmdx._core_{variant}"] is module
        assert module.isa() == variant


def test_a_disabled_feature_turns_off_the_levels_that_need_it(monkeypatch):
    real = dispatch.cpu_features()
    monkeypatch.setenv("LMDX_DISABLE_CPU_FEATURES", "avx512f, fma")
    features = dispatch.cpu_features()
    assert not features["avx512f"] and not features["fma"]
    assert not features["x86-64-v4"] and not features["x86-64-v3"]
    assert features["avx2"] == real["avx2"]
    assert dispatch.supported_variants() == ["baseline"]
    assert dispatch.missing_features("avx2", features)[:1] == ["fma"]
    assert lmdx.config()["supported_paths"] == ["baseline"]


def test_an_unknown_disabled_feature_is_a_value_error(monkeypatch):
    monkeypatch.setenv("LMDX_DISABLE_CPU_FEATURES", "avx512f,sse9")
    with pytest.raises(ValueError, match=r"^LMDX_DISABLE_CPU_FEATURES: unknown CPU feature"):
        dispatch.cpu_features()


def test_importing_a_refused_variant_directly_is_an_import_error():
    env = {**os.environ, "LMDX_DISABLE_CPU_FEATURES": "x86-64-v4"}
    proc = subprocess.run(
        [sys.executable, "-c", "import lmdx._core_avx512"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: lmdx._core_avx512: "), last
