"""Where each library module's tests are: ``tests/INDEX.md``, made from the tests themselves.

A test file counts for a module when it imports it (directly, or a name its package re-exports
from it) or names it (``peerd/runner.py`` or ``peerd.runner``: tests that drive a module through a
``peerd`` process say which one). Read from the sources, nothing imported. Run as ``python -m
tests.support.module_index`` to write the index; ``tests/test_module_index.py`` fails when it is
stale or when a module has no test at all."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INDEX = ROOT / "tests" / "INDEX.md"
PACKAGES = ("peer", "dht", "averaging", "moe", "peerd")


def library_modules() -> list[str]:
    return [
        ".".join(path.relative_to(ROOT).with_suffix("").parts)
        for package in PACKAGES
        for path in sorted((ROOT / package).glob("*.py"))
        if path.stem not in ("__init__", "__main__")
    ]


def definitions(modules: list[str]) -> dict[str, dict[str, str]]:
    """For each module (and package), name -> the library module that defines it, following
    ``from .x import Name`` re-exports (``from peerd.tasks import ShardSpec`` is task_types')."""
    imports: dict[str, dict[str, str]] = {}
    for module in modules + list(PACKAGES):
        path = ROOT / (module.replace(".", "/") + ("/__init__.py" if module in PACKAGES else ".py"))
        package = module if module in PACKAGES else module.rsplit(".", 1)[0]
        imports[module] = {
            alias.asname or alias.name: f"{package}.{node.module}"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
            for alias in node.names
        }

    def origin(module: str, name: str, depth: int = 0) -> str:
        source = imports.get(module, {}).get(name)
        return module if source is None or depth > 8 else origin(source, name, depth + 1)

    return {module: {name: origin(module, name) for name in names} for module, names in imports.items()}


def modules_of(source: str, modules: set[str], exported: dict[str, dict[str, str]]) -> set[str]:
    """The library modules that a test's ``source`` imports or names."""
    hits = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            hits |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module in modules:
                hits.add(node.module)
            for alias in node.names:
                if f"{node.module}.{alias.name}" in modules:
                    hits.add(f"{node.module}.{alias.name}")
                elif alias.name in exported.get(node.module, {}):
                    hits.add(exported[node.module][alias.name])
    for match in re.finditer(r"\b(peer|dht|averaging|moe|peerd)[./](\w+)(?:\.py)?\b", source):
        name = f"{match.group(1)}.{match.group(2)}"
        if name in modules:
            hits.add(name)
    return hits


def index() -> dict[str, list[str]]:
    modules = library_modules()
    exported = definitions(modules)
    result: dict[str, list[str]] = {module: [] for module in modules}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        for module in modules_of(path.read_text(), set(modules), exported):
            result[module].append(str(path.relative_to(ROOT / "tests")))
    return result


def render(found: dict[str, list[str]]) -> str:
    lines = [
        "# Where each module's tests are",
        "",
        "Made by `python -m tests.support.module_index` from the tests' imports and the modules they",
        "name; `tests/test_module_index.py` fails when this is stale. A test named after its module",
        "comes first.",
        "",
    ]
    package = None
    for module, tests in found.items():
        if module.split(".")[0] != package:
            package = module.split(".")[0]
            lines += [f"## {package}/", ""]
        stem = "test_" + module.split(".")[1]
        ordered = sorted(tests, key=lambda test: (Path(test).stem not in (stem, f"test_{package}_{stem[5:]}"), test))
        lines.append(f"- `{module.replace('.', '/')}.py`: " + (", ".join(ordered) if ordered else "**no test**"))
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    INDEX.write_text(render(index()))
    print(f"wrote {INDEX.relative_to(ROOT)}")
