"""Every Python example in the README runs, and the set-up commands it shows are the ones CI uses."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
EXAMPLES = re.findall(r"```python\n(.*?)```", README, flags=re.S)


def test_readme_has_examples():
    assert len(EXAMPLES) >= 3


@pytest.mark.parametrize("code", EXAMPLES, ids=[f"example{i}" for i in range(len(EXAMPLES))])
def test_readme_example_runs(code):
    exec(compile(code, "README.md", "exec"), {"__name__": "__readme__"})


def test_readme_starts_with_the_main_job_and_the_test_command():
    commands = re.findall(r"```bash\n(.*?)\n```", README, flags=re.S)[:2]
    assert commands[0].endswith("siamesenorm demo")
    assert commands[1].endswith("python -m pytest -q")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "python -m pytest -q" in ci and "torch==2.13.0" in ci
