"""The command line and the core demo (docs/guide/precision.md) run as documented."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import lmdx
from lmdx.cli import main

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "core_demo.py"


def test_info_prints_the_configuration(capsys) -> None:
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"simd_path: {lmdx.config()['simd_path']}" in out
    assert f"version: {lmdx.__version__}" in out
    bf16 = lmdx.config()["gram_paths"]["bfloat16"]
    assert f"gram_paths: float32 fma, float64 fma, bfloat16 {bf16}, float16 widened" in out


def test_no_command_prints_usage_and_fails(capsys) -> None:
    assert main([]) == 2
    assert "usage: lmdx" in capsys.readouterr().err


def test_python_dash_m_lmdx_info() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lmdx", "info"], capture_output=True, text=True, check=True
    )
    assert "openmp:" in done.stdout


def test_core_demo_regmean_beats_averaging() -> None:
    done = subprocess.run(
        [sys.executable, str(EXAMPLE)], capture_output=True, text=True, check=True, timeout=300
    )
    means = {}
    for line in done.stdout.splitlines():
        match = re.match(r"^(average|regmean|pre-trained)\s+((?:[-\d.]+\s*)+)$", line)
        if match:
            means[match.group(1)] = float(match.group(2).split()[-1])
    assert set(means) == {"average", "regmean", "pre-trained"}, done.stdout
    assert means["regmean"] < means["average"], done.stdout
