"""The ``siamesenorm`` command: help, the scheme table, the demo, and one-line errors (exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import siamesenorm as sn

SRC = str(Path(__file__).resolve().parents[1] / "src")


def run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
               OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "siamesenorm", *args], capture_output=True,
                          text=True, env=env, timeout=300)


def test_help_lists_the_subcommands():
    out = run("--help")
    assert out.returncode == 0
    assert "schemes" in out.stdout and "demo" in out.stdout


def test_schemes_table_lists_every_scheme_with_its_paper():
    out = run("schemes")
    assert out.returncode == 0
    lines = out.stdout.splitlines()
    for name in sn.list_schemes():
        row = next(line for line in lines if line.split()[0] == name)
        assert "arXiv" in row
    verbose = run("schemes", "-v").stdout
    assert "depth_scale=True" in verbose and "n_streams=2" in verbose


def test_demo_trains_every_scheme_it_is_given():
    out = run("demo", "--schemes", "pre,siamese", "--layers", "2", "--dim", "32", "--steps", "6")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("val loss") == 2
    assert "grad first/last block" in out.stdout


@pytest.mark.parametrize("args, fragment", [
    (("demo", "--schemes", "pre,siamse"), "unknown scheme 'siamse'"),
    (("demo", "--steps", "0"), "must be positive"),
    (("demo", "--steps", "ten"), "invalid int value"),
    (("frobnicate",), "invalid choice"),
])
def test_user_errors_are_one_line_with_exit_status_2(args, fragment):
    out = run(*args)
    assert out.returncode == 2
    assert fragment in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert "Traceback" not in out.stderr
