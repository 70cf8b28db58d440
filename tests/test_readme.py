"""Every Python example in the README runs, and the set-up commands it shows are the ones CI uses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
ALL_EXAMPLES = re.findall(r"```python\n(.*?)```", README, flags=re.S)
# the examples that read a folder the README's commands write: run by the test of their section
AFTER_COMMANDS = [code for code in ALL_EXAMPLES if 'model="models/tiny"' in code]
EXAMPLES = [code for code in ALL_EXAMPLES if code not in AFTER_COMMANDS]


def test_readme_has_examples():
    assert len(EXAMPLES) >= 3 and len(AFTER_COMMANDS) == 1


@pytest.mark.parametrize("code", EXAMPLES, ids=[f"example{i}" for i in range(len(EXAMPLES))])
def test_readme_example_runs(code, tmp_path, monkeypatch):
    if "transformers" in code:
        pytest.importorskip("transformers")
    if "olmo_core" in code:
        pytest.importorskip("olmo_core")        # the extra "olmo"
    monkeypatch.chdir(tmp_path)         # what an example writes stays out of the checkout
    exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})


def test_readme_hugging_face_export_and_pipeline_run(tmp_path, monkeypatch):
    """The Hugging Face section's commands, as written, in a fresh folder, then its pipeline."""
    import shlex

    pytest.importorskip("transformers")
    from siamesenorm.cli import main

    section = README.split("## Hugging Face transformers", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```bash\n(.*?)\n```", section, flags=re.S)
    (code,) = AFTER_COMMANDS
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    for line in block.splitlines():
        words = shlex.split(line.split("#")[0])
        assert words[0] == "siamesenorm"
        assert main(words[1:]) == 0
    exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})


def test_readme_starts_with_the_main_job_and_the_test_command():
    commands = re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)[:2]
    assert commands[0].endswith("siamesenorm compare")
    assert commands[1].endswith("python -m pytest -q")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q" in ci and "torch==2.13.0" in ci


def _readme_commands() -> list[list[str]]:
    """Every ``siamesenorm ...`` command of the README's bash blocks, split into arguments."""
    import shlex

    out = []
    for block in re.findall(r"```bash\n(.*?)\n```", README, flags=re.S):
        for line in block.splitlines():
            for part in line.split("#")[0].split("&&"):
                words = shlex.split(part)
                if words and words[0] == "siamesenorm":
                    out.append(words[1:])
    return out


@pytest.mark.parametrize("argv", _readme_commands(), ids=lambda a: " ".join(a)[:60])
def test_readme_commands_parse_and_their_configs_load(argv):
    """The README's commands are accepted as written: arguments, presets, overrides and grids."""
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
    assert {a[0] for a in _readme_commands()} >= {"compare", "train", "generate"}
