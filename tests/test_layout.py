"""The package's house rules that an import-linter contract cannot state: no module imports
a private name of another module, and private modules are only the shared floor.

(The layering itself — every import pointing down cli → merge | lmd → stats → files |
data → kernel wrappers → floor — is the contract in pyproject.toml, run by .ci/run.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "python" / "lmdx"
#: The shared floor: private modules every part of lmdx may import (their public names);
#: _core_baseline is the compiled core itself, imported for its types by _core.
FLOOR = {"_core", "_core_baseline", "_errors", "_tensors", "_util", "_ray"}


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _private_imports(path: Path) -> list[str]:
    """Imports in ``path`` of a private name, or of a private module off the floor."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            parts = (node.module or "").split(".")
            modules = [p for p in parts if p.startswith("_") and not p.startswith("__")]
            found += [f"from {node.module} (line {node.lineno})" for p in modules if p not in FLOOR]
            for alias in node.names:
                name = alias.name
                if name.startswith("_") and not name.startswith("__") and name not in FLOOR:
                    found.append(f"{name} from {node.module or '.'} (line {node.lineno})")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                for p in alias.name.split("."):
                    if p.startswith("_") and not p.startswith("__") and p not in FLOOR:
                        found.append(f"import {alias.name} (line {node.lineno})")
    return found


def test_the_package_is_where_the_tests_expect_it():
    assert (PACKAGE / "__init__.py").is_file() and len(_modules()) > 20


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_module_imports_a_private_name_of_another(path: Path):
    assert _private_imports(path) == []


def test_the_check_finds_a_private_import(tmp_path: Path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from .merge import _coefficients\nfrom ._util import progress_bar\n"
        "from .stats import _private_module\nimport lmdx.stats._hidden\n"
    )
    assert _private_imports(bad) == [
        "_coefficients from merge (line 1)",
        "_private_module from stats (line 3)",
        "import lmdx.stats._hidden (line 4)",
    ]
