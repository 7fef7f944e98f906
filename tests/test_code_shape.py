"""The library's rooms stay small enough to read: no module over 500 lines, no function over 80,
no class with more than 16 attributes. Read from the sources' syntax trees, as the layering test
reads imports; the limits are the architecture brief's (a file that grows past ~400 lines gets
split along a seam a reader would name)."""

from __future__ import annotations

import ast

from tests.test_layers import ROOT, project_modules

MAX_MODULE_LINES = 500
MAX_FUNCTION_LINES = 80
MAX_CLASS_ATTRIBUTES = 16


def long_functions(tree: ast.AST) -> dict[str, int]:
    return {
        f"{node.name}:{node.lineno}": length
        for node in ast.walk(tree)
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and (length := node.end_lineno - node.lineno + 1) > MAX_FUNCTION_LINES
    }


def class_attributes(node: ast.ClassDef) -> set[str]:
    """Fields declared in the class body (annotated or assigned, constants excepted) and every
    ``self.NAME = ...`` in its methods."""
    names = set()
    for statement in node.body:
        if isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name):
            names.add(statement.target.id)
        elif isinstance(statement, ast.Assign):
            names |= {t.id for t in statement.targets if isinstance(t, ast.Name) and not t.id.isupper()}
    for sub in ast.walk(node):
        targets = sub.targets if isinstance(sub, ast.Assign) else [sub.target] if isinstance(sub, ast.AnnAssign) else []
        for target in targets:
            if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self":
                names.add(target.attr)
    return names


def crowded_classes(tree: ast.AST) -> dict[str, int]:
    return {
        f"{node.name}:{node.lineno}": len(names)
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and len(names := class_attributes(node)) > MAX_CLASS_ATTRIBUTES
    }


def shapes() -> tuple[dict, dict, dict]:
    modules, functions, classes = {}, {}, {}
    for path, _, _ in project_modules():
        source = path.read_text()
        name = str(path.relative_to(ROOT))
        if (lines := len(source.splitlines())) > MAX_MODULE_LINES:
            modules[name] = lines
        tree = ast.parse(source)
        functions |= {f"{name}:{key}": n for key, n in long_functions(tree).items()}
        classes |= {f"{name}:{key}": n for key, n in crowded_classes(tree).items()}
    return modules, functions, classes


def test_no_module_is_over_500_lines() -> None:
    assert shapes()[0] == {}


def test_no_function_is_over_80_lines() -> None:
    assert shapes()[1] == {}


def test_no_class_has_more_than_16_attributes() -> None:
    assert shapes()[2] == {}


def test_the_checks_find_what_they_look_for() -> None:
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    assert long_functions(ast.parse(f"def f():\n{body}\n")) == {"f:1": MAX_FUNCTION_LINES + 1}
    assert long_functions(ast.parse("def f():\n    pass\n")) == {}
    fields = "\n".join(f"    a{i}: int" for i in range(10))
    init = "\n".join(f"        self.b{i} = {i}" for i in range(7))
    crowded = f"class C:\n    LIMIT = 3\n{fields}\n    def __init__(self):\n{init}\n"
    assert crowded_classes(ast.parse(crowded)) == {"C:1": 17}
    assert crowded_classes(ast.parse(crowded.replace("        self.b6 = 6\n", ""))) == {}
