"""The README and the docs pages say what works: their examples run, their commands are accepted as
written, their links lead somewhere, and the README starts with the set-up commands CI uses."""

from __future__ import annotations

import re
import shlex
import sys
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = {p.name: p.read_text() for p in sorted((ROOT / "docs").glob("*.md"))}
PAGES = {"README.md": README, **{f"docs/{name}": text for name, text in DOCS.items()}}
# the pages whose every Python example runs (the other pages' snippets show a pattern, e.g. on a
# checkpoint the reader has)
RUNNABLE = ("README.md", "docs/python.md", "docs/vision.md")
HF_PAGE = "docs/python.md"     # its Hugging Face section's commands write the folder its pipeline reads
MAX_README_LINES = 250


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"```python\n(.*?)```", text, flags=re.S)


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)\n```", text, flags=re.S)


# the examples that read a folder a page's commands write: run by the test of their section
AFTER_COMMANDS = [code for code in _python_blocks(PAGES[HF_PAGE]) if 'model="models/tiny"' in code]
EXAMPLES = [(page, i, code) for page in RUNNABLE for i, code in enumerate(_python_blocks(PAGES[page]))
            if code not in AFTER_COMMANDS]


def test_pages_have_examples():
    assert len([e for e in EXAMPLES if e[0] == "README.md"]) >= 4 and len(AFTER_COMMANDS) == 1


def _timm_stand_in(monkeypatch) -> None:
    """Without timm: a stand-in for the three functions of its registry that the example uses, so
    the example still runs our entry points (tests/test_vit.py runs them under timm itself)."""
    import fnmatch

    registry: dict = {}
    timm = types.ModuleType("timm")
    models = types.ModuleType("timm.models")
    models.register_model = lambda fn: registry.setdefault(fn.__name__, fn)
    timm.models = models
    timm.create_model = lambda name, **kwargs: registry[name](**kwargs)
    timm.list_models = lambda pattern="*": sorted(fnmatch.filter(registry, pattern))
    monkeypatch.setitem(sys.modules, "timm", timm)
    monkeypatch.setitem(sys.modules, "timm.models", models)
    # the example imports our module afresh; afterwards the process has it as before (or not at all)
    import siamesenorm.models

    monkeypatch.setitem(sys.modules, "siamesenorm.models.timm_models", None)
    del sys.modules["siamesenorm.models.timm_models"]
    monkeypatch.setattr(siamesenorm.models, "timm_models", None, raising=False)


@pytest.mark.parametrize("page,index,code", EXAMPLES, ids=[f"{p}:{i}" for p, i, _ in EXAMPLES])
def test_page_example_runs(page, index, code, tmp_path, monkeypatch):
    if "transformers" in code:
        pytest.importorskip("transformers")
    if "olmo_core" in code:
        pytest.importorskip("olmo_core")        # the extra "olmo"
    if re.search(r"^import .*\btimm\b", code, flags=re.M):
        try:
            import timm  # noqa: F401
        except Exception:  # noqa: BLE001
            _timm_stand_in(monkeypatch)
    monkeypatch.chdir(tmp_path)         # what an example writes stays out of the checkout
    exec(compile(code, page, "exec"), {"__name__": "__readme__"})


def test_hugging_face_export_and_pipeline_run(tmp_path, monkeypatch):
    """The Hugging Face section's commands, as written, in a fresh folder, then its pipeline."""
    pytest.importorskip("transformers")
    from siamesenorm.cli import main

    section = PAGES[HF_PAGE].split("## Hugging Face transformers", 1)[1].split("\n## ", 1)[0]
    (block,) = _bash_blocks(section)
    (code,) = AFTER_COMMANDS
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for line in block.splitlines():
        words = shlex.split(line.split("#")[0])
        assert words[0] == "siamesenorm"
        assert main(words[1:]) == 0
    exec(compile(code, HF_PAGE, "exec"), {"__name__": "__readme__"})


def test_readme_starts_with_the_main_job_and_the_test_command():
    commands = _bash_blocks(README)[:2]
    assert commands[0].endswith("siamesenorm compare")
    assert commands[1].endswith("python -m pytest -q")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q" in ci and "torch==2.13.0" in ci


def _commands(text: str) -> list[list[str]]:
    """Every ``siamesenorm ...`` command of a page's bash blocks (also under ``torchrun -m`` or after
    environment settings), split into arguments."""
    out = []
    for block in _bash_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("#")[0].split("&&"):
                words = shlex.split(part)
                while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", words[0]):
                    words = words[1:]
                if words[:1] == ["torchrun"] and "-m" in words:
                    words = words[words.index("-m") + 1:]
                if words and words[0] == "siamesenorm":
                    out.append(words[1:])
    return out


COMMANDS = [(page, argv) for page, text in PAGES.items() for argv in _commands(text)]


@pytest.mark.parametrize("page,argv", COMMANDS, ids=[f"{p}: {' '.join(a)[:60]}" for p, a in COMMANDS])
def test_page_commands_parse_and_their_configs_load(page, argv):
    """The commands are accepted as written: arguments, presets, overrides and grids."""
    from siamesenorm.cli import DEFAULT_PRESET, _resume_changes, _split_preset, build_parser, parse_args
    from siamesenorm.experiments import build_grid
    from siamesenorm.tasks import load_config

    args = parse_args(build_parser(), argv)         # as the command parses: overrides after options
    if args.command == "train" and not args.resume:
        load_config(*_split_preset(args.args))
    elif args.command == "train":
        _resume_changes(*_split_preset(args.args))
    elif args.command == "compare":
        preset, overrides = _split_preset(args.args)
        schemes = args.schemes.split(",") if args.schemes else None
        lrs = [float(x) for x in args.lrs.split(",")] if args.lrs else None
        build_grid(preset or DEFAULT_PRESET, overrides, schemes=schemes, lrs=lrs)


def test_readme_shows_the_main_commands():
    assert {a[0] for a in _commands(README)} >= {"compare", "train", "generate"}


def test_readme_is_a_front_page():
    assert len(README.splitlines()) <= MAX_README_LINES, "move detail into a page of docs/"


def test_docs_index_lists_every_page_once():
    index = DOCS["README.md"].splitlines()
    for name in DOCS:
        if name == "README.md":
            continue
        lines = [line for line in index if line.startswith(f"- [{name}]({name})")]
        assert len(lines) == 1, f"docs/README.md lists {name} {len(lines)} times"
    listed = re.findall(r"^- \[([^\]]+)\]", DOCS["README.md"], flags=re.M)
    assert sorted(listed) == sorted(n for n in DOCS if n != "README.md")


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens and underscores dropped,
    spaces made hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("page", list(PAGES))
def test_page_links_lead_somewhere(page):
    """Every relative link names a file of the checkout, and every #anchor a heading of its page."""
    base = (ROOT / page).parent
    text = re.sub(r"`[^`\n]*`", "", re.sub(r"```.*?```", "", PAGES[page], flags=re.S))
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        file = (base / path).resolve() if path else ROOT / page
        assert file.exists(), f"{page} links to {target}, which does not exist"
        if anchor and file.suffix == ".md":
            headings = re.findall(r"^#+ (.*)$", re.sub(r"```.*?```", "", file.read_text(), flags=re.S),
                                  flags=re.M)
            assert anchor in {_anchor(h) for h in headings}, f"{page} links to {target}: no such heading"
