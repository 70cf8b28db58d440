"""benchmarks/gpu.py on CPU at its tiny size: every case runs and lands in one Markdown table.

Inductor takes ~20 s a case to compile on one core, so the run over every case is eager and the
compiled path runs two cases with the aot_eager backend (dynamo and AOTAutograd, as inductor sees
them, without code generation).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu.py"
OURS = ["pre", "siamese", "siamese-hybrid_pre", "hyper", "mhc", "attn_res", "attn_res-block4",
        "pre-value_residual", "siamese-kernels", "pre-kernels"]
OLMO = ["olmo-core-pre", "olmo-core-siamese"]
COLUMNS = ["case", "params M", "compiled", "step ms", "IQR %", "tokens/s", "TFLOP/s", "MFU %", "peak GiB",
           "step / pre"]
HAS_OLMO = importlib.util.find_spec("olmo_core") is not None


def _run(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, str(SCRIPT), "--size", "tiny", "--device", "cpu", *args],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)


def _table(report: str) -> dict[str, dict[str, str]]:
    lines = [line for line in report.splitlines() if line.startswith("|")]
    heads = [c.strip() for c in lines[0].strip("|").split("|")]
    assert heads == COLUMNS
    assert set(lines[1].strip("|").split("|")) <= {"---", "---:"}
    table = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert len(cells) == len(COLUMNS), line
        table[cells[0]] = dict(zip(COLUMNS, cells))
    return table


def test_every_case_runs_and_is_one_row_of_the_table(tmp_path):
    out = tmp_path / "gpu.md"
    proc = _run("--no-compile", "--steps", "2", "--warmup", "1", "--markdown", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = _table(proc.stdout)
    assert list(table) == OURS + (OLMO if HAS_OLMO else [])
    for row in table.values():
        assert row["compiled"] == "no"
        assert float(row["step ms"]) > 0 and float(row["tokens/s"].replace(",", "")) > 0
        assert float(row["TFLOP/s"]) > 0                      # our FLOPs per token are known
        assert row["MFU %"] == row["peak GiB"] == "n/a"       # a CPU: no peak, no allocator
        assert float(row["step / pre"]) > 0
    assert table["pre"]["step / pre"] == "1.000"
    assert float(table["mhc"]["params M"]) > float(table["pre"]["params M"])
    header = proc.stdout.split("|")[0]
    assert f"torch {__import__('torch').__version__}" in header and "2 layers x 64" in header
    assert "2 x 32 = 64 tokens a step" in header
    skipped = [line for line in proc.stdout.splitlines() if "skipped" in line]
    if HAS_OLMO:
        assert table["olmo-core-pre"]["step / pre"] == "1.000" and not skipped
        assert "olmo-core-pre measured before and after" in proc.stdout
    else:
        assert skipped == ["- skipped olmo-core-pre, olmo-core-siamese: OLMo-core is not installed "
                           "(pip install 'siamesenorm[olmo]')"]
    assert out.read_text() == proc.stdout


def test_compiled_cases_report_their_backend_and_pre_is_added():
    proc = _run("--cases", "siamese", "--backend", "aot_eager", "--steps", "2", "--warmup", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    table = _table(proc.stdout)
    assert list(table) == ["pre", "siamese"]
    assert {row["compiled"] for row in table.values()} == {"aot_eager"}
    assert table["pre"]["step / pre"] == "1.000"
    assert "compiled again in a measured step" not in proc.stdout


@pytest.mark.parametrize("args, says", [
    (["--cases", "pre,nope"], "unknown case 'nope'; choose from pre, "),
    (["--steps", "0"], "--steps and --warmup must be at least 1"),
    (["--size", "huge"], "invalid choice"),
    (["--device", "cuda:x"], "not a device"),
])
def test_bad_options_are_refused_with_one_line_and_status_2(args, says, capsys):
    """In this process (``main``); the script run as a process ends with what ``main`` returns."""
    spec = importlib.util.spec_from_file_location("gpu_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module         # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    assert module.main(["--size", "tiny", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and says in captured.err, captured.err
