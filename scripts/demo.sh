#!/usr/bin/env bash
# Set up a virtual environment from scratch (.venv), install lmdx, and run the end-to-end
# example of the core (examples/core_demo.py).
set -euo pipefail
. "$(dirname "$0")/venv.sh"
python -m pip install --quiet .
python examples/core_demo.py
