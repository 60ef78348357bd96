"""The data-free merge methods at BERT-base size (K = 3): CPU time of each, one thread.

Random weights of BERT-base's shapes (``BertModel``: word, position and token-type
embeddings, 12 encoder layers of 768 hidden and 3072 intermediate, the pooler; 109.5 M
parameters in float32): a base drawn N(0, 0.02²) and three fine-tuned copies 2 % apart
(each entry plus N(0, (0.02 · 0.02)²)). Each method merges the three through
:func:`lmdx.merge_models` (in memory, defaults, ``n_threads=1``, BLAS and torch held to
one thread) and is timed by the process's CPU time (``time.process_time``), which other
work on a shared machine barely moves; wall time is printed beside it. For the methods
built on SVDs the same run times what their definition needs at least, with NumPy's
LAPACK (``gesdd``) on the same matrices: one thin SVD of every 2-D tensor of the model per
SVD the method takes of it (TSV-M: K + 2, ISO-C: 1, ISO-CTS: K + 3, SVC: 1).

    python bench/bench_data_free.py [--layers 12] [--methods ties tsv_m ...]
"""

from __future__ import annotations

import argparse
import os

for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_var] = "1"

import platform  # noqa: E402  (after the thread variables, which BLAS reads on import)
import time  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from lmdx import merge_models  # noqa: E402
from lmdx.merge.builtin.wudi import DEFAULT_RIDGE, wudi_solve  # noqa: E402

K = 3
#: method -> its options for this run (defaults otherwise) and the SVDs per 2-D tensor it
#: needs at least (0: none).
METHODS = {
    "average": ({}, 0),
    "task_arithmetic": ({}, 0),
    "ties": ({}, 0),
    "dare": ({}, 0),
    "breadcrumbs": ({}, 0),
    "breadcrumbs_ties": ({}, 0),
    "della": ({}, 0),
    "della_linear": ({}, 0),
    "model_stock": ({}, 0),
    "slerp": ({}, 0),
    "karcher": ({}, 0),
    "tsv_m": ({}, K + 2),
    "iso_c": ({}, 1),
    "iso_cts": ({}, K + 3),
    "wudi": ({}, 0),
    "ties+svc": ({}, 1),
}
NO_BASE = {"average", "slerp", "karcher"}


def bert_base_shapes(layers: int) -> dict[str, tuple[int, ...]]:
    """BertModel's parameter shapes (bert-base-uncased) with ``layers`` encoder layers."""
    h, f = 768, 3072
    shapes: dict[str, tuple[int, ...]] = {
        "embeddings.word_embeddings.weight": (30522, h),
        "embeddings.position_embeddings.weight": (512, h),
        "embeddings.token_type_embeddings.weight": (2, h),
        "embeddings.LayerNorm.weight": (h,),
        "embeddings.LayerNorm.bias": (h,),
    }
    for i in range(layers):
        p = f"encoder.layer.{i}"
        for m in ("attention.self.query", "attention.self.key", "attention.self.value",
                  "attention.output.dense"):  # fmt: skip
            shapes[f"{p}.{m}.weight"] = (h, h)
            shapes[f"{p}.{m}.bias"] = (h,)
        shapes[f"{p}.attention.output.LayerNorm.weight"] = (h,)
        shapes[f"{p}.attention.output.LayerNorm.bias"] = (h,)
        shapes[f"{p}.intermediate.dense.weight"] = (f, h)
        shapes[f"{p}.intermediate.dense.bias"] = (f,)
        shapes[f"{p}.output.dense.weight"] = (h, f)
        shapes[f"{p}.output.dense.bias"] = (h,)
        shapes[f"{p}.output.LayerNorm.weight"] = (h,)
        shapes[f"{p}.output.LayerNorm.bias"] = (h,)
    shapes["pooler.dense.weight"] = (h, h)
    shapes["pooler.dense.bias"] = (h,)
    return shapes


def models(
    layers: int, seed: int = 0
) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    rng = np.random.default_rng(seed)
    base, tuned = {}, [{} for _ in range(K)]
    for name, shape in bert_base_shapes(layers).items():
        b = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)
        base[name] = torch.from_numpy(b)
        for m in tuned:
            noise = rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02 * 0.02)
            m[name] = torch.from_numpy(b + noise)
    return base, tuned


