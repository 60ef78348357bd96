"""A merge method installed as a package, as a user would install one: a tiny package
declaring an entry point in the group ``lmdx.merge_methods`` is built and installed with
pip into a folder of its own, and ``lmdx merge`` run in a new process that sees that
folder finds it (no launcher, no import in lmdx), lists it in its help, checks its option
and merges with it. The reference is NumPy in float64 on the tensors as saved.

The package also declares a method whose module is missing: it is shown as not loaded,
asking for it is one line saying why, and it takes nothing from the other methods.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import hf_models as H
import numpy as np
import pytest
from safetensors.numpy import load_file

pytestmark = pytest.mark.usefixtures("one_torch_thread")

PLUGIN = '''
"""A merge method outside lmdx: per entry, the midpoint of the models' range."""

from typing import Annotated, ClassVar

import numpy as np
from pydantic import Field

from lmdx.merge import MergeMethod, NoOptions


class MidrangeOptions(NoOptions):
    shrink: Annotated[
        float,
        Field(
            ge=0.0,
            le=1.0,
            description="factor applied to the midpoint",
            json_schema_extra={"label": "must be in [0, 1]"},
        ),
    ] = 1.0


class Midrange(MergeMethod):
    name: ClassVar[str] = "midrange"
    summary: ClassVar[str] = "per entry, shrink x (max + min) / 2 of the models"
    options: ClassVar[type[NoOptions]] = MidrangeOptions
    headline: ClassVar[tuple[str, ...]] = ("shrink",)

    def tensor(self, name, tensors, inputs):
        x = np.stack([np.asarray(t, dtype=np.float64) for t in tensors])
        shrink = inputs.options.own(MidrangeOptions).shrink
        return shrink * (x.max(axis=0) + x.min(axis=0)) / 2
'''

PYPROJECT = """
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "lmdx-midrange"
version = "1.0"

[project.entry-points."lmdx.merge_methods"]
midrange = "lmdx_midrange:Midrange"
broken = "lmdx_midrange_missing:Broken"

[tool.setuptools]
py-modules = ["lmdx_midrange"]
"""


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The package built and installed by pip into a folder of its own; the environment
    of a process that sees it."""
    root = tmp_path_factory.mktemp("plugin")
    (root / "pkg").mkdir()
    (root / "pkg" / "pyproject.toml").write_text(textwrap.dedent(PYPROJECT))
    (root / "pkg" / "lmdx_midrange.py").write_text(textwrap.dedent(PLUGIN))
    site = root / "site"
    pip = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"]
    pip += ["--no-build-isolation", "--target", str(site), str(root / "pkg")]
    done = subprocess.run(pip, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (site / "lmdx_midrange.py").is_file()
    paths = [str(site), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths), "HF_HUB_OFFLINE": "1"}


def _lmdx(env: dict[str, str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmdx", *argv], capture_output=True, text=True, env=env, timeout=600
    )


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    root = tmp_path_factory.mktemp("midrange-models")
    _, models, _ = H.cached_family("bert")
    paths = []
    for i, m in enumerate(models):
        m.save_pretrained(root / f"m{i}")
        paths.append(root / f"m{i}")
    return paths


def test_an_installed_method_merges_through_lmdx_merge(installed, folders, tmp_path):
    config = tmp_path / "midrange.yaml"
    models = "\n".join(f"  - {p}" for p in folders)
    config.write_text(
        f"method: midrange\nshrink: 0.5\nheads: {{patterns: ['classifier.*']}}\nmodels:\n{models}\n"
    )
    out = tmp_path / "merged"
    done = _lmdx(installed, "merge", str(config), "--out", str(out), "--no-progress")
    assert done.returncode == 0, done.stderr[-3000:]
    assert "lmdx merge: midrange (shrink 0.5) of 3 models" in done.stdout
    merged = load_file(str(out / "model.safetensors"))
    states = [load_file(str(m / "model.safetensors")) for m in folders]
    checked = 0
    for name, value in merged.items():
        if name.startswith("classifier.") or not np.issubdtype(value.dtype, np.floating):
            continue
        x = np.stack([s[name].astype(np.float64) for s in states])
        expected = 0.5 * (x.max(axis=0) + x.min(axis=0)) / 2
        np.testing.assert_allclose(value, expected, rtol=1e-6, atol=1e-7, err_msg=name)
        checked += 1
    assert checked > 10
    record = json.loads((out / "lmdx_merge.json").read_text())
    assert record["report"]["method"] == "midrange" and record["report"]["shrink"] == 0.5
    assert "per entry, shrink x (max + min) / 2 of the models" in (out / "README.md").read_text()


def test_its_help_option_checks_and_a_method_that_cannot_load(installed, folders, tmp_path):
    done = _lmdx(installed, "methods")
    assert done.returncode == 0, done.stderr[-3000:]
    text = " ".join(done.stdout.split())
    assert "midrange: per entry, shrink x (max + min) / 2 of the models" in text
    assert "shrink (default 1.0): factor applied to the midpoint" in text
    assert "broken: not loaded: merge method 'broken' installed by lmdx-midrange" in text
    assert "ModuleNotFoundError" in text

    config = tmp_path / "bad.yaml"
    config.write_text(f"method: midrange\nshrink: 2\nmodels: [{folders[0]}, {folders[1]}]\n")
    done = _lmdx(installed, "merge", str(config), "--out", str(tmp_path / "no"))
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"lmdx merge: error: config {config}: shrink must be in [0, 1], got 2"
    ]
    config.write_text(f"method: broken\nmodels: [{folders[0]}, {folders[1]}]\n")
    done = _lmdx(installed, "merge", str(config), "--out", str(tmp_path / "no"))
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert "merge method 'broken' installed by lmdx-midrange" in line
    assert "could not be loaded (ModuleNotFoundError" in line and "fix or uninstall" in line
    assert not (tmp_path / "no").exists()
