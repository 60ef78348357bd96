#!/usr/bin/env bash
# Install torch's CPU build into the environment of $PYTHON (default: python), as PyTorch
# documents it: from PyTorch's CPU wheel index (a plain `pip install torch` on Linux x86-64
# pulls the CUDA build, several GB). Where that index cannot be reached within 10 s, torch
# comes from pip's configured index instead (PyPI's is the CUDA build on Linux x86-64), and
# one line on stderr says so. Used by venv.sh and check_wheel.sh; LMDX_TORCH overrides the
# requirement, LMDX_TORCH_INDEX the index (tests/docs/test_install_story.py).
#
#   PYTHON=.venv/bin/python bash scripts/install_torch.sh
set -euo pipefail
PYTHON=${PYTHON:-python}
torch=${LMDX_TORCH:-torch==2.13.0}  # the version the tests and benchmarks ran with
cpu_index=${LMDX_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
# Already installed and what was asked for (a version pin or a bare name): nothing to do.
installed="import sys, importlib.metadata as m; v = m.version('torch'); r = sys.argv[1]
sys.exit(0 if r == 'torch' or r == 'torch==' + v or r == 'torch==' + v.split('+')[0] else 1)"
if "$PYTHON" -c "$installed" "$torch" 2>/dev/null; then
  exit 0
fi
reachable="import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/', timeout=10)"
if "$PYTHON" -c "$reachable" "$cpu_index" 2>/dev/null &&
    "$PYTHON" -m pip install --quiet --index-url "$cpu_index" "$torch"; then
  exit 0
fi
echo "install_torch: PyTorch's CPU index ($cpu_index) cannot be reached; installing" \
  "$torch from pip's configured index instead (PyPI's is the CUDA build on Linux x86-64)" >&2
"$PYTHON" -m pip install --quiet "$torch"
