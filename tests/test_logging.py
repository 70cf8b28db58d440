"""What a run shows people: plain log lines when stderr is a file, a live bar on a terminal, a final
line either way; and the achieved TFLOP/s and MFU in the lines, ``metrics.jsonl`` and ``summary.json``."""

from __future__ import annotations

import fcntl
import json
import os
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest
import torch

from helpers import what_a_process_would_print
from siamesenorm.cli import main
from siamesenorm.config import TrainConfig
from siamesenorm.models import LanguageModel, LMConfig
from siamesenorm.train import loop, throughput
from siamesenorm.train import train as train_engine
from siamesenorm.train.progress import LOG_PREFIX, duration, log_interval
from siamesenorm.train.throughput import table_peak

SRC = str(Path(__file__).resolve().parents[1] / "src")
SMALL = ["data.max_bytes=40000", "train.warmup=1", "train.checkpoint_every=1000"]
STEP = re.compile(r"^\[train\] step (\d+)/(\d+) \| loss (\S+) \| (?:val loss (\S+) \| )?lr (\S+) \| "
                  r"(\S+) tok/s \| (\S+) TFLOP/s \| elapsed (\S+) \| ETA (\S+)$")


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
                OMP_NUM_THREADS="1")


def train_to_file(capfd, *args: str) -> tuple[subprocess.CompletedProcess, list[str]]:
    """``siamesenorm train`` with stderr redirected to a file, as under a scheduler: in this process,
    whose stderr (file descriptor 2) is pytest's file. What a process of its own would print
    there beside (warnings, log records: :func:`helpers.what_a_process_would_print`) are lines
    too."""
    capfd.readouterr()
    with what_a_process_would_print() as extra:
        code = main(["train", "tiny", *args])
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(args, code, out, err), err.splitlines() + extra


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


# ---- a batch job's log ---------------------------------------------------------------------------
def test_a_log_file_gets_a_line_every_log_every_steps_and_at_evaluations_then_a_final_line(tmp_path, capfd):
    run_dir = tmp_path / "run"
    res, lines = train_to_file(capfd, *SMALL, "train.steps=12", "train.eval_every=6",
                               "train.log_every=4", "--out", str(run_dir))
    assert res.returncode == 0, lines
    assert all(line.startswith(LOG_PREFIX + " ") for line in lines), lines
    assert not any("\r" in line for line in lines)
    threads, *periodic, final = lines          # first the threads chosen, then the steps
    assert threads.startswith(f"{LOG_PREFIX} threads: "), lines
    matches = [STEP.match(line) for line in periodic]
    assert all(matches), periodic
    logged = {r["step"]: r for r in rows(run_dir)}
    assert [int(m[1]) for m in matches] == [4, 6, 8, 12]        # every 4 steps, and evaluations
    for m in matches:
        step, row = int(m[1]), logged[int(m[1])]
        assert m[2] == "12" and m[3] == f"{row['loss']:.4f}" and m[5] == f"{row['lr']:.2e}"
        assert (m[4] is not None) == (step in (6, 12))
        if m[4] is not None:
            assert m[4] == f"{row['val_loss']:.4f}"
        assert float(m[7]) > 0                                  # TFLOP/s on a CPU, no MFU
    assert "MFU" not in "\n".join(lines)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert final.startswith(f"{LOG_PREFIX} done: 12/12 steps in ")
    assert f"val loss {summary['final_val_loss']:.4f} (best " in final and "TFLOP/s" in final
    assert res.stdout.strip() == f"{run_dir}: 12 steps, final val loss {summary['final_val_loss']:.4f}"
    # the figures behind the lines: TFLOP/s per row and in the summary; no peak, so no MFU
    want = summary["flops_per_token"] * summary["tokens_per_s"] / 1e12
    assert summary["tflops"] == pytest.approx(want, rel=1e-12)
    assert summary["mfu"] is None and summary["peak_tflops"] is None
    for row in logged.values():
        assert row["tflops"] == pytest.approx(summary["flops_per_token"] * row["tokens_per_s"] / 1e12)
        assert "mfu" not in row


def test_log_every_zero_is_quiet_apart_from_the_final_line(tmp_path, capfd):
    res, lines = train_to_file(capfd, *SMALL, "train.steps=4", "train.eval_every=2",
                               "train.log_every=0", "--out", str(tmp_path / "run"))
    assert res.returncode == 0, lines
    assert len(lines) == 1 and lines[0].startswith(f"{LOG_PREFIX} done: 4/4 steps in "), lines


# Only rank 0 logs across processes: tests/test_parallel.py's ``--nproc 2`` run end to end, its
# stderr a file as here.


def test_the_default_interval_keeps_a_log_to_about_a_hundred_lines():
    assert log_interval(None, 200) == 2 and log_interval(None, 100_000) == 1000
    assert log_interval(None, 50) == 1 and log_interval(7, 100_000) == 7 and log_interval(0, 10) == 0
    for steps in (100, 101, 199, 250, 999, 12_345, 10**7 + 1):
        assert 50 <= steps // log_interval(None, steps) <= 100
    assert [duration(s) for s in (0.04, 4.26, 42, 185, 7620)] == ["0.0s", "4.3s", "42s", "3m05s", "2h07m"]


