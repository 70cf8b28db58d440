"""benchmarks/gpu.py on CPU at its tiny size, and the scripts of a session lent a GPU.

The benchmark and its smoke run in this process (``main``: the script run as a process ends with
what ``main`` returns), eager, except one compiled run with the aot_eager backend (dynamo and
AOTAutograd, as inductor sees them, without code generation: Inductor takes ~20 s a case to compile
on one core). gpu_wheels.py's closure is tested on a made-up index (no network).
"""

from __future__ import annotations

import importlib.util
import math
import re
import subprocess
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import siamesenorm
import siamesenorm.kernels

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu.py"
SESSION = ROOT / "benchmarks" / "gpu_session.sh"
OURS = ["pre", "siamese", "siamese-hybrid_pre", "hyper", "mhc", "attn_res", "attn_res-block4",
        "pre-value_residual", "siamese-kernels", "pre-kernels"]
OLMO = ["olmo-core-pre", "olmo-core-siamese"]
COLUMNS = ["case", "params M", "compiled", "step ms", "IQR %", "tokens/s", "TFLOP/s", "MFU %", "peak GiB",
           "step / pre"]
SMOKE_COLUMNS = ["part", "case", "result", "seconds", "detail"]
HAS_OLMO = importlib.util.find_spec("olmo_core") is not None
TINY = ["--size", "tiny", "--device", "cpu"]


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module         # its dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules[spec.name]
    return module


@pytest.fixture(scope="module")
def gpu():
    return _load(SCRIPT, "gpu_benchmark")


@pytest.fixture(scope="module")
def wheels():
    return _load(ROOT / "benchmarks" / "gpu_wheels.py", "gpu_wheels")


@pytest.fixture
def run(gpu, capsys):
    """``main(argv)`` here: its exit status, stdout and stderr (dynamo's limit restored after; not by
    monkeypatch, whose undo would delete it, and dynamo's config hides a deleted entry)."""
    config = torch._dynamo.config
    limit = config.recompile_limit

    def call(*argv: str) -> tuple[int, str, str]:
        code = gpu.main(list(argv))
        out = capsys.readouterr()
        return code, out.out, out.err
    yield call
    config.recompile_limit = limit


def _rows(report: str, columns: list[str]) -> dict[str, dict[str, str]]:
    lines = [line for line in report.splitlines() if line.startswith("|")]
    assert [c.strip() for c in lines[0].strip("|").split("|")] == columns
    assert set(lines[1].strip("|").split("|")) <= {"---", "---:"}
    table = {}
    for line in lines[2:]:
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]
        assert len(cells) == len(columns), line
        row = dict(zip(columns, cells))
        table[row["case"]] = row
    return table


def _fake_self_check(failing: str | None = None):
    def self_check(device, dtypes=(torch.float32, torch.bfloat16)):
        assert torch.device(device).type == "cpu" and tuple(dtypes) == (torch.float32, torch.bfloat16)
        return [SimpleNamespace(op=op, dtype=dtype, ok=op != failing, seconds=0.01,
                                reason="" if op != failing else "KernelMismatch: grad differs",
                                max_error=1e-7 if op != failing else 0.5)
                for op in ("add_norm", "sinkhorn") for dtype in dtypes]
    return self_check


