# Sourced by demo.sh, regmean_demo.sh and test.sh, and by the README's set-up: create .venv
# in the repository root (or reuse it), activate it, install the CPU build of torch unless
# it is there (install_torch.sh: a bare `torch` requirement would pull a multi-GB CUDA
# build), and, given EXTRAS, install lmdx with them (install.sh: the core compiles once per
# checkout; a later install compiles only what changed).
#
#   . scripts/venv.sh merge,lmd      # .venv with lmdx[merge,lmd], activated
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
  .venv/bin/python -m pip install --quiet --upgrade pip
fi
. .venv/bin/activate
PYTHON=python bash scripts/install_torch.sh
if [ -n "${1:-}" ]; then
  PYTHON=python bash scripts/install.sh ".[$1]"
fi