# ---- a terminal -----------------------------------------------------------------------------------
@pytest.mark.parametrize("columns", [100, 0])     # 0: a pseudo-terminal that reports no size
def test_a_terminal_gets_a_live_bar_with_an_eta(tmp_path, columns):
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    proc = subprocess.Popen([sys.executable, "-m", "siamesenorm", "train", "tiny", *SMALL,
                             "train.steps=6", "train.eval_every=3", "--out", str(tmp_path / "run")],
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=slave, env=_env())
    os.close(slave)
    shown = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:          # the other end closed (Linux)
            break
        if not chunk:
            break
        shown += chunk
    os.close(master)
    assert proc.wait(timeout=300) == 0
    proc.stdout.close()
    text = shown.decode()
    bars = [part for part in re.split(r"[\r\n]+", text) if "%|" in part]
    assert bars and "\r" in text, text
    last = bars[-1]
    assert last.startswith("100%|") and "| 6/6 [" in last and "ETA " in last and "loss " in last, last
    assert "[train] step" not in text                       # the bar, not the plain lines
    assert text.rstrip().splitlines()[-1].startswith(f"{LOG_PREFIX} done: 6/6 steps")


# ---- MFU ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, precision, tf32, part, peak", [
    ("NVIDIA H100 80GB HBM3", "bf16", False, "NVIDIA H100 SXM", 989.5),
    ("NVIDIA H100 80GB HBM3", "fp32", False, "NVIDIA H100 SXM", 67.0),
    ("NVIDIA H100 80GB HBM3", "fp32", True, "NVIDIA H100 SXM", 494.5),   # TF32 Tensor Cores
    ("NVIDIA H100 PCIe", "bf16", False, "NVIDIA H100 PCIe", 756.5),
    ("NVIDIA H100 NVL", "bf16", False, "NVIDIA H100 NVL", 835.5),
    ("NVIDIA H200", "bf16", False, "NVIDIA H200 SXM", 989.5),
    ("NVIDIA GH200 480GB", "bf16", False, "NVIDIA GH200", 989.5),
    ("NVIDIA B200", "bf16", False, "NVIDIA B200", 2250.0),
    ("NVIDIA GB200", "bf16", False, "NVIDIA GB200", 2500.0),
    ("NVIDIA A100-SXM4-80GB", "bf16", False, "NVIDIA A100", 312.0),
    ("NVIDIA A100 80GB PCIe", "fp32", False, "NVIDIA A100", 19.5),
    ("NVIDIA L40S", "bf16", False, "NVIDIA L40S", 362.05),
    ("AMD Instinct MI300X", "bf16", False, "AMD Instinct MI300X", 1307.4),
    ("AMD Instinct MI300X", "fp32", True, "AMD Instinct MI300X", 163.4),  # no TF32 entry: FP32
    ("AMD Instinct MI355X", "bf16", False, "AMD Instinct MI355X", 2516.6),
    ("AMD Instinct MI250X/MI250", "bf16", False, "AMD Instinct MI250X (one die)", 191.5),
])
def test_the_peak_table_knows_the_data_centre_parts(name, precision, tf32, part, peak):
    found = table_peak(name, precision, tf32)
    assert found is not None and found.tflops == peak and found.source.startswith(part + ", ")


@pytest.mark.parametrize("name", ["NVIDIA L40", "NVIDIA A10G", "NVIDIA GeForce RTX 4090",
                                  "Intel(R) Xeon(R) Platinum 8480+", ""])
def test_a_part_the_table_does_not_know_has_no_peak(name):
    assert table_peak(name, "bf16") is None


