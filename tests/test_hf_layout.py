"""Hugging Face support is one package, ``siamesenorm.hf``, with one table of the supported decoder
families (``hf/families.py: FAMILIES``) and one copy of what its two kinds of model share
(``hf/common.py``). Read from the source with :mod:`ast`; needs no transformers."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from siamesenorm.hf.families import FAMILIES, FAMILY_NAMES

SRC = Path(__file__).resolve().parents[1] / "src" / "siamesenorm"


def _trees() -> dict[str, ast.Module]:
    return {path.relative_to(SRC).as_posix(): ast.parse(path.read_text(encoding="utf-8"), str(path))
            for path in sorted(SRC.rglob("*.py"))}


def _where(found: list[tuple[str, int]]) -> str:
    return ", ".join(f"{path}:{line}" for path, line in found)


def family_lists(trees: dict[str, ast.Module], names: set[str]) -> list[tuple[str, int]]:
    """Where a literal list, tuple, set or dict (its keys) names two or more of ``names``."""
    found = []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
                items = node.elts
            elif isinstance(node, ast.Dict):
                items = [k for k in node.keys if k is not None]
            else:
                continue
            named = {i.value for i in items if isinstance(i, ast.Constant) and i.value in names}
            if len(named) >= 2:
                found.append((path, node.lineno))
    return found


def test_the_finder_sees_every_kind_of_literal_list():
    trees = {"a.py": ast.parse('X = ["llama", "olmo"]\nY = {"llama": 1, "qwen3": 2}\n'
                               'if f in ("qwen3_moe", "olmoe"):\n    pass\nZ = {"llama", "x"}\n'
                               'W = f == "olmoe"\n')}
    assert family_lists(trees, set(FAMILY_NAMES)) == [("a.py", 1), ("a.py", 2), ("a.py", 3)]


def test_the_families_are_listed_in_one_table():
    assert FAMILY_NAMES == tuple(FAMILIES) and len(FAMILIES) >= 2
    found = family_lists(_trees(), set(FAMILIES))
    assert len(found) == 1 and found[0][0] == "hf/families.py", (
        f"the supported families are listed at {_where(found)}; list them only in "
        f"hf/families.py's FAMILIES and read that table elsewhere")


def test_the_families_package_is_gone():
    assert not (SRC / "families").exists()
    assert importlib.util.find_spec("siamesenorm.families") is None


def test_what_the_two_models_share_is_written_once():
    trees = _trees()
    base_config, probes, checkpointing = [], [], []
    for path, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "transformers" and any(
                    a.name in ("PreTrainedConfig", "PretrainedConfig") for a in node.names):
                base_config.append((path, node.lineno))
            elif (isinstance(node, ast.Compare) and isinstance(node.left, ast.Constant)
                  and node.left.value == "cache" and isinstance(node.ops[0], ast.In)):
                probes.append((path, node.lineno))      # "cache" in <a signature or fields>
            elif isinstance(node, ast.FunctionDef) and node.name == "_set_gradient_checkpointing":
                checkpointing.append((path, node.lineno))
    # the configuration base class: transformers 5's name, transformers 4's, in one try
    assert {p for p, _ in base_config} == {"hf/common.py"} and len(base_config) == 2, _where(base_config)
    assert [p for p, _ in probes] == ["hf/common.py"], _where(probes)
    assert [p for p, _ in checkpointing] == ["hf/common.py"], _where(checkpointing)
