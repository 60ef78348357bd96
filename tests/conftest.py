"""Shared test configuration.

Every numeric check in this suite compares lmdx with a float64 NumPy reference written
in the test module itself; nothing here computes an expected value.
"""

from __future__ import annotations

import os
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# The suite runs on small shared machines: few examples, no per-example deadline
# (thread start-up and first-call scratch allocation make timings noisy).
settings.register_profile(
    "lmdx",
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile("lmdx-thorough", parent=settings.get_profile("lmdx"), max_examples=300)
settings.load_profile(os.environ.get("LMDX_HYPOTHESIS_PROFILE", "lmdx"))


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> np.random.Generator:
    """A generator seeded from the test's file and name: reproducible, different per test
    (the folder is left out, so a test keeps its data when its file moves)."""
    path, _, name = request.node.nodeid.partition("::")
    return np.random.default_rng(zlib.crc32(f"tests/{path.rsplit('/', 1)[-1]}::{name}".encode()))


@pytest.fixture(autouse=True)
def _default_threads_from_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests that rely on the default thread count must not see a user's override."""
    monkeypatch.delenv("LMDX_NUM_THREADS", raising=False)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny models: torch's intra-op threads only contend on a 2-core machine."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture
def widen_bf16(monkeypatch: pytest.MonkeyPatch):
    """bfloat16 rows go through the widening Gram kernel in this test (as on a CPU without
    AVX512_BF16), through the same switch a user has: ``LMDX_DISABLE_CPU_FEATURES``."""
    from lmdx import _core

    monkeypatch.setenv("LMDX_DISABLE_CPU_FEATURES", "avx512bf16")
    _core.bf16_dot.cache_clear()
    yield
    monkeypatch.undo()
    _core.bf16_dot.cache_clear()
