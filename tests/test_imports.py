"""The package's import graph has no circles, and its layers point down.

Every ``import`` in ``src/siamesenorm`` counts, wherever it stands: at the top of a module, inside
a function, or under ``if TYPE_CHECKING:``. ``from pkg import name`` is an edge to the module
``pkg.name`` when there is one, else to ``pkg`` (its ``__init__``); importing a module is not an
edge to its parent packages.
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


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Each module of the package in ``root`` -> the modules of the package it imports."""
    modules = _modules(root)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
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
        "sub/e.py": "",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    graph = import_graph(pkg)
    assert graph["pkg.a"] == {"pkg.b", "pkg.c"}          # from .b import name; from . import module
    assert graph["pkg.b"] == {"pkg.sub.d"}               # inside a function
    assert graph["pkg.c"] == {"pkg.sub.d"}               # under TYPE_CHECKING, absolute
    assert graph["pkg.sub"] == {"pkg.a"}                 # a package's __init__, two dots
    assert graph["pkg.sub.d"] == {"pkg.b", "pkg.sub.e"}
    assert find_cycle(graph) == ["pkg.b", "pkg.sub.d", "pkg.b"]


def test_the_package_has_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


# The layers, lowest first: a module may import its own layer and the ones below, never above.
LAYERS = [
    {"errors", "devices", "rundir", "locks", "shapes", "streams"},
    {"nn", "data", "kernels"},
    {"schemes", "config"},
    {"models"},
    # hf's decoder families with any scheme: below the tasks, which build them (model.family)
    {"diffusion", "eval", "hf.families", "hf.common", "hf.adapted", "hf.family_lm", "hf.standalone",
     "hf.vendoring"},
    {"analysis"},               # a library below the tasks and the engine
    {"parallel"},               # processes, sharding and sharded checkpoints (torch.distributed)
    {"train"},
    {"tasks"},
    {"run", "experiments", "demo", "hf", "olmo_core"},   # integrations: transformers, OLMo-core
    {"cli", "__main__"},
]


def _layer(module: str) -> int:
    """The layer of ``module``: the one naming its subpackage or module (``hf.adapted``), else the
    one naming its top-level package (``hf``)."""
    parts = module.split(".")[1:] or ["__init__"]
    for name in (".".join(parts[:2]), parts[0]):
        for i, names in enumerate(LAYERS):
            if name in names:
                return i
    return -1


def test_every_package_sits_in_a_layer_and_imports_only_downwards():
    graph = import_graph()
    unplaced = sorted({m.split(".")[1] for m in graph if "." in m and _layer(m) < 0})
    assert not unplaced, f"add these to LAYERS: {unplaced}"
    upward = sorted(f"{m} -> {t}" for m, ts in graph.items() if "." in m for t in ts
                    if "." in t and _layer(t) > _layer(m))
    assert not upward, upward
