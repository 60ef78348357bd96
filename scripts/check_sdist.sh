#!/usr/bin/env bash
# The sdist builds anywhere (run by .ci/run): build it, check that it holds the C++ sources,
# the CMake and Python project files and the package, then build a wheel from it with only
# the portable SIMD build (LMDX_SIMD_VARIANTS=baseline, what CMake falls back to where the
# compiler or the CPU family cannot build the others; docs/install.md) and check that
# wheel: one compiled module, which loads and computes a Gram against NumPy.
#
#   PYTHON=.venv/bin/python bash scripts/check_sdist.sh
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# Absolute (the checks below run away from the source tree); symlinks kept: a venv's python is one.
PYTHON=$(realpath -s "$(command -v "${PYTHON:-python3}")")
start=$SECONDS
"$PYTHON" -m pip install -qq "build>=1"
"$PYTHON" -m build --sdist --outdir "$work/sdist" . >"$work/sdist.log" 2>&1 ||
  { cat "$work/sdist.log" >&2; exit 1; }
sdist=$(ls "$work"/sdist/lmdx-*.tar.gz)
tar tzf "$sdist" >"$work/contents.txt"
for path in CMakeLists.txt pyproject.toml README.md csrc/core/config.cpp csrc/core/config.hpp \
    csrc/bindings/module.cpp python/lmdx/__init__.py python/lmdx/_core.py \
    python/lmdx/_core_avx2.py python/lmdx/_core_avx512.py python/lmdx/_core_baseline.pyi; do
  grep -qx "lmdx-[^/]*/$path" "$work/contents.txt" ||
    { echo "check_sdist: $(basename "$sdist") lacks $path" >&2; exit 1; }
done
if grep -E '\.so$|/build/|/\.venv/' "$work/contents.txt"; then
  echo "check_sdist: $(basename "$sdist") holds build outputs (above)" >&2; exit 1
fi
echo "check_sdist: $(basename "$sdist"): $(wc -l <"$work/contents.txt") files, sources present"
LMDX_SIMD_VARIANTS=baseline "$PYTHON" -m pip wheel --quiet --no-deps "$sdist" -w "$work/wheel"
"$PYTHON" -m zipfile -e "$work"/wheel/lmdx-*.whl "$work/unpacked"
cd "$work"  # away from the source tree
PYTHONPATH="$work/unpacked" "$PYTHON" - <<'PY'
from pathlib import Path
import numpy as np
import lmdx
assert Path(lmdx.__file__).is_relative_to(Path.cwd()), lmdx.__file__
compiled = sorted(p.name.split(".")[0] for p in Path(lmdx.__file__).parent.rglob("*.so"))
assert compiled == ["_core_baseline"], compiled
config = lmdx.config()
assert config["built_paths"] == ["baseline"] and config["simd_path"] == "baseline", config
x = np.random.default_rng(0).standard_normal((500, 40))
err = np.abs(lmdx.Moments(40).update(x).gram() - x.T @ x).max() / np.abs(x.T @ x).max()
assert err < 1e-12, err
print(f"check_sdist: baseline-only wheel from the sdist: {compiled}, Gram within {err:.1e}")
PY
echo "check_sdist: passed in $((SECONDS - start)) s"
