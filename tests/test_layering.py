"""The package's layers (docs/tasks.md, "The import graph"): an import reaches its own layer or one
below, never one above, and no cycle joins two units. A unit is a top-level module or package of
siamesenorm, or a leaf module named in full. Every import counts, at the top of a module or inside
a function; those under ``if TYPE_CHECKING:`` (never run) or ``if __name__ == "__main__":`` (run
only as a program, never on import) do not.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src" / "siamesenorm"
PACKAGE = "siamesenorm"         # the unit of the package's own __init__

# Lowest first.
LAYERS = [
    # small pieces every layer uses; train.checkpoint.names is a leaf of constants inside train/
    {"errors", "version", "devices", "locks", "streams", "rundir", "shapes", "compute",
     "train.checkpoint.names"},
    {"functional"},             # the PyTorch math the kernels and the modules share
    {"kernels"},
    {"nn"},
    {"schemes"},
    {"config"},                 # a run's settings, checked (it asks the schemes for their options)
    {"models"},
    {PACKAGE},                  # the public names: ResidualStack, the schemes, the version
    {"data", "diffusion", "eval", "analysis", "parallel", "train"},
    {"hf", "olmo_core"},        # integrations: they host our models; tasks build HF family models
    {"tasks"},
    {"experiments", "run", "demo"},
    {"commands", "cli", "__main__"},
]


@dataclass(frozen=True)
class Import:
    source: str         # the importing module
    target: str         # the imported module (or the package whose name it takes)
    line: int
    lazy: bool          # inside a function


def _modules(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = (root.name, *path.relative_to(root).with_suffix("").parts)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _guard(node: ast.If) -> str | None:
    """``"types"`` for ``if TYPE_CHECKING:``, ``"main"`` for ``if __name__ == "__main__":``."""
    test = node.test
    if isinstance(test, ast.Name | ast.Attribute) and getattr(test, "id", getattr(test, "attr", "")) \
            == "TYPE_CHECKING":
        return "types"
    if isinstance(test, ast.Compare) and isinstance(test.left, ast.Name) and test.left.id == "__name__" \
            and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in test.comparators):
        return "main"
    return None


_FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)


def _import_nodes(node: ast.AST, lazy: bool = False):
    """``(import node, inside a function)`` of ``node``'s tree, skipping the guarded blocks."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, lazy
        elif isinstance(child, ast.If) and _guard(child):
            yield from _import_nodes(ast.Module(body=child.orelse, type_ignores=[]), lazy)
        else:
            yield from _import_nodes(child, lazy or isinstance(child, _FUNCTIONS))


def imports(root: Path = ROOT) -> list[Import]:
    """Every import of the package in ``root`` that runs when its module is imported or called."""
    modules = _modules(root)
    found: list[Import] = []
    for name, path in modules.items():
        package = (name if path.name == "__init__.py" else name.rpartition(".")[0]).split(".")
        for node, lazy in _import_nodes(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = package[: len(package) - node.level + 1] if node.level else []
                origin = ".".join(base + ([node.module] if node.module else []))
                targets = [f"{origin}.{a.name}" if f"{origin}.{a.name}" in modules else origin
                           for a in node.names]
            found.extend(Import(name, t, node.lineno, lazy) for t in targets if t in modules)
    return found


def unit(module: str) -> str:
    """The unit of ``module``: the longest leaf named in :data:`LAYERS`, else its top-level name."""
    parts = module.split(".")[1:]
    if not parts:
        return PACKAGE
    named = set().union(*LAYERS)
    return next((".".join(parts[:n]) for n in range(len(parts), 1, -1) if ".".join(parts[:n]) in named),
                parts[0])


def layer(name: str) -> int:
    return next((i for i, names in enumerate(LAYERS) if name in names), -1)


def problems(found: list[Import]) -> list[str]:
    """What breaks the layering in ``found``: a unit in no layer, an import that climbs, a leaf
    inside a higher package imported at the top of a lower module, and a cycle of units."""
    edges = {(unit(i.source), unit(i.target)): i for i in found if unit(i.source) != unit(i.target)}
    units = {u for edge in edges for u in edge} | {unit(i.source) for i in found}
    out = [f"{u} is in no layer: add it to LAYERS" for u in sorted(units) if layer(u) < 0]
    for (a, b), i in sorted(edges.items()):
        if layer(b) > layer(a) >= 0:
            out.append(f"{i.source}:{i.line} imports {i.target}: {a} (layer {layer(a)}) climbs to "
                       f"{b} (layer {layer(b)})")
    for i in found:       # importing a leaf runs its packages' __init__ first: never at a lower top
        a, b = unit(i.source), unit(i.target)
        if "." in b and not i.lazy and layer(b.split(".")[0]) > layer(a):
            out.append(f"{i.source}:{i.line} imports {i.target} at the top; its package "
                       f"{b.split('.')[0]} sits above {a}: import it inside the function")
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
    cycle = find_cycle(graph)
    if cycle:
        out.append("a cycle of units: " + " -> ".join(cycle))
    return out


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}      # 1: on the path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return None

    return next((c for start in sorted(graph) if start not in state and (c := visit(start))), None)


def test_the_package_imports_only_downwards_and_closes_no_cycle():
    assert problems(imports()) == []


def test_the_walk_sees_what_runs_and_only_that(tmp_path):
    pkg = tmp_path / PACKAGE
    (pkg / "train" / "checkpoint").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "errors.py": "",
        "train/__init__.py": "from ..tasks import x\n",                   # climbs, and closes a cycle
        "train/checkpoint/__init__.py": "",
        "train/checkpoint/names.py": "",
        "tasks.py": ("from typing import TYPE_CHECKING\nfrom .train import y\n"
                     "if TYPE_CHECKING:\n    from .cli import Z\n"
                     "def f():\n    from .cli import main\n"),           # climbs, inside a function
        "rundir.py": "from .train.checkpoint.names import N\n"
                     "def g():\n    from .train.checkpoint import names\n",
        "cli.py": "from . import errors\nif __name__ == '__main__':\n    from .tasks import f\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    found = imports(pkg)
    assert {(i.source, i.target, i.lazy) for i in found} == {
        ("siamesenorm.train", "siamesenorm.tasks", False), ("siamesenorm.tasks", "siamesenorm.train", False),
        ("siamesenorm.tasks", "siamesenorm.cli", True), ("siamesenorm.cli", "siamesenorm.errors", False),
        ("siamesenorm.rundir", "siamesenorm.train.checkpoint.names", False),
        ("siamesenorm.rundir", "siamesenorm.train.checkpoint.names", True)}
    said = "\n".join(problems(found))
    assert f"siamesenorm.train:1 imports siamesenorm.tasks: train (layer {layer('train')}) climbs" in said
    assert f"siamesenorm.tasks:6 imports siamesenorm.cli: tasks (layer {layer('tasks')}) climbs" in said
    assert "siamesenorm.rundir:1 imports siamesenorm.train.checkpoint.names at the top" in said
    assert "siamesenorm.rundir:3" not in said           # the same leaf, inside a function
    assert "a cycle of units: tasks -> train -> tasks" in said