# ---- the benchmark -------------------------------------------------------------------------------
def test_every_case_runs_and_is_one_row_of_the_table(run, tmp_path):
    out = tmp_path / "gpu.md"
    code, stdout, stderr = run(*TINY, "--no-compile", "--steps", "2", "--warmup", "1", "--markdown", str(out))
    assert code == 0, stderr[-3000:]
    table = _rows(stdout, COLUMNS)
    assert list(table) == OURS + (OLMO if HAS_OLMO else [])
    for row in table.values():
        assert row["compiled"] == "no"
        assert float(row["step ms"]) > 0 and float(row["tokens/s"].replace(",", "")) > 0
        assert float(row["TFLOP/s"]) > 0                      # our FLOPs per token are known
        assert row["MFU %"] == row["peak GiB"] == "n/a"       # a CPU: no peak, no allocator
        assert float(row["step / pre"]) > 0
    assert table["pre"]["step / pre"] == "1.000"
    assert float(table["mhc"]["params M"]) > float(table["pre"]["params M"])
    header = stdout.split("|")[0]
    assert f"torch {torch.__version__}" in header and "2 layers x 64" in header
    assert "2 x 32 = 64 tokens a step" in header
    skipped = [line for line in stdout.splitlines() if "skipped" in line]
    if HAS_OLMO:
        assert table["olmo-core-pre"]["step / pre"] == "1.000" and not skipped
        assert "olmo-core-pre measured before and after" in stdout
    else:
        assert skipped == ["- skipped olmo-core-pre, olmo-core-siamese: OLMo-core is not installed "
                           "(pip install 'siamesenorm[olmo]')"]
    assert out.read_text() == stdout
    assert "gpu.py: siamese: built and warmed up" in stderr      # progress goes to stderr


def test_compiled_cases_report_their_backend_and_pre_is_added(run):
    code, stdout, stderr = run(*TINY, "--cases", "siamese", "--backend", "aot_eager", "--steps", "2",
                               "--warmup", "1")
    assert code == 0, stderr[-3000:]
    table = _rows(stdout, COLUMNS)
    assert list(table) == ["pre", "siamese"]
    assert {row["compiled"] for row in table.values()} == {"aot_eager"}
    assert table["pre"]["step / pre"] == "1.000"
    assert "compiled again in a measured step" not in stdout


def test_a_failing_case_is_left_out_and_cases_keep_the_given_order(gpu, run, monkeypatch):
    step = gpu.OurCase.step

    def planted(self):
        if self.name == "mhc":
            raise RuntimeError("planted: mhc broke")
        return step(self)
    monkeypatch.setattr(gpu.OurCase, "step", planted)
    code, stdout, stderr = run(*TINY, "--no-compile", "--cases", "siamese,mhc,hyper", "--steps", "1",
                               "--warmup", "1")
    assert code == 0
    assert list(_rows(stdout, COLUMNS)) == ["pre", "siamese", "hyper"]
    assert "- mhc failed and is left out: RuntimeError: planted: mhc broke" in stdout
    assert "Traceback" in stderr and "Traceback" not in stdout


def test_cases_whose_turn_comes_after_the_budget_are_left_out(run):
    cases = "pre,siamese,hyper" + (",olmo-core-pre,olmo-core-siamese" if HAS_OLMO else "")
    code, stdout, stderr = run(*TINY, "--no-compile", "--cases", cases, "--steps", "2", "--warmup", "1",
                               "--budget-s", "1e-6")
    assert code == 0, stderr[-3000:]
    table = _rows(stdout, COLUMNS)
    assert list(table) == ["pre"] + (["olmo-core-pre"] if HAS_OLMO else [])
    assert "- not measured, the budget was spent before their turn: siamese, hyper" in stdout
    if HAS_OLMO:
        assert "- not measured, the budget was spent before their turn: olmo-core-siamese" in stdout
        assert "measured before and after" not in stdout
    assert "cut some measured steps short" not in stdout     # 2 rounds asked: under the 3 kept


