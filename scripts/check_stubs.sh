#!/usr/bin/env bash
# The native module's type stub, python/lmdx/_core_baseline.pyi, is generated from the
# installed build by pybind11-stubgen and formatted by ruff (so it passes the project's
# ruff check). This script regenerates it into a temporary folder and fails if the
# checked-in stub differs; the other variants (_core_avx2, _core_avx512) share the one
# interface, so their generated stubs must be the same file (compared for the variants this
# CPU can run). With --write it updates the checked-in stub instead. PYTHON: the
# interpreter with lmdx installed (.venv/bin/python).
#
#   bash scripts/check_stubs.sh            # check (CI, after installing lmdx into .venv)
#   bash scripts/check_stubs.sh --write    # regenerate after changing csrc/bindings
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
PYTHON=${PYTHON:-$root/.venv/bin/python}
stub=python/lmdx/_core_baseline.pyi
regenerate="bash scripts/check_stubs.sh --write"
write=false
case "${1:-}" in
  "") ;;
  --write) write=true ;;
  *) echo "check_stubs.sh: unknown argument '$1'; usage: $0 [--write]" >&2; exit 2 ;;
esac
for tool in pybind11_stubgen ruff; do
  if ! "$PYTHON" -c "import $tool" 2>/dev/null; then
    echo "check_stubs.sh: $tool is not installed for $PYTHON; install the test extra:" \
      "$PYTHON -m pip install '.[test]'" >&2
    exit 1
  fi
done
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# generate VARIANT: print the path of the formatted stub of lmdx._core_VARIANT.
generate() {
  # Run away from the source tree, so the installed package is the one imported.
  if ! (cd "$work" && "$PYTHON" -m pybind11_stubgen --exit-code -o "$work/$1" \
    "lmdx._core_$1" >"$work/$1.log" 2>&1); then
    echo "check_stubs.sh: pybind11-stubgen failed on lmdx._core_$1 (is lmdx installed for" \
      "$PYTHON, with the test extra?): $(tail -n 1 "$work/$1.log")" >&2
    exit 1
  fi
  local out="$work/$1/lmdx/_core_$1.pyi"
  "$PYTHON" -m ruff check --quiet --config "$root/pyproject.toml" --fix-only "$out"
  "$PYTHON" -m ruff format --quiet --config "$root/pyproject.toml" "$out"
  echo "$out"
}

baseline=$(generate baseline)
if $write; then
  cp "$baseline" "$stub"
  echo "wrote $stub"
  exit 0
fi
if ! cmp -s "$baseline" "$stub"; then
  echo "$stub differs from the stub generated from the installed lmdx._core_baseline;" \
    "regenerate with: $regenerate" >&2
  exit 1
fi
# Only the variants this CPU can run can be imported and compared (importing another is an
# ImportError: lmdx/_core.py); the others are named.
built=$(cd "$work" && "$PYTHON" -c 'import lmdx._core as c; print(" ".join(c.built_variants()))')
runnable=$(cd "$work" && "$PYTHON" -c 'import lmdx._core as c; print(" ".join(c.supported_variants()))')
for variant in $built; do
  [ "$variant" = baseline ] && continue
  case " $runnable " in
    *" $variant "*) ;;
    *) echo "stubs: lmdx._core_$variant not compared (this CPU cannot run it)"; continue ;;
  esac
  if ! cmp -s "$(generate "$variant")" "$baseline"; then
    echo "the stub generated from lmdx._core_$variant differs from $stub: the variants must" \
      "share one interface (rebuild all of them from one csrc/bindings)" >&2
    exit 1
  fi
done
echo "stubs: $stub matches the installed build (compared: $runnable)"
