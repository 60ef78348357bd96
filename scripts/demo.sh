#!/usr/bin/env bash
# Set up (or reuse) the virtual environment .venv, install lmdx, and run the end-to-end
# example of the core (examples/core_demo.py).
set -euo pipefail
. "$(dirname "$0")/venv.sh" ""
PYTHON=python bash scripts/install.sh .
python examples/core_demo.py