@pytest.mark.parametrize("args, says", [
    (["--cases", "pre,nope"], "unknown case 'nope'; choose from pre, "),
    (["--smoke", "--cases", "lns,nope"], "unknown case 'nope'; choose from kernels, pre, "),
    (["--steps", "0"], "--steps and --warmup must be at least 1"),
    (["--size", "huge"], "invalid choice"),
    (["--device", "cuda:x"], "not a device"),
    (["--ok-cases", "x.txt"], "--ok-cases and --tracebacks go with --smoke"),
])
def test_bad_options_are_refused_with_one_line_and_status_2(gpu, args, says, capsys):
    assert gpu.main(["--size", "tiny", *args]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1 and says in captured.err, captured.err


# ---- the smoke -----------------------------------------------------------------------------------
def test_smoke_runs_every_kernel_scheme_and_case_once(run, monkeypatch, tmp_path):
    monkeypatch.setattr(siamesenorm.kernels, "self_check", _fake_self_check(), raising=False)
    md, ok, tb = tmp_path / "smoke.md", tmp_path / "ok.txt", tmp_path / "tb.txt"
    code, stdout, stderr = run("--smoke", *TINY, "--no-compile", "--markdown", str(md), "--ok-cases", str(ok),
                               "--tracebacks", str(tb))
    table = _rows(stdout, SMOKE_COLUMNS)
    schemes = siamesenorm.list_schemes()
    assert len(schemes) >= 14 and set(schemes) | set(OURS) | set(OLMO) <= set(table)
    assert [r["case"] for r in table.values() if r["part"] == "kernel"] == [
        "add_norm fp32", "add_norm bf16", "sinkhorn fp32", "sinkhorn bf16"]
    for name in [*schemes, *OURS]:
        row = table[name]
        assert row["part"] == "scheme" and row["result"] == "ok", row
        assert float(row["seconds"]) >= 0
        found = re.fullmatch(r"compiled: no; loss (\S+), eager (\S+)", row["detail"])
        loss, eager = map(float, found.groups())
        assert loss == eager and math.isclose(loss, math.log(256), rel_tol=0.1)     # vocab 256 at init
    for name in OLMO:
        assert table[name]["result"] == ("ok" if HAS_OLMO else "skipped")
    assert code == (0 if HAS_OLMO else 1)
    assert f"{len(table) - (0 if HAS_OLMO else 2)} ok, 0 failed, {0 if HAS_OLMO else 2} skipped" in stdout
    assert md.read_text() == stdout
    assert ok.read_text() == ",".join(OURS + OLMO) + "\n" and tb.read_text() == ""
    assert "Traceback" not in stderr


def test_smoke_reports_failing_cases_with_their_reasons_and_exit_1(gpu, run, monkeypatch, tmp_path):
    fake = _fake_self_check(failing="sinkhorn")
    monkeypatch.setattr(siamesenorm.kernels, "self_check", fake, raising=False)
    eager_loss, step = gpu.OurCase.eager_loss, gpu.OurCase.step

    def raises(self):
        if self.name == "mhc":
            raise RuntimeError("backend='inductor' raised:\nRuntimeError: planted | mhc broke\nmore")
        return eager_loss(self)

    def not_finite(self):
        loss = step(self)
        return loss * float("nan") if self.name == "hyper" else loss
    monkeypatch.setattr(gpu.OurCase, "eager_loss", raises)
    monkeypatch.setattr(gpu.OurCase, "step", not_finite)
    ok, tb = tmp_path / "ok.txt", tmp_path / "tb.txt"
    code, stdout, stderr = run("--smoke", *TINY, "--no-compile", "--cases", "kernels,pre,hyper,mhc,siamese",
                               "--ok-cases", str(ok), "--tracebacks", str(tb))
    assert code == 1
    table = _rows(stdout, SMOKE_COLUMNS)
    assert {k: r["result"] for k, r in table.items()} == {
        "add_norm fp32": "ok", "add_norm bf16": "ok", "sinkhorn fp32": "failed", "sinkhorn bf16": "failed",
        "pre": "ok", "hyper": "failed", "mhc": "failed", "siamese": "ok"}
    assert table["sinkhorn bf16"]["detail"] == "KernelMismatch: grad differs; max error 0.5"
    assert table["mhc"]["detail"] == (r"RuntimeError: backend='inductor' raised: RuntimeError: "
                                      r"planted \| mhc broke")
    assert table["hyper"]["detail"] == "Mismatch: the loss is nan"
    assert "- 4 ok, 4 failed, 0 skipped" in stdout
    assert "- failed: kernel sinkhorn fp32, kernel sinkhorn bf16, scheme hyper, scheme mhc" in stdout
    assert "Traceback" not in stdout + stderr
    assert "planted | mhc broke" in tb.read_text() and "hyper" not in tb.read_text()
    assert ok.read_text().strip().split(",") == [c for c in OURS + OLMO if c not in ("hyper", "mhc")]


def test_smoke_says_when_self_check_is_missing(gpu, run, monkeypatch):
    monkeypatch.delattr(siamesenorm.kernels, "self_check", raising=False)
    code, stdout, _ = run("--smoke", *TINY, "--cases", "kernels")
    assert code == 1
    assert _rows(stdout, SMOKE_COLUMNS) == {"self_check": dict(zip(SMOKE_COLUMNS, [
        "kernel", "self_check", "skipped", "", "self_check not available"]))}


@pytest.mark.skipif(not hasattr(siamesenorm.kernels, "self_check"), reason="no self_check yet")
def test_smoke_reads_the_real_self_check(gpu):
    """One row per op and dtype, each ok with its error or failed with its reason (off Triton's
    interpreter every op fails here, saying why)."""
    tracebacks: list[str] = []
    rows = gpu.smoke_kernels(torch.device("cpu"), tracebacks)
    assert tracebacks == [] and rows and len({r.case for r in rows}) == len(rows)
    assert {r.case.rsplit(" ", 1)[1] for r in rows} == {"fp32", "bf16"}
    for r in rows:
        assert r.part == "kernel" and r.seconds >= 0
        assert (r.result, r.detail.startswith("max error")) in {("ok", True), ("failed", False)}, r
        assert r.detail


def test_ok_cases_drop_olmo_core_siamese_with_olmo_core_pre(gpu):
    failed = [gpu.Check("olmo-core", "olmo-core-pre", "failed", 1.0, "x")]
    assert gpu.ok_cases(failed) == OURS


def test_the_loss_check(gpu):
    assert gpu._loss_check(6.93, 6.95, "bf16") == "loss 6.9300, eager 6.9500"
    with pytest.raises(gpu.Mismatch, match="tolerance"):
        gpu._loss_check(6.93, 7.2, "bf16")
    with pytest.raises(gpu.Mismatch, match="tolerance"):
        gpu._loss_check(6.93, 6.931, "fp32")
    with pytest.raises(gpu.Mismatch, match="the loss is inf"):
        gpu._loss_check(float("inf"), None, "bf16")


# ---- the session's scripts -----------------------------------------------------------------------
def test_session_script_is_bash_and_runs_what_it_names(gpu):
    subprocess.run(["bash", "-n", str(SESSION)], check=True)
    text = SESSION.read_text()
    for needed in ["benchmarks/gpu.py --smoke", "benchmarks/gpu_wheels.py --image-report", ".whl",
                   "/tmp/site", "$PWD/src", "PYTHONUNBUFFERED=1", 'tee "$OUT/log.txt"',
                   "OUT=${OUT:-./gpu-out}", '--markdown "$OUT/smoke.md"', '--markdown "$OUT/gpu.md"',
                   "--ok-cases", "--budget-s"]:
        assert needed in text, needed
    for path in re.findall(r"benchmarks/[\w.]+", text):
        assert (ROOT / path).is_file(), path
    # the benchmark's cases, most wanted first: every case of gpu.py, once
    listed = re.search(r"CASES=\$\{GPU_CASES:-([\w,-]+)\}", text).group(1).split(",")
    assert sorted(listed) == sorted(gpu.CASES) and listed[0] == "pre"
    assert ".whl/" in (ROOT / ".gitignore").read_text()


INDEX = {   # project -> version -> Requires-Dist lines
    "olmo": {"3.0.0": ["numpy", "cached-path>=1.7", "bettermap", 'pytest; extra == "dev"',
                       'pywin32; sys_platform == "win32"', 'backport; python_version < "3.10"',
                       'uvloop; platform_system == "Linux"']},
    "cached-path": {"1.7.0": ["boto3"], "1.8.0": ["boto3", "rich<14"], "1.9.0": ["boto3>=2"]},
    "boto3": {"1.0": ["botocore==1.0"], "2.0": ["botocore==2.0"]},
    "botocore": {"1.0": [], "2.0": []},
    "bettermap": {"1.3": ["dill", "cached-path<1.9"]},
    "dill": {"0.4": []},
}


def _fake_fetch(wheels, fetched):
    def fetch(name, spec, pin):
        versions = [v for v in INDEX[name] if (v == pin if pin else wheels.fits(v, spec))]
        version = max(versions, key=wheels.Version)
        fetched.append(f"{name}=={version}")
        return wheels.Dist(name, version, tuple(INDEX[name][version]))
    return fetch


def test_wheel_closure_follows_requirements_for_linux_py312_and_leaves_the_image_alone(wheels):
    fetched: list[str] = []
    carried, asked = wheels.closure([wheels.Requirement("olmo==3.0.0")], _fake_fetch(wheels, fetched),
                                    prefer={"boto3": "1.0"}.get)
    assert {n: d.version for n, d in carried.items()} == {
        "olmo": "3.0.0", "cached-path": "1.8.0", "bettermap": "1.3", "dill": "0.4", "boto3": "1.0",
        "botocore": "1.0"}
    # cached-path 1.9.0 came first, then bettermap ruled it out; boto3 2.0 came in with it, and this
    # venv's 1.0 replaced it once nothing ruled that out: one version of each is carried
    assert fetched.index("cached-path==1.9.0") < fetched.index("cached-path==1.8.0")
    assert fetched.index("boto3==2.0") < fetched.index("boto3==1.0")
    assert {"numpy", "rich", "uvloop"} <= set(asked) and not {"numpy", "rich", "uvloop"} & set(carried)
    assert not {"pytest", "pywin32", "backport"} & set(asked)
    assert str(asked["cached-path"].spec) == "<1.9,>=1.7" and asked["cached-path"].by == {"olmo", "bettermap"}
    assert wheels.problems(carried, asked) == []
    asked["torch"] = wheels.Wanted(wheels.SpecifierSet(">=2.12"), {"olmo"})
    asked["left-out"] = wheels.Wanted(by={"olmo"})
    assert wheels.problems(carried, asked) == [
        "left-out is neither carried nor on the image (asked by olmo)",
        "the image's torch 2.11.0 does not meet >=2.12 (asked by olmo)"]


def _wheel(folder: Path, name: str, version: str, requires: list[str]) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    meta = "".join([f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
                    *(f"Requires-Dist: {r}\n" for r in requires)])
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)
    return path


