# Sourced by demo.sh, regmean_demo.sh and test.sh: create (or reuse) .venv in the repository root,
# activate it and install the CPU build of torch first, from PyTorch's CPU index
# (install_torch.sh: a bare `torch` requirement would pull a multi-GB CUDA build).
cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
PYTHON=python bash scripts/install_torch.sh
