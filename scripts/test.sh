#!/usr/bin/env bash
# Set up a virtual environment from scratch (.venv), install lmdx with its test
# dependencies, and run the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
"$PYTHON" -m venv .venv
. .venv/bin/activate
python -m pip install --quiet --upgrade pip
# The CPU build of torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet ".[test]"
# The package source lives in python/lmdx, so the tests import the installed build.
python -m pytest "$@" tests
