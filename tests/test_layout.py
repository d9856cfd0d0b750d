"""Layout rule for the test tree: no module under tests/ imports a ``test_*`` module.

Shared code lives in ``tests/helpers/``; importing a test module from elsewhere blurs what is a
test and what is a helper (and drags that module's tests into the importer's namespace).
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent


def _is_test_module(name: str) -> bool:
    return any(part.startswith("test_") for part in name.split(".") if part)


def _target_dir(path: Path, node: ast.ImportFrom) -> Path:
    """Where ``from X import ...`` points: a package directory, or something that is not one."""
    base = REPO if node.level == 0 else path.parents[node.level - 1]
    return base.joinpath(*(node.module or "").split("."))


def imported_test_modules(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if _is_test_module(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if _is_test_module(module):
                found.append(module)
            elif _target_dir(path, node).is_dir():  # ``from tests import test_x``: names are modules
                found += [module + ("" if module.endswith(".") else ".") + alias.name for alias in node.names
                          if alias.name.startswith("test_")]
    return found


def test_no_module_imports_a_test_module() -> None:
    offenders = {str(path.relative_to(REPO)): found for path in sorted(TESTS.rglob("*.py"))
                 if "__pycache__" not in path.parts and (found := imported_test_modules(path))}
    assert not offenders, f"import shared code from tests.helpers, not from test modules: {offenders}"
