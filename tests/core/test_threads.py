"""One thread-count rule everywhere: ``n_threads=None`` is lmdx.default_threads(), and any
integer below 1 is an error naming ``n_threads`` -- in the public API and in the native
core alike (the core does not read 0 or a negative count as "all threads")."""

from __future__ import annotations

import lmdx
import numpy as np
import pytest
from lmdx._core import core

BAD = [0, -1, -8]


def public_calls():
    """Each public kernel wrapper, called on a tiny valid input with the given n_threads."""
    x = np.arange(12.0).reshape(4, 3)
    gram = x.T @ x + np.eye(3)
    weight = np.ones((2, 3))
    return {
        "Moments.update": lambda t: lmdx.Moments(3).update(x, n_threads=t),
        "spd_solve": lambda t: lmdx.spd_solve(gram, np.ones(3), n_threads=t),
        "regmean_merge_layer": lambda t: lmdx.regmean_merge_layer(
            [gram, gram], [weight, weight], [4.0, 4.0], n_threads=t
        ),
        "weighted_average": lambda t: lmdx.weighted_average([x, x], n_threads=t),
        "fisher_average": lambda t: lmdx.fisher_average([x, x], [x, x], eps=1.0, n_threads=t),
    }


def native_calls():
    """The same kernels called on the native module directly (every argument by keyword)."""
    x = np.arange(12.0).reshape(4, 3)
    gram = x.T @ x + np.eye(3)
    weight = np.ones((2, 3))
    return {
        "Moments.update": lambda t: core.Moments(dim=3, chunk_rows=8).update(
            x=x, weights=None, n_threads=t, bfloat16=False
        ),
        "spd_solve": lambda t: core.spd_solve(
            a=gram, b=np.ones(3), alpha=1.0, ridge=0.0, allow_regularization=True, name="s",
            n_threads=t,
        ),
        "regmean_merge_layer": lambda t: core.regmean_merge_layer(
            grams=[gram, gram], weights=[weight, weight], counts=[4.0, 4.0], alpha=1.0,
            coefficients=None, layout="linear", precision="float64", noise_floor=0.0, ridge=0.0,
            allow_regularization=True, name="l", n_threads=t,
        ),
        "weighted_average": lambda t: core.weighted_average(
            tensors=[x, x], coefficients=None, n_threads=t
        ),
        "fisher_average": lambda t: core.fisher_average(
            params=[x, x], fishers=[x, x], coefficients=None, eps=1.0, n_threads=t
        ),
        "measure_peak_gflops": lambda t: core.measure_peak_gflops(
            double_precision=True, n_threads=t, seconds=0.0
        ),
    }  # fmt: skip


@pytest.mark.parametrize("name", sorted(public_calls()))
@pytest.mark.parametrize("bad", BAD)
def test_public_api_rejects_thread_counts_below_one(name, bad):
    with pytest.raises(ValueError, match=rf"^n_threads: must be >= 1, got {bad}; pass None"):
        public_calls()[name](bad)


@pytest.mark.parametrize("name", sorted(native_calls()))
@pytest.mark.parametrize("bad", BAD)
def test_native_core_rejects_thread_counts_below_one(name, bad):
    # The inputs are tiny, so a kernel would run them on one thread whatever it is asked:
    # the count is still checked, before any work.
    with pytest.raises(ValueError, match=rf"^n_threads: must be >= 1, got {bad}$"):
        native_calls()[name](bad)


@pytest.mark.parametrize("name", sorted(public_calls()))
def test_none_one_and_two_threads_give_the_same_result(name):
    call = public_calls()[name]

    def value(result):
        if isinstance(result, lmdx.Moments):
            return result.gram()
        return result[0] if isinstance(result, tuple) else result

    reference = value(call(1))
    for n_threads in (None, 2):
        np.testing.assert_array_equal(value(call(n_threads)), reference)


def test_native_core_refuses_positional_arguments():
    # Every call into the native module names its arguments.
    with pytest.raises(TypeError, match=r"incompatible function arguments"):
        core.weighted_average([np.ones(3)], None, 1)


def test_none_is_the_default_thread_count(monkeypatch):
    monkeypatch.setenv("LMDX_NUM_THREADS", "3")
    assert lmdx.default_threads() == 3
    assert lmdx.config()["default_threads"] == 3
    monkeypatch.setenv("LMDX_NUM_THREADS", "0")
    with pytest.raises(ValueError, match=r"^LMDX_NUM_THREADS must be >= 1, got 0"):
        lmdx.spd_solve(np.eye(3), np.ones(3))


def test_max_threads_reports_what_is_available():
    assert core.max_threads() >= 1
    if not core.has_openmp():
        assert core.max_threads() == 1
