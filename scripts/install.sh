#!/usr/bin/env bash
# Install lmdx from this checkout into the environment of $PYTHON (default: python), with
# pip's arguments (default: `.`), showing the compile of the core as one progress line
# (pip shows nothing of it otherwise). The build folder (build/<wheel tag>) is kept, and the
# compile commands do not change between installs (CMakeLists.txt stages the pybind11 and
# Eigen headers there), so a second install in the same checkout compiles only what changed.
# On a failure, the end of pip's output is printed.
#
#   bash scripts/install.sh '.[merge,lmd]'
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python}
[ "$#" -gt 0 ] || set -- .
log=$(mktemp)
trap 'rm -f "$log"' EXIT
tty=0
[ -t 1 ] && tty=1
start=$SECONDS
# ninja's lines ([12/70] Building CXX object CMakeFiles/lmdx_core_avx2.dir/csrc/core/spd.cpp.o)
# become "lmdx: compiling the core [12/70] spd.cpp (avx2)"; on a terminal, on one line.
progress='
/^[[:space:]]*\[[0-9]+\/[0-9]+\] (Building|Linking)/ {
  file = $NF; sub(/.*\//, "", file); sub(/\.o$/, "", file)
  variant = ""
  if (match($0, /_(baseline|avx2|avx512)\.dir/)) variant = " (" substr($0, RSTART + 1, RLENGTH - 5) ")"
  if ($0 ~ / Linking /) file = "linking " file
  line = sprintf("lmdx: compiling the core %s %s%s", $1, file, variant)
  if (tty) { printf "\r%-79.79s", line } else { print line }
  shown = 1; fflush()
}
END { if (tty && shown) printf "\n" }'
if ! "$PYTHON" -m pip install -v "$@" 2>&1 | tee "$log" | awk -v tty=$tty "$progress"; then
  echo "install: pip install $* failed; the end of its output:" >&2
  tail -n 40 "$log" >&2
  exit 1
fi
compiled=$(grep -cE '^[[:space:]]*\[[0-9]+/[0-9]+\] Building' "$log" || true)
echo "install: lmdx installed from $PWD in $((SECONDS - start)) s ($compiled compile steps; ccache serves the unchanged ones)"