def test_wheel_folder_is_checked_from_its_files(wheels, tmp_path):
    _wheel(tmp_path, "olmo", "3.0.0", ["numpy", "dill>=0.4", 'pytest; extra == "dev"'])
    _wheel(tmp_path, "dill", "0.4", [])
    roots = [wheels.Requirement("olmo==3.0.0")]
    assert wheels.read_wheel(tmp_path / "olmo-3.0.0-py3-none-any.whl").requires[0] == "numpy"
    assert wheels.folder_problems(tmp_path, roots) == []
    assert wheels.image_report(tmp_path, {"numpy": "2.5.2"}.get) == [
        "numpy 2.5.2: asked any by olmo"]
    _wheel(tmp_path, "dill", "0.3", [])
    _wheel(tmp_path, "stray", "1.0", ["rich<14"])
    assert wheels.folder_problems(tmp_path, roots) == [
        "dill: 2 wheels (dill-0.3-py3-none-any.whl, dill-0.4-py3-none-any.whl)",
        "dill 0.3 does not meet >=0.4 (asked by olmo)", "stray: carried but needed by nothing"]
    assert "MISMATCH rich 14.1.0: asked <14 by stray" in wheels.image_report(tmp_path, {"rich": "14.1.0"}.get)


def test_wheel_roots_are_the_project_dependencies_and_olmo_core(wheels):
    roots = {r.name: str(r.specifier) for r in wheels.project_roots(ROOT / "pyproject.toml", "3.0.0")}
    assert roots["ai2-olmo-core"] == "==3.0.0" and "torch" in roots and "triton" in roots
    assert all(wheels.canonicalize_name(n) in wheels.ON_IMAGE for n in roots if n != "ai2-olmo-core")
