"""Shared test helpers: deterministic random branches, a plain loop over a scheme, a
``pytest.raises`` for errors that are not a user's configuration, and the command line run in
this process."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
import torch
from torch import Tensor

from siamesenorm.errors import ConfigError


def make_branches(n: int, dim: int, *, seed: int = 0, dtype=torch.float64) -> list:
    """``n`` fixed random non-linear sublayers ``u -> tanh(u W1) W2``, different for each i."""
    g = torch.Generator().manual_seed(seed)
    branches = []
    for _ in range(n):
        w1 = torch.randn(dim, dim, generator=g, dtype=dtype) / dim**0.5
        w2 = torch.randn(dim, dim, generator=g, dtype=dtype) / dim**0.5
        branches.append(lambda u, w1=w1, w2=w2: torch.tanh(u @ w1) @ w2)
    return branches


def run_scheme(scheme, h: Tensor, branches) -> Tensor:
    state = scheme.enter(h)
    for i in range(scheme.n_sublayers):
        state = scheme.step(state, i, branches[i])
    return scheme.exit(state)


def randomize_(module: torch.nn.Module, *, seed: int = 1, scale: float = 0.3) -> None:
    """Give every parameter a random value around its initial one, so no norm is an identity."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


@contextmanager
def raises_value_error(match: str) -> Iterator[pytest.ExceptionInfo]:
    """``pytest.raises(ValueError, match=...)`` that also fails on a ConfigError, which is kept
    for a user's configuration (tensor shapes and values given to a model are not)."""
    with pytest.raises(ValueError, match=match) as info:
        yield info
    assert not isinstance(info.value, ConfigError), info.value


# The start of a script (``python -c``) that runs where siamesenorm cannot be imported: ``sys.argv[1]``
# is the source folder to drop from the path (an editable install's).
HIDE_SIAMESENORM = r'''
import importlib.abc, json, sys

class NoSiameseNorm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "siamesenorm" or name.startswith("siamesenorm."):
            raise ImportError(f"{name} is hidden in this test")

sys.meta_path.insert(0, NoSiameseNorm())
sys.path = [p for p in sys.path if not p.startswith(sys.argv[1])]
'''


def cli_in_process(*args: str, cwd: str | Path | None = None, env: dict | None = None,
                   threads: int = 1) -> subprocess.CompletedProcess:
    """``siamesenorm ARGS`` run by :func:`siamesenorm.cli.main` in this process, as
    ``subprocess.run(..., capture_output=True, text=True)`` would report it: the exit status,
    standard output and standard error. ``env`` is added to ``os.environ`` and ``threads`` set as
    torch's intra-op threads for the call; both, and the working folder, are restored after. For
    what needs a process of its own (signals, locks held by another process, exit codes of
    ``entry``, torchrun) start one."""
    from siamesenorm.cli import main

    out, err = io.StringIO(), io.StringIO()
    before_cwd, before_threads = os.getcwd(), torch.get_num_threads()
    before_env = {k: os.environ.get(k) for k in env or {}}
    try:
        os.environ.update(env or {})
        if cwd is not None:
            os.chdir(cwd)
        torch.set_num_threads(threads)
        with redirect_stdout(out), redirect_stderr(err):
            try:
                code = main(list(args))
            except SystemExit as done:      # argparse's --help, --version and usage errors
                code = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
    finally:
        torch.set_num_threads(before_threads)
        os.chdir(before_cwd)
        for k, v in before_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return subprocess.CompletedProcess([sys.executable, "-m", "siamesenorm", *args], code,
                                       out.getvalue(), err.getvalue())


@contextmanager
def what_a_process_would_print() -> Iterator[list[str]]:
    """The lines beyond its own writes that a command run in a process of its own would print on
    stderr, and that pytest holds back in this one: warnings as Python's default filters show
    them (each place once; deprecations, imports and resources hidden), and log records of
    WARNING and above (Python's last-resort handler). Run the command in this process inside the
    block; the list fills as it runs."""
    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(f"{record.levelname}:{record.name}: {record.getMessage()}")

    handler = Collect(logging.WARNING)
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("default")
            for category in (DeprecationWarning, PendingDeprecationWarning, ImportWarning, ResourceWarning):
                warnings.filterwarnings("ignore", category=category)
            yield lines
    finally:
        root.removeHandler(handler)
    lines.extend(f"{w.category.__name__}: {w.message}" for w in caught)


def run_docs_section(page: str, heading: str) -> None:
    """Run the one Python block of ``docs/<page>``'s section ``## <heading>``, as a reader would
    paste it (in the working folder: a test chdirs to its tmp_path first)."""
    import re

    doc = (Path(__file__).resolve().parents[1] / "docs" / page).read_text()
    section = doc.split(f"## {heading}", 1)[1].split("\n## ", 1)[0]
    (code,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    exec(compile(code, f"docs/{page}", "exec"), {"__name__": "__docs__"})
