"""The kernel tests under every Triton the kernels support, not only the one installed beside the
suite: each extra environment found (``.venv-triton*/bin/python`` at the repository root, which
``.ci/run`` makes for Triton 3.6, the oldest in ``siamesenorm.kernels.TRITON_RANGE``, or
``SIAMESENORM_TRITON_PYTHONS``, paths separated by ``os.pathsep``) runs ``tests/test_kernels*.py``
under Triton's interpreter in one process. Skips where there is none."""

import os
import subprocess
from pathlib import Path

import pytest

from siamesenorm.kernels import triton_supported

ROOT = Path(__file__).resolve().parent.parent


def _pythons() -> list[Path]:
    listed = [Path(p) for p in os.environ.get("SIAMESENORM_TRITON_PYTHONS", "").split(os.pathsep) if p]
    return listed + sorted(ROOT.glob(".venv-triton*/bin/python"))


PYTHONS = [] if os.environ.get("SIAMESENORM_KERNEL_TESTS_CHILD") else _pythons()


def _version(python: Path) -> str:
    run = subprocess.run([str(python), "-c", "import importlib.metadata as m; print(m.version('triton'))"],
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    return run.stdout.strip()


@pytest.mark.skipif(not PYTHONS, reason="no second Triton environment (.ci/run makes .venv-triton36)")
@pytest.mark.parametrize("python", PYTHONS, ids=[p.parent.parent.name for p in PYTHONS])
def test_the_kernel_tests_pass_under_another_triton(python):
    version = _version(python)
    assert triton_supported(version), f"{python} has Triton {version}, outside the supported range"
    files = sorted(str(p) for p in (ROOT / "tests").glob("test_kernels*.py") if p.name != Path(__file__).name)
    env = {**os.environ, "TRITON_INTERPRET": "1", "SIAMESENORM_KERNEL_TESTS_CHILD": "1"}
    # -n 0: one process; the suite's other workers keep the other cores busy meanwhile.
    run = subprocess.run([str(python), "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", *files],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    failed = [line for line in run.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    assert run.returncode == 0, "\n".join([f"Triton {version}:", *failed, run.stdout[-6000:],
                                           run.stderr[-2000:]])
    assert " passed" in run.stdout.splitlines()[-1]
