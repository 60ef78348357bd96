#!/usr/bin/env bash
# Build a wheel with default flags (`pip wheel .`, what a release ships), install it into a
# fresh virtual environment and check that the native core loads and picks the best SIMD
# path this CPU supports by itself (avx512 on an AVX-512 machine), with a Gram checked
# against NumPy. Used by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
PYTHON=${PYTHON:-python3}
"$PYTHON" -m pip wheel --quiet --no-deps . -w "$work/dist"
"$PYTHON" -m venv "$work/venv"
"$work/venv/bin/python" -m pip install --quiet "$work"/dist/lmdx-*.whl
cd "$work"  # away from the source tree
"$work/venv/bin/python" - <<'PY'
import lmdx
import numpy as np
from lmdx._core import supported_variants

config = lmdx.config()
best = supported_variants()[0]
print(f"wheel: built {config['built_paths']}, CPU supports {config['supported_paths']}, "
      f"chose {config['simd_path']}")
assert config["simd_forced"] is None
assert config["simd_path"] == best, f"chose {config['simd_path']}, best supported is {best}"
if "avx512f" in config["cpu_features"]:
    assert config["simd_path"] == "avx512", "AVX-512 CPU but the avx512 path was not chosen"
x = np.random.default_rng(0).standard_normal((3000, 200)).astype(np.float32)
gram = lmdx.Moments(200).update(x).gram()
ref = x.astype(np.float64).T @ x.astype(np.float64)
err = np.linalg.norm(gram - ref) / np.linalg.norm(ref)
assert err < 1e-6, err
print(f"wheel: Gram on the {config['simd_path']} path within {err:.1e} of float64")
PY
