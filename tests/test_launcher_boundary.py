"""The boundary between the launcher and the library: ``launch/`` imports nothing of dist_ckpt but
``dist_ckpt.launcher_api``, and no other dist_ckpt module spells the launcher's layout names."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

from dist_ckpt import launcher_api

REPO = Path(__file__).resolve().parents[1]
API = "dist_ckpt.launcher_api"
LAYOUT_NAMES = {launcher_api.RUNS_DIR, launcher_api.CURRENT_NAME, launcher_api.STARTS_DIR,
                launcher_api.STOP_NAME, launcher_api.LAUNCH_LOG_NAME}


def dist_ckpt_imports(tree: ast.AST) -> list[str]:
    """Every dist_ckpt module or name ``tree`` imports, anywhere (``TYPE_CHECKING`` blocks and
    function bodies too), spelled ``module`` or ``module:name``; ``import_module`` calls with
    a literal name count as imports."""
    found: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [f"{node.module}:{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and ast.unparse(node.func).split(".")[-1] in ("import_module", "__import__"):
            found.append(str(node.args[0].value))
    return [name for name in found if name.split(":")[0].split(".")[0] == "dist_ckpt"]


def outside_the_api(imports: list[str]) -> list[str]:
    return [name for name in imports if name not in (API, f"dist_ckpt:{API.split('.')[1]}")
            and not name.startswith(f"{API}:")]


def docstrings(tree: ast.AST) -> set[int]:
    nodes = [tree, *(n for n in ast.walk(tree)
                     if isinstance(n, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef))]
    return {id(body[0].value) for body in (getattr(n, "body", []) for n in nodes)
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)}


def layout_literals(tree: ast.AST) -> list[str]:
    """String literals (f-string parts included, docstrings not) that name a part of the
    launcher's layout: a path component equal to one of its names, or its log's name."""
    skip = docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip:
            parts = set(node.value.split("/"))
            if parts & LAYOUT_NAMES or "launch-log" in node.value:
                found.append(node.value)
    return found


def test_the_checks_see_what_they_look_for() -> None:
    source = ("import dist_ckpt.runinfo\nfrom dist_ckpt import launcher_api, errors\n"
              "from dist_ckpt.launcher_api import RUNS_DIR\nif TYPE_CHECKING:\n"
              "    from dist_ckpt.memory.paths import run_dir\n"
              "def f():\n    importlib.import_module('dist_ckpt.lifecycle.done')\n")
    assert sorted(outside_the_api(dist_ckpt_imports(ast.parse(source)))) == [
        "dist_ckpt.lifecycle.done", "dist_ckpt.memory.paths:run_dir", "dist_ckpt.runinfo", "dist_ckpt:errors"]
    source = ('"""runs/<id> in a docstring is prose."""\n'
              'A = "launch-log.jsonl"\nB = f"{r}/runs/{i}"\nC = "runs"\n')
    assert sorted(layout_literals(ast.parse(source))) == ["/runs/", "launch-log.jsonl", "runs"]


def test_launch_imports_only_the_launcher_api() -> None:
    offenders = {str(path.relative_to(REPO)): outside
                 for path in sorted((REPO / "launch").rglob("*.py"))
                 if (outside := outside_the_api(dist_ckpt_imports(ast.parse(path.read_text()))))}
    assert offenders == {}


def test_only_the_launcher_api_spells_the_launcher_layout() -> None:
    api_path = REPO / "dist_ckpt" / "launcher_api.py"
    offenders = {str(path.relative_to(REPO)): found
                 for path in sorted((REPO / "dist_ckpt").rglob("*.py")) if path != api_path
                 if (found := layout_literals(ast.parse(path.read_text())))}
    assert offenders == {}


def test_the_launcher_api_does_not_import_torch() -> None:
    """Persist at breakpoint included (``memory/breakpoint.py``): the launcher's own module
    stays torch-free."""
    code = ("import sys, dist_ckpt.launcher_api as api; assert callable(api.persist_memory); "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                          cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)))
    assert done.stdout.strip() == "[]"
