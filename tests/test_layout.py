"""The package's house rules that an import-linter contract cannot state: no module imports
a private name of another module, and private modules are only the shared floor; and the
layers inside lmdx.merge hold for the imports made for type checking too.

(The layering itself — every import pointing down cli → merge | lmd → stats → files |
data → kernel wrappers → floor, and the floors of lmdx.merge — is the contract in
pyproject.toml, run by .ci/run.)
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: import-linter's own dependency
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "python" / "lmdx"
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


def _merge_contract_with_type_checking(folder: Path) -> Path:
    """pyproject.toml's contract of lmdx.merge's layers as an import-linter configuration
    that counts the imports under ``if TYPE_CHECKING:`` too (the project's own
    configuration leaves them out for the compiled core's stub, whose import is recorded
    as one of the whole package: it is ignored here)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))
    (contract,) = [
        c for c in config["tool"]["importlinter"]["contracts"] if c["name"] == "lmdx.merge layers"
    ]
    lines = [
        "[importlinter]",
        "root_package = lmdx",
        "exclude_type_checking_imports = false",
        "",
        "[importlinter:contract:merge]",
        f"name = {contract['name']} (TYPE_CHECKING imports included)",
        "type = layers",
        f"containers = {' '.join(contract['containers'])}",
        f"exhaustive = {str(contract.get('exhaustive', False)).lower()}",
        "ignore_imports = lmdx._core -> lmdx",
        "layers =",
        *(f"    {layer}" for layer in contract["layers"]),
    ]
    path = folder / "importlinter.ini"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_merge_layers_hold_with_type_checking_imports(tmp_path: Path):
    """No module of lmdx.merge imports a higher floor, not even for its annotations: the
    method's ground floor names no method, engine or registry."""
    config = _merge_contract_with_type_checking(tmp_path)
    lint = Path(sys.executable).with_name("lint-imports")
    out = subprocess.run(
        [str(lint), "--config", str(config), "--no-cache"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "KEPT" in out.stdout