def svd_floor(base: dict[str, torch.Tensor], tuned: list[dict[str, torch.Tensor]]) -> float:
    """CPU seconds of one thin float64 SVD of every 2-D task matrix (model 0's)."""
    spent = 0.0
    for name, b in base.items():
        if b.ndim == 2:
            tau = tuned[0][name].double().numpy() - b.double().numpy()
            start = time.process_time()
            np.linalg.svd(tau, full_matrices=False)
            spent += time.process_time() - start
    return spent


def wudi_precision(base: dict[str, torch.Tensor], tuned: list[dict[str, torch.Tensor]]) -> None:
    """WUDI's solves (the RegMean solver on surrogate Grams) per linear weight: the precision
    ``auto`` took, and its weight and output errors against an independent float64 NumPy
    solve of the same system (S the sum of the reduced surrogate Grams plus the ridge)."""
    taken: dict[str, int] = {}
    worst_w = worst_o = 0.0
    spent = {"auto": 0.0, "float64": 0.0}
    for name, b in base.items():
        if b.ndim != 2 or "embeddings" in name:  # WUDI solves the linear layers only
            continue
        taus = [m[name].double().numpy() - b.double().numpy() for m in tuned]
        got = {}
        for precision in spent:
            start = time.process_time()
            got[precision], info = wudi_solve(
                name, taus, [1.0] * K, ridge=DEFAULT_RIDGE, precision=precision, n_threads=1
            )
            spent[precision] += time.process_time() - start
            if precision == "auto":
                taken[info["precision"]] = taken.get(info["precision"], 0) + 1
        reduced = [t.T @ t / float(np.sum(t * t)) for t in taus]
        dim = taus[0].shape[1]
        strength = DEFAULT_RIDGE * K / dim
        s = sum(reduced) + strength * np.eye(dim)
        rhs = sum(g @ t.T for g, t in zip(reduced, taus, strict=True))
        rhs = rhs + strength * sum(taus).T
        ref = np.linalg.solve(s, rhs).T
        e = got["auto"] - ref
        worst_w = max(worst_w, float(np.abs(e).max() / np.abs(ref).max()))
        out_err = np.sqrt(np.einsum("oi,ij,oj->", e, s, e) / np.einsum("oi,ij,oj->", ref, s, ref))
        worst_o = max(worst_o, float(out_err))
    print(
        f"wudi solves: precision taken {taken}; auto {spent['auto']:.2f} s, float64 "
        f"{spent['float64']:.2f} s CPU; against a float64 NumPy solve: weight error "
        f"{worst_w:.1e}, output error {worst_o:.1e} (largest over layers)",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument(
        "--wudi-precision",
        action="store_true",
        help="only WUDI's solves: the precision each took, weight and output errors",
    )
    args = ap.parse_args()
    torch.set_num_threads(1)
    base, tuned = models(args.layers)
    n = sum(int(np.prod(t.shape)) for t in base.values())
    print(f"{platform.processor() or platform.machine()}; load {os.getloadavg()}")
    print(f"BERT-base shapes, {args.layers} layers, {n / 1e6:.1f} M parameters, K = {K}, float32")
    if args.wudi_precision:
        wudi_precision(base, tuned)
        return
    one_svd = svd_floor(base, tuned)
    print(f"one float64 SVD of every 2-D tensor: {one_svd:.2f} s CPU")
    print(f"{'method':<18} {'CPU s':>8} {'wall s':>8}   SVD floor (s)")
    for method in args.methods:
        options, svds = METHODS[method]
        given = tuned[:2] if method == "slerp" else tuned
        kwargs = {} if method in NO_BASE else {"base": base}
        start, wall = time.process_time(), time.perf_counter()
        result = merge_models(given, method, n_threads=1, progress=False, **kwargs, **options)
        cpu, wall = time.process_time() - start, time.perf_counter() - wall
        assert all(torch.isfinite(t).all() for t in result.state_dict.values())
        floor = f"{svds * one_svd:.1f} ({svds} per tensor)" if svds else "-"
        print(f"{method:<18} {cpu:8.2f} {wall:8.2f}   {floor}", flush=True)
        del result
    print(f"load {os.getloadavg()}")


if __name__ == "__main__":
    main()
