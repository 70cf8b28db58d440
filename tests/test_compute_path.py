"""The one switch of the compute path: SIAMESENORM_PATH and use_path."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
import torch

from siamesenorm.compute import PATHS, compute_path, use_path
from siamesenorm.errors import UserError
from siamesenorm.kernels.availability import kernels_run_on
from siamesenorm.nn.fused import fused_enabled


def _in_child(code: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SIAMESENORM_")}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**clean, **env, "OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("value, path", [("reference", "reference"), ("lean", "lean"),
                                         ("KERNELS", "kernels"), (None, "kernels")])
def test_the_environment_chooses_the_path(monkeypatch, value, path):
    for name in ("SIAMESENORM_PATH", "SIAMESENORM_FUSED", "SIAMESENORM_KERNELS"):
        monkeypatch.delenv(name, raising=False)
    if value is not None:
        monkeypatch.setenv("SIAMESENORM_PATH", value)
    assert compute_path() == path
    assert fused_enabled() == (path != "reference")


def test_a_wrong_value_is_one_clear_line(monkeypatch):
    monkeypatch.setenv("SIAMESENORM_PATH", "fast")
    with pytest.raises(UserError, match="SIAMESENORM_PATH='fast' is not one of reference, lean, kernels"):
        compute_path()
    with pytest.raises(ValueError, match="path must be one of"):
        with use_path("fast"):
            pass


def test_a_wrong_value_ends_a_command_with_status_2():
    code = "from siamesenorm.cli import main; raise SystemExit(main(['train', 'tiny', '--dry-run']))"
    run = _in_child(code, SIAMESENORM_PATH="fast")
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines()[-1].endswith("is not one of reference, lean, kernels")
    assert "Traceback" not in run.stderr


@pytest.mark.parametrize("old, path", [("SIAMESENORM_FUSED", "reference"), ("SIAMESENORM_KERNELS", "lean")])
def test_the_old_switches_still_work_for_a_release(old, path):
    run = _in_child("from siamesenorm.compute import compute_path; print(compute_path()); "
                    "print(compute_path())", **{old: "0"})
    assert run.stdout.split() == [path, path]
    assert run.stderr.count("deprecated") == 1 and f"SIAMESENORM_PATH={path}" in run.stderr


def test_use_path_holds_in_its_thread_and_block_only():
    seen = []
    with use_path("reference"):
        assert compute_path() == "reference" and not fused_enabled()
        thread = threading.Thread(target=lambda: seen.append(compute_path()))
        thread.start()
        thread.join()
        with use_path("lean"):
            assert compute_path() == "lean" and fused_enabled()
        assert compute_path() == "reference"
    assert seen == [compute_path()]
    assert set(PATHS) == {"reference", "lean", "kernels"}


def test_one_rule_says_where_the_kernels_run(monkeypatch):
    """Only on the kernels path and on plain tensors of a kernel device (the CPU only under
    Triton's interpreter)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = torch.randn(2, 4)
    with use_path("kernels"):
        assert kernels_run_on(x) and kernels_run_on(x, None, x)
        assert not kernels_run_on(torch.nn.Parameter(x)) and not kernels_run_on(None)
        assert not kernels_run_on(x.to("meta"))
    for path in ("lean", "reference"):
        with use_path(path):
            assert not kernels_run_on(x)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not kernels_run_on(x)
