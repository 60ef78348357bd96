#!/usr/bin/env bash
# Set up a virtual environment from scratch (.venv), install lmdx, and run the end-to-end
# example of the core (examples/core_demo.py).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet .
python examples/core_demo.py
