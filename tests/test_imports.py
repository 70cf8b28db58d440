"""The package's import graph has no circles (its layers: tests/test_layering.py).

Every ``import`` in ``src/siamesenorm`` counts, wherever it stands: at the top of a module, inside
a function, or under ``if TYPE_CHECKING:``; not under ``if __name__ == "__main__":`` (never run on
import). ``from pkg import name`` is an edge to the module ``pkg.name`` when there is one, else to
``pkg`` (its ``__init__``); importing a module is not an edge to its parent packages.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "siamesenorm"


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def _absolute(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _run_on_import(node: ast.AST):
    """``node`` and every node below it but those under ``if __name__ == "__main__":``."""
    yield node
    for child in ast.iter_child_nodes(node):
        if not (isinstance(child, ast.If) and isinstance(child.test, ast.Compare)
                and isinstance(child.test.left, ast.Name) and child.test.left.id == "__name__"):
            yield from _run_on_import(child)


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Each module of the package in ``root`` -> the modules of the package it imports."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in _run_on_import(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                origin = _absolute(name, path.name == "__init__.py", node)
                targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin
                           for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a closed path of module names, or ``None``."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                found = visit(nxt)
                if found:
                    return found
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            found = visit(start)
            if found:
                return found
    return None


def test_the_finder_sees_a_cycle_and_its_absence():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_reads_every_kind_of_import(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from .b import thing\nfrom . import c\n",
        "b.py": "def f():\n    from .sub import d\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.sub.d import X\n",
        "sub/__init__.py": "from .. import a\n",
        "sub/d.py": "import pkg.b\nfrom ..sub import e\n",
        "sub/e.py": "if __name__ == '__main__':\n    from pkg import a\n",   # a program's, not an edge
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(pkg)
    assert graph["pkg.sub.e"] == set()
    assert graph["pkg.a"] == {"pkg.b", "pkg.c"}          # from .b import name; from . import module
    assert graph["pkg.b"] == {"pkg.sub.d"}               # inside a function
    assert graph["pkg.c"] == {"pkg.sub.d"}               # under TYPE_CHECKING, absolute
    assert graph["pkg.sub"] == {"pkg.a"}                 # a package's __init__, two dots
    assert graph["pkg.sub.d"] == {"pkg.b", "pkg.sub.e"}
    assert find_cycle(graph) == ["pkg.b", "pkg.sub.d", "pkg.b"]


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# The layers and the cycles between packages: tests/test_layering.py.
