"""The layering of docs/architecture.md, enforced: no import cycle between dist_ckpt modules,
each layer imports only layers below it, and only the tier and storage implementations name
a kind of root. Type-only imports count like any other."""

from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "dist_ckpt"

# bottom to top; a module may import its own layer and the layers below (docs/architecture.md)
LAYERS: list[set[str]] = [
    {"errors", "version", "logs", "progress", "faults", "digests", "marks"},
    {"storage"},
    {"format", "runinfo"},
    {"protocol", "config"},
    {"restart"},
    {"tiers"},
    {"context"},
    {"save", "restore"},
    {"testing", "replay"},
    {"memory"},
    {"lifecycle"},
    {"manager"},
    {"cli", "__init__", "launcher_api", "diff", "export", "integrations"},  # diff, export: offline tools
]
# names that only the tier and storage implementations may use: deciding by the kind of root
KIND_NAMES = {"is_remote", "ObjectStore", "LocalStore", "ObjectStoreTier", "RenameTier"}
KIND_OWNERS = {"tiers", "storage", "config", "memory"}  # config: validates the shape of the URLs it is given


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py")}


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """dist_ckpt modules ``name`` imports, ``TYPE_CHECKING`` blocks and function-local imports
    included: an import made only for a type hint still ties the two modules together."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            for alias in node.names:
                found.add(f"{target}.{alias.name}" if f"{target}.{alias.name}" in known else target)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {m for m in found if m in known and m != name}


def layer_of(module: str) -> int:
    top = module.split(".")[1] if "." in module else "__init__"
    return next(i for i, layer in enumerate(LAYERS) if top.removesuffix(".py") in layer)


def test_every_module_has_a_layer() -> None:
    for name in modules():
        layer_of(name)  # StopIteration names a module nobody placed


def test_no_import_cycle() -> None:
    known = modules()
    graph = {name: imports(name, path, known) for name, path in known.items()}
    state: dict[str, int] = {}
    cycles: list[list[str]] = []

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    assert cycles == []


def test_layers_import_only_downwards() -> None:
    known = modules()
    upward = sorted(f"{name} -> {dep}" for name, path in known.items()
                    for dep in imports(name, path, known) if layer_of(dep) > layer_of(name))
    assert upward == []


def test_only_tiers_and_storage_name_a_kind_of_root() -> None:
    offenders = []
    for name, path in modules().items():
        top = name.split(".")[1] if "." in name else "__init__"
        if top in KIND_OWNERS:
            continue
        used = {n.id for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Name)}
        used |= {a.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.ImportFrom)
                 for a in n.names}
        offenders += [f"{name}: {kind}" for kind in sorted(used & KIND_NAMES)]
    assert offenders == []


MAP = PACKAGE.parent / "docs" / "architecture.md"


def test_every_module_is_in_the_map() -> None:
    """docs/architecture.md names every module of dist_ckpt (relative to the package, e.g.
    ``save/facts.py``) and of the launcher (``launch/runner.py``); package ``__init__`` files
    excepted."""
    text = MAP.read_text()
    named = set(re.findall(r"`([A-Za-z0-9_/]+\.py)`", text))
    launcher = PACKAGE.parent / "launch"
    expected = {str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")}
    expected |= {str(p.relative_to(PACKAGE.parent)) for p in launcher.rglob("*.py")}
    missing = sorted(m for m in expected if not m.endswith("__init__.py") and m not in named)
    assert missing == [], f"modules missing from {MAP.name}: {missing}"


def test_capabilities_are_declared_not_probed() -> None:
    """``shares_objects`` (CommitTier) and ``local_path`` (StoreReader) are on their protocols:
    every implementation declares them, and no module probes for them with getattr."""
    from dist_ckpt.memory.tier import MemoryTier
    from dist_ckpt.storage.local import LocalStore
    from dist_ckpt.storage.objectstore import ObjectStore
    from dist_ckpt.tiers.objectstore import ObjectStoreTier
    from dist_ckpt.tiers.rename import RenameTier

    probe = re.compile(r"getattr\([^)]*[\"'](shares_objects|local_path)[\"']")
    assert [str(p) for p in PACKAGE.rglob("*.py") if probe.search(p.read_text())] == []
    assert (RenameTier.shares_objects, MemoryTier.shares_objects, ObjectStoreTier.shares_objects) == (
        True, True, False)
    assert LocalStore("/tmp").local_path("a") == "/tmp/a"
    assert ObjectStore.local_path(None, "a") is None  # type: ignore[arg-type]


def test_the_manager_is_a_thin_facade() -> None:
    """Issue 40: the manager wires collaborators and keeps the public methods; the save front
    lives in ``save/front.py`` (a manager past 300 lines is taking work back)."""
    lines = (PACKAGE / "manager.py").read_text().count("\n")
    assert lines <= 300, f"manager.py has {lines} lines"
    source = (PACKAGE / "manager.py").read_text()
    for moved in ("def _stage", "def _start", "SaveRequest("):
        assert moved not in source, moved
