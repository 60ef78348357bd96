"""The RegMean merge's work, the machine's peak, the copies' deviation and the merge's error
measures, in one place for the merge benchmarks (``bench_regmean.py``, ``bench_regmean_merge.py``,
``bench_merge_gemm.py``, ``bench_cost.py``, ``bench_llm_shapes.py``)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

PEAK_SECONDS = 0.5  # each of the best-of-3 FMA-loop measurements


def regmean_flops(d_in: int, d_out: int, k: int) -> float:
    """Flops of one RegMean system as lmdx's core computes it: the deviation form, K models
    with c_i > 0. d_in³/3 (Cholesky) + 2·(K − 1)·d_in²·d_out (the K − 1 right-hand-side
    products Σ_{i≠p} c_i (G̃_i − G̃_p)(W_i − W̄)ᵀ) + 2·d_in²·d_out (the two triangular
    solves). Every implementation of a merge is credited these: the work the merge needs,
    whatever one does."""
    return d_in**3 / 3 + 2 * (k - 1) * d_in**2 * d_out + 2 * d_in**2 * d_out


def model_flops(stats: Any, weights: Mapping[str, Any], k: int) -> float:
    """:func:`regmean_flops` summed over a whole-model merge's systems: one per input group
    of ``stats`` (one model's :class:`lmdx.Statistics`; d_in its Gram's size), d_out the
    rows of its modules' weights found in ``weights`` (name -> array, e.g. the merged state
    dict: the shapes of the systems actually merged)."""
    d_out: dict[str, int] = defaultdict(int)
    for module, info in stats.modules.items():
        if info["weight"] in weights:
            shape = weights[info["weight"]].shape
            d_out[stats.group_of(module)] += shape[0] if info["layout"] == "linear" else shape[1]
    return sum(regmean_flops(int(stats.groups[g]["dim"]), n, k) for g, n in d_out.items())


def measure_peaks(threads: int) -> dict[str, float]:
    """float32 and float64 FMA peaks in GFLOP/s at ``threads`` (lmdx's
    ``measure_peak_gflops``, best of 3 × ``PEAK_SECONDS``, wall clock), measured once per
    run and printed by :func:`peak_line`."""
    from bench_core import measure_peaks as fma_peaks  # the sibling script's measurement

    found = fma_peaks([threads], PEAK_SECONDS)[threads]
    return {"float32": found["fp32"], "float64": found["fp64"]}


def peak_line(peaks: Mapping[str, float], threads: int) -> str:
    return (
        f"FMA peak measured now (lmdx measure_peak_gflops, best of 3 x {PEAK_SECONDS} s, "
        f"{threads} thread(s)): float32 {peaks['float32']:.1f}, float64 "
        f"{peaks['float64']:.1f} GFLOP/s"
    )


def percent_of_peak(flops: float, seconds: float, peak_gflops: float) -> float:
    """flops / seconds as a percentage of a peak in GFLOP/s."""
    return 100.0 * flops / seconds / (peak_gflops * 1e9)


def efficiency(flops: float, seconds: float, peaks: Mapping[str, float], float64: bool) -> str:
    """'x % of the float32 peak' (and, for a float64 merge, of the float64 peak first)."""
    f32 = f"{percent_of_peak(flops, seconds, peaks['float32']):.1f} % of the float32 peak"
    if not float64:
        return f32
    return f"{percent_of_peak(flops, seconds, peaks['float64']):.1f} % of the float64 peak, {f32}"


def deviation(weights: Sequence[Any]) -> float:
    """The largest RMS relative deviation ‖W_i − W̄‖/‖W̄‖ of K copies of one weight from
    their average."""
    arrays = [np.asarray(w, dtype=np.float64) for w in weights]
    mean = sum(arrays) / len(arrays)
    return max(float(np.linalg.norm(w - mean) / np.linalg.norm(mean)) for w in arrays)


def deviation_line(deviations: Sequence[float]) -> str:
    """min / median / max of per-weight :func:`deviation` values, in %."""
    d = 100 * np.asarray(deviations)
    return (
        f"measured deviation of the copies (RMS relative ||W_i - W-|| / ||W-||, largest copy, "
        f"over {len(d)} RegMean weights): min {d.min():.2f} %, median {np.median(d):.2f} %,"
        f" max {d.max():.2f} %"
    )


def merged_errors(
    merged: dict[str, np.ndarray], reference: dict[str, np.ndarray], stats: list[Any], alpha: float
) -> dict[str, Any]:
    """Per RegMean-merged weight, against ``reference``: the weight error
    max|E|/max|W| and the output error ‖E‖_S/‖W‖_S (S = Σ G̃_i from ``stats``); max and
    median over the layers."""
    weight, output, system = {}, {}, {}
    for module, info in stats[0].modules.items():
        key = info["weight"]
        if key not in merged or key not in reference:
            continue
        group = stats[0].group_of(module)
        if group not in system:  # one group at a time (groups are listed together)
            system = {
                group: reduced_sum([st.gram(module) / st.count(module) for st in stats], alpha)
            }
        weight[key], output[key] = errors(merged[key], reference[key], system[group])
    return {
        "weight_max": max(weight.values()),
        "weight_median": float(np.median(list(weight.values()))),
        "output_max": max(output.values()),
        "output_median": float(np.median(list(output.values()))),
        "worst_output": max(output, key=lambda k: output[k]),
        "layers": len(weight),
    }


def reduced_sum(grams: list[np.ndarray], alpha: float) -> np.ndarray:
    """S = Σ G̃_i, G̃_i = α Ĝ_i + (1 − α) diag Ĝ_i, from the mean Grams Ĝ_i = G_i / n_i."""
    return np.sum([alpha * g + (1.0 - alpha) * np.diag(np.diag(g)) for g in grams], axis=0)


def errors(merged: np.ndarray, reference: np.ndarray, s: np.ndarray) -> tuple[float, float]:
    """The weight error max|E|/max|W| and the output error ‖E‖_S/‖W‖_S of ``merged``
    against ``reference`` = W (E = merged − W; S = Σ G̃_i of the system)."""
    w = np.asarray(reference, dtype=np.float64)
    e = np.asarray(merged, dtype=np.float64) - w
    return rel_max(w + e, w), float(np.sqrt(np.sum((e @ s) * e) / np.sum((w @ s) * w)))


def rel_max(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.max(np.abs(a - ref)) / max(np.max(np.abs(ref)), 1e-300))


def rel_fro(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.linalg.norm(a - ref) / max(np.linalg.norm(ref), 1e-300))
