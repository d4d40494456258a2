"""fdp's imports point down: no cycle, and every module imports only those the module map lists above it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import fdp

PACKAGE = Path(fdp.__file__).parent


def _modules() -> dict[str, Path]:
    """Every module of fdp by dotted name (a package by its ``__init__``)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


def _imports(modules: dict[str, Path]) -> dict[str, set[str]]:
    """The fdp modules each module imports, wherever the import statement stands (functions included).

    ``from fdp.hooks import chain`` imports the package ``fdp.hooks``; ``from fdp import zero``
    the module ``fdp.update.zero``. The implicit import of a module's parent packages is not counted:
    it is how Python finds the module, not a use of the package.
    """
    edges: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                edges[name] |= {alias.name for alias in node.names if alias.name in modules}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([node.module] if node.module else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    if target in modules and target != name:
                        edges[name].add(target)
    return edges


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One import cycle, as the list of modules around it, or ``None``."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)):
            return found
    return None


def _layers() -> dict[str, int]:
    """Each top-level module's line in the module map of ``fdp/__init__.py`` (the ground first)."""
    layers = {}
    for line_number, line in enumerate(doc_line for doc_line in fdp.__doc__.splitlines() if doc_line.startswith("* ")):
        for name in re.findall(r"``(\w+)``:", line) + re.findall(r"``(\w+)`` /", line):
            layers[name] = line_number
    return layers


def _top(module: str) -> str:
    return module.split(".")[1] if module != "fdp" else "fdp"


def test_the_cycle_finder_finds_a_cycle():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_fdp_has_no_import_cycle():
    cycle = _cycle(_imports(_modules()))
    assert cycle is None, f"import cycle: {' -> '.join(cycle)}"


def test_the_module_map_names_every_module():
    tops = {_top(name) for name in _modules() if name != "fdp"}
    assert tops - set(_layers()) == set(), "modules missing from the map in fdp/__init__.py"
    assert set(_layers()) - tops == set(), "the map names modules that do not exist"


def test_every_import_points_to_a_module_listed_above():
    layers, upward = _layers(), []
    for name, targets in _imports(_modules()).items():
        if name == "fdp":
            continue
        for target in targets:
            if target != "fdp" and _top(target) != _top(name) and layers[_top(target)] > layers[_top(name)]:
                upward.append(f"{name} imports {target}")
    assert upward == [], "imports that point up the module map: " + "; ".join(sorted(upward))
