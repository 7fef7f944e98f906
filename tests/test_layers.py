"""The layers import only downward: wire (``peer``) < ``dht`` < ``averaging`` < ``moe`` < daemon
(``peerd``). Read from the sources' syntax trees, without importing anything, so that an
upward import fails here even where it sits inside a function and never runs in the tests."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("peer", "dht", "averaging", "moe", "peerd")
FLOORS = {"peer": 0, "dht": 1, "averaging": 2, "moe": 3, "peerd": 4}
FLOOR_NAMES = {floor: name if name != "peer" else "peer (wire)" for name, floor in FLOORS.items()}


def floor_of(module: str) -> int | None:
    """The floor of a dotted module name of this project, or None for anything else."""
    return FLOORS.get(module.split(".")[0])


def imported_modules(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> list[str]:
    """Absolute names of what ``node`` imports, relative imports resolved against ``module``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if node.level == 0:
        base = node.module or ""
    else:
        parts = module.split(".")
        if not is_package:
            parts = parts[:-1]
        parts = parts[: len(parts) - (node.level - 1)]
        base = ".".join(parts + ([node.module] if node.module else []))
    # ``from .. import moe`` names a package by the name it binds
    return [alias.name if base == "" else base for alias in node.names]


def is_function_local(tree: ast.AST, target: ast.AST) -> bool:
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(sub is target for sub in ast.walk(node)):
            return True
    return False


def layering_violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """Every import in ``source`` (the module ``module``) that points to a higher floor, and every
    function-local import of a project module that does not say it keeps torch out (the only
    reason such an import is allowed)."""
    own = floor_of(module)
    tree = ast.parse(source)
    lines = source.splitlines()
    problems = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        for target in imported_modules(node, module, is_package):
            floor = floor_of(target)
            if floor is None:
                continue
            if floor > own:
                problems.append(
                    f"{module}:{node.lineno} imports {target}: {FLOOR_NAMES[own]} may not import {FLOOR_NAMES[floor]}"
                )
            elif is_function_local(tree, node):
                if "torch" not in import_block_text(lines, node):
                    problems.append(f"{module}:{node.lineno} imports {target} inside a function without saying why")
    return list(dict.fromkeys(problems))


def import_block_text(lines: list[str], node: ast.stmt) -> str:
    """The import's own lines and the run of imports, comments and blank lines just above it: one
    comment may explain a group of function-local imports."""
    first = node.lineno - 1
    while first > 0 and (
        lines[first - 1].strip() == "" or lines[first - 1].lstrip().startswith(("#", "import ", "from "))
    ):
        first -= 1
    return "\n".join(lines[first : node.end_lineno])


def project_modules():
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            relative = path.relative_to(ROOT).with_suffix("")
            is_package = relative.name == "__init__"
            parts = relative.parts[:-1] if is_package else relative.parts
            yield path, ".".join(parts), is_package


def test_every_import_points_down() -> None:
    problems = []
    for path, module, is_package in project_modules():
        problems += layering_violations(path.read_text(), module, is_package)
    assert problems == []


def test_upward_and_unexplained_imports_are_found() -> None:
    """The checker itself: each kind of violation in a made-up module is reported."""
    assert layering_violations("from averaging import Averager\n", "dht.node") == [
        "dht.node:1 imports averaging: dht may not import averaging"
    ]
    assert layering_violations("from peerd.cli import main\n", "peer.rpc") == [
        "peer.rpc:1 imports peerd.cli: peer (wire) may not import peerd"
    ]
    assert layering_violations("import peerd\n", "peer.host") == [
        "peer.host:1 imports peerd: peer (wire) may not import peerd"
    ]
    assert layering_violations("from peerd.daemon import Daemon\n", "averaging.optimizer") == [
        "averaging.optimizer:1 imports peerd.daemon: averaging may not import peerd"
    ]
    assert layering_violations("from .. import moe\n", "dht.node") == ["dht.node:1 imports moe: dht may not import moe"]
    assert layering_violations("import moe.server\n", "averaging.optimizer") == [
        "averaging.optimizer:1 imports moe.server: averaging may not import moe"
    ]
    local = "def f():\n    from dht import DHTNode\n"
    assert layering_violations(local, "moe.client") == ["moe.client:2 imports dht inside a function without saying why"]
    explained = "def f():\n    from .server import serve  # torch loads only when serving\n"
    assert layering_violations(explained, "moe.hosting") == []
    assert layering_violations("from dht import DHTNode\nfrom peer import PeerHost\n", "moe.client") == []
    assert layering_violations("from .tasks import Task\n", "peerd.training") == []


def test_the_packages_import_without_cycles_and_the_wire_without_the_daemon() -> None:
    import subprocess
    import sys

    above_the_wire = "('peerd', 'dht', 'averaging', 'moe')"
    code = (
        f"import sys, peer; assert not [m for m in sys.modules if m.startswith({above_the_wire})]; "
        "import dht, averaging, moe, peerd.cli"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def wire_import_graph() -> dict[str, set[str]]:
    """Each module of the wire (``peer``) and the wire modules it imports, type-checking imports
    included: a circle is a circle whether or not it runs. Packages' ``__init__`` re-exports are
    left out (a package imports its own modules by design)."""
    modules = {module: (path, is_package) for path, module, is_package in project_modules() if floor_of(module) == 0}
    graph: dict[str, set[str]] = {}
    for module, (path, is_package) in modules.items():
        if is_package:
            continue
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in imported_modules(node, module, is_package):
                    # ``from . import rpc`` names a module the package holds
                    named = (
                        [f"{target}.{alias.name}" for alias in node.names] if isinstance(node, ast.ImportFrom) else []
                    )
                    for candidate in [target, *named]:
                        if candidate in modules and not modules[candidate][1]:
                            targets.add(candidate)
        graph[module] = targets - {module}
    return graph


def import_circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each module that lies on any (depth-first, in sorted order)."""
    circles, done = [], set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            circles.append(path[path.index(module) :] + [module])
            return
        if module in done:
            return
        for target in sorted(graph.get(module, ())):
            visit(target, path + [module])
        done.add(module)

    for module in sorted(graph):
        visit(module, [])
    return circles


def test_no_circle_among_the_wires_modules() -> None:
    assert import_circles(wire_import_graph()) == []


def test_a_circle_is_found() -> None:
    assert import_circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c", "a"]]
    assert import_circles({"a": {"b"}, "b": set()}) == []
