"""A process forked after lmdx (and torch) ran multi-threaded kernels does not hang.

GNU OpenMP waits for ever in a forked child for the parent's pool threads; lmdx runs its
kernels on one thread in a forked child (lmdx.config), so the child finishes with the right
answer. The parent and child run in a subprocess so a hang fails the test by its timeout
instead of stopping the suite.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")

SCRIPT = """
import json, os, sys, time
import numpy as np
order = sys.argv[1]
if order == "torch-first":
    import torch, lmdx
else:
    import lmdx, torch
x = np.random.default_rng(0).standard_normal((3000, 120)).astype(np.float32)
a = torch.randn(300, 300, dtype=torch.float64)

def run():
    gram = lmdx.Moments(120).update(x, n_threads=2).gram()
    product = (a @ a).numpy()
    return gram, product

run()  # the parent's OpenMP pools exist now
read, write = os.pipe()
pid = os.fork()
if pid == 0:
    os.close(read)
    torch.set_num_threads(1)  # torch's own rule for forked workers (its DataLoader)
    gram, product = run()
    ref = x.astype(np.float64).T @ x.astype(np.float64)
    a64 = a.numpy()
    out = {"gram_err": float(np.abs(gram - ref).max() / np.abs(ref).max()),
           "product_err": float(np.abs(product - a64 @ a64).max()),
           "threads": lmdx.default_threads()}
    os.write(write, json.dumps(out).encode())
    os._exit(0)
os.close(write)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        print(os.read(read, 10000).decode())
        sys.exit(status)
    time.sleep(0.05)
os.kill(pid, 9)
sys.exit("the forked child hung")
"""


@pytest.mark.parametrize("order", ["torch-first", "lmdx-first"])
def test_fork_after_threaded_kernels_does_not_hang(order):
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT, order], capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.splitlines()[-1])
    assert out["gram_err"] <= 1e-6
    assert out["product_err"] <= 1e-9
    assert out["threads"] == 1