def test_a_gpu_is_looked_up_by_its_name_in_the_runs_precision(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    cuda = torch.device("cuda")
    assert throughput.find_peak(cuda, "auto", None).tflops == 989.5      # bf16 autocast on CUDA
    assert throughput.find_peak(cuda, "fp32", None).tflops == 67.0
    before = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("high")
        assert throughput.find_peak(cuda, "fp32", None).source == "NVIDIA H100 SXM, tf32"
    finally:
        torch.set_float32_matmul_precision(before)
    assert throughput.find_peak(cuda, "bf16", 400.0).tflops == 400.0     # train.peak_tflops wins
    assert throughput.find_peak(torch.device("cpu"), "auto", None) is None
    assert throughput.find_peak(torch.device("cpu"), "auto", 2.5).source == "train.peak_tflops"


class Windows:
    """Random windows of a fixed token stream (``BATCH x SEQ`` tokens per batch)."""

    def __init__(self) -> None:
        self.tokens = torch.randint(0, 32, (512,), generator=torch.Generator().manual_seed(1))
        self.gen = torch.Generator().manual_seed(0)

    def next_batch(self):
        starts = torch.randint(0, 512 - 17, (4,), generator=self.gen)
        window = self.tokens[starts[:, None] + torch.arange(17)]
        return window[:, :-1], window[:, 1:]

    def state_dict(self) -> dict:
        return {"generator": self.gen.get_state()}

    def load_state_dict(self, state: dict) -> None:
        self.gen.set_state(state["generator"])


@pytest.mark.parametrize("tied", [True, False])
def test_mfu_against_a_hand_computation(tmp_path, monkeypatch, capsys, tied):
    """A model of known size on an "H100 SXM" (its name mocked) whose every step takes 0.5 s (the
    clock mocked): float32 matmuls, so the peak is the datasheet's 67 TFLOP/s."""
    ticks = iter(range(10**6))
    monkeypatch.setattr(loop, "perf_counter", lambda: 0.5 * next(ticks))
    monkeypatch.setattr(throughput, "device_name", lambda device: "NVIDIA H100 80GB HBM3")
    vocab, dim, layers, seq, batch, accum = 32, 32, 2, 16, 4, 2
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=2, max_seq_len=seq,
                                   scheme="siamese", tie_embeddings=tied))
    # 6 N + 12 L d T (Kaplan et al. / PaLM): N counts every weight a token's matmuls use once, the
    # output projection included and the embedding lookup left out
    head = vocab * dim
    weights = sum(p.numel() for name, p in model.named_parameters() if not name.startswith("embed.")) \
        + (head if tied else 0)
    flops = 6 * weights + 12 * layers * dim * seq
    tokens_per_s = batch * seq * accum / 0.5
    tflops = flops * tokens_per_s / 1e12
    cfg = TrainConfig(steps=4, lr=1e-3, warmup=1, eval_every=4, checkpoint_every=4, grad_accum=accum,
                      log_every=2)
    summary = train_engine(model, Windows(), cfg, tmp_path / "run", progress=None)
    assert summary["flops_per_token"] == flops
    assert summary["tokens_per_s"] == pytest.approx(tokens_per_s, rel=1e-12)
    assert summary["tflops"] == pytest.approx(tflops, rel=1e-12)
    assert summary["mfu"] == pytest.approx(tflops / 67.0, rel=1e-12)
    assert summary["peak_tflops"] == 67.0 and summary["peak_tflops_source"] == "NVIDIA H100 SXM, fp32"
    for row in rows(tmp_path / "run"):
        assert row["tflops"] == pytest.approx(tflops, rel=1e-12)
        assert row["mfu"] == pytest.approx(tflops / 67.0, rel=1e-12)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 3 and all(f"MFU {100 * tflops / 67.0:.3g}%" in line for line in lines), lines
    assert f"{tflops:.3g} TFLOP/s" in lines[0] and "elapsed " in lines[0]
    # the ETA: this session's time per step (two steps: four clock ticks each) times steps left
    assert lines[0].endswith("| ETA 4.0s"), lines[0]


def test_a_diverged_run_ends_with_a_line_that_says_so(tmp_path, capsys):
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=32, dim=32, n_layers=2, n_heads=2, max_seq_len=16,
                                   scheme="post"))
    cfg = TrainConfig(steps=20, lr=1e4, warmup=0, eval_every=20, checkpoint_every=20, log_every=0)
    summary = train_engine(model, Windows(), cfg, tmp_path / "run")
    assert summary["diverged"]
    lines = capsys.readouterr().err.splitlines()
    assert lines == [lines[-1]] and lines[-1].startswith(
        f"{LOG_PREFIX} diverged at step {summary['diverged_at']}/20 after "), lines


def test_a_library_call_with_progress_false_prints_nothing(tmp_path, capsys):
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, max_seq_len=16))
    train_engine(model, Windows(), TrainConfig(steps=2, warmup=0, eval_every=2, checkpoint_every=2),
                 tmp_path / "run", progress=False)
    assert capsys.readouterr().err == ""


# ---- bad values -----------------------------------------------------------------------------------
@pytest.mark.parametrize("override, fragment", [
    ("train.log_every=-1", "train.log_every must not be negative"),
    ("train.log_every=2.5", "train.log_every must be an integer, got 2.5"),
    ("train.log_every=often", "train.log_every must be an integer, got 'often'"),
    ("train.log_every=true", "train.log_every must be an integer, got True"),
    ("train.peak_tflops=0", "train.peak_tflops must be a positive number"),
    ("train.peak_tflops=-989", "train.peak_tflops must be a positive number"),
    ("train.peak_tflops=fast", "train.peak_tflops must be a number, got 'fast'"),
    ("train.peak_tflops=.inf", "train.peak_tflops must be finite"),
])
def test_bad_logging_values_are_one_line_and_status_2(tmp_path, capsys, override, fragment):
    out = tmp_path / "run"
    assert main(["train", "tiny", override, "--out", str(out)]) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("siamesenorm train: error: ") and fragment in lines[0], lines[0]
    assert not out.exists()

