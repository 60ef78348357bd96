"""Fuzz: corrupted statistics files, sharded statistics folders, checkpoints, checkpoint
indexes and merge configs (tests/fuzz/fuzz_cases.py) never end in anything but an lmdx
error, a partial output, a modified input or a merge different from the clean one.

Bounded by example counts (about a minute in all on two cores); scripts/fuzz.py runs
the same cases by the thousand, each under a time and memory limit.
"""

from __future__ import annotations

import collections
import resource

import door_cases as D
import fuzz_cases as F
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.numpy import load_file

pytestmark = pytest.mark.slow  # hundreds of corrupted inputs, each merged

EXAMPLES = {
    "stats_file": 400,
    "stats_folder": 250,
    "fisher_file": 200,
    "checkpoint": 250,
    "checkpoint_index": 250,
    "config": 120,
}
#: Growth of the process's peak resident memory over all cases of one target: the
#: inputs are kilobytes, so anything near this means a corrupted size was believed.
MEMORY_BOUND = 512 * 2**20


@pytest.fixture(scope="module")
def workspace(tmp_path_factory: pytest.TempPathFactory) -> F.Workspace:
    return F.Workspace(tmp_path_factory.mktemp("fuzz"))


def _peak() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@pytest.mark.parametrize("target", F.TARGETS)
def test_corrupted_inputs_end_in_an_lmdx_error_or_the_clean_merge(
    workspace: F.Workspace, target: str
) -> None:
    outcomes: collections.Counter[str] = collections.Counter()
    peak = _peak()

    @settings(max_examples=EXAMPLES[target], derandomize=True, database=None)
    @given(seed=st.integers(0, 2**32 - 1))
    def case(seed: int) -> None:
        outcomes[F.run_case(workspace, target, seed)] += 1

    case()
    assert sum(outcomes.values()) >= EXAMPLES[target]
    # most corruptions are refused; the rest merged exactly as the clean inputs did
    assert outcomes["merged"] < sum(outcomes.values())
    assert _peak() - peak < MEMORY_BOUND


def _unpack(packed: np.ndarray, d: int) -> np.ndarray:
    g = np.zeros((d, d))
    g[np.triu_indices(d)] = packed
    return g + np.triu(g, 1).T


def test_the_clean_merge_is_regmean(workspace: F.Workspace) -> None:
    """The reference every accepted corruption is compared with is itself right: RegMean
    (α = 0.9) by NumPy from the files as the safetensors library reads them."""
    clean = workspace.clean
    states = [load_file(str(clean / "m0" / "model.safetensors")), {}]
    for shard in sorted((clean / "m1").glob("model-*.safetensors")):
        states[1].update(load_file(str(shard)))
    grams = [load_file(str(clean / "s0.safetensors")), {}]
    for shard in sorted((clean / "s1").glob("stats-*.safetensors")):
        grams[1].update(load_file(str(shard)))
    for m in F.MODULES:
        g = [_unpack(s[f"gram/{m}"], F.D_IN) / F.ROWS for s in grams]
        g = [0.9 * x + 0.1 * np.diag(np.diag(x)) for x in g]
        w = [s[f"{m}.weight"].astype(np.float64) for s in states]
        ref = np.linalg.solve(sum(g), sum(gi @ wi.T for gi, wi in zip(g, w, strict=True))).T
        got = workspace.expected[f"{m}.weight"]
        assert np.linalg.norm(got - ref) / np.linalg.norm(ref) < 1e-5
        bias = (states[0][f"{m}.bias"].astype(np.float64) + states[1][f"{m}.bias"]) / 2
        assert np.abs(workspace.expected[f"{m}.bias"] - bias).max() < 1e-6
    assert np.array_equal(workspace.expected["position_ids"], states[0]["position_ids"])


def test_the_clean_fisher_merge_is_fisher_weighted(workspace: F.Workspace) -> None:
    """Fisher reference: Σ (F_i/n + ε) θ_i / Σ (F_i/n + ε) per parameter, by NumPy."""
    clean = workspace.clean
    states = [load_file(str(clean / "m0" / "model.safetensors")), {}]
    for shard in sorted((clean / "m1").glob("model-*.safetensors")):
        states[1].update(load_file(str(shard)))
    fishers = [load_file(str(clean / f"f{i}.safetensors")) for i in range(2)]
    for name, got in workspace.expected_fisher.items():
        if got.dtype != np.float32:
            continue
        w = [fi[f"fisher/{name}"] / F.ROWS + 1e-8 for fi in fishers]
        ref = sum(wi * s[name].astype(np.float64) for wi, s in zip(w, states, strict=True))
        ref = ref / sum(w)
        assert np.abs(got - ref).max() <= 1e-6 * max(1.0, np.abs(ref).max()), name


def test_drawn_calls_of_the_in_memory_door_end_in_an_lmdx_error_or_a_sound_merge() -> None:
    """400 drawn calls of merge_state_dicts (door_cases.py: every data-free method and
    +svc, options, dtypes, 0-dim and empty tensors, NaN and Inf): each an lmdx error in one
    line or a merge with every shape, dtype and integer kept and nothing non-finite (a
    warning here is an error too). scripts/fuzz.py --targets state_dicts runs thousands."""
    outcomes = collections.Counter(D.run_door_case(seed) for seed in range(400))
    assert outcomes["merged"] >= 100, outcomes
    assert set(outcomes) <= {"merged", "MergeError", "OptionError"}, outcomes


def test_drawn_merges_and_costs_with_forged_impossible_or_absent_statistics(
    workspace: F.Workspace,
) -> None:
    """200 drawn merges and cost measurements (door_cases.run_cost_case): statistics real,
    forged ×100, impossible (NaN, Inf, a negative diagonal) or absent (surrogates), written
    with or without accept_flagged: only lmdx errors, no impossible Gram measured, no forged
    file unflagged, no flagged merge written unaccepted, no partial output."""
    outcomes = collections.Counter(D.run_cost_case(workspace, seed) for seed in range(200))
    assert outcomes["merged"] >= 30 and outcomes["measured"] >= 15, outcomes
