"""``compare --jobs N``: several runs at once, each in its own process with its share of the cores.

Each run of a concurrent comparison has exactly the losses of the same run trained alone with the
same thread count; SIGTERM stops every run with a checkpoint and the same command resumes each
exactly; kill -9 of the comparison stops its workers with a checkpoint too; a run that crashes
does not stop its neighbour; the folders stay locked; bad values are one line. The choice of
``auto``, the GPU device assignment and the ETA are checked on mocked machines and clocks.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from siamesenorm.cli import main
from siamesenorm.errors import ConfigError
from siamesenorm.experiments.eta import Eta
from siamesenorm.experiments.jobs import (
    WORK_PER_PROCESS,
    available_cores,
    check_jobs,
    choose,
    threads_of,
    visible_devices,
    work_per_run,
    work_per_step,
)
from siamesenorm.experiments.view import GridView
from siamesenorm.experiments.workers import worker_env
from siamesenorm.tasks import load_config
from siamesenorm.tasks.dryrun import memory_floor

SRC = str(Path(__file__).resolve().parents[1] / "src")
TINY = ("train.warmup=0", "data.max_bytes=40000")


def cli(*args: str, threads: int = 1, extra_path: str | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads),
               PYTHONPATH=os.pathsep.join(p for p in (extra_path, SRC, os.environ.get("PYTHONPATH")) if p))
    return subprocess.run([sys.executable, "-m", "siamesenorm", *args], capture_output=True, text=True,
                          env=env, timeout=300)


def in_process(capfd, *args: str) -> subprocess.CompletedProcess:
    """``siamesenorm ARGS`` in this process (:func:`siamesenorm.cli.main`), as :func:`cli` gives
    it: its status, and what it and the workers it starts printed. For what does not depend on
    the comparison's own process being a fresh one (the signals do: those tests start one)."""
    capfd.readouterr()
    code = main(list(args))
    out, err = capfd.readouterr()
    return subprocess.CompletedProcess(list(args), code, out, err)


def rows(run_dir: Path) -> list[tuple]:
    """Every logged step's figures, the timing left out."""
    out = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        out.append((row["step"], row.get("loss"), row.get("grad_norm"), row.get("val_loss")))
    return out


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


NAMES = ("pre-lr0.001-s0", "siamese-lr0.001-s0")


def train_alone(grid: tuple, out: Path, threads: int, capsys) -> list[str]:
    """``grid`` (``compare`` arguments) one run after the other in this process with ``threads``
    intra-op threads; the lines it printed."""
    import torch

    from siamesenorm.cli import _split_preset
    from siamesenorm.experiments import compare

    preset, overrides = _split_preset([a for a in grid[1:grid.index("--schemes")]])
    schemes = grid[grid.index("--schemes") + 1].split(",")
    lrs = [float(x) for x in grid[grid.index("--lrs") + 1].split(",")] if "--lrs" in grid else None
    lines: list[str] = []
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        compare(preset, overrides, out, schemes=schemes, lrs=lrs, jobs=1, log=lines.append)
    finally:
        torch.set_num_threads(before)
    err = capsys.readouterr().err
    assert ": started, " in err and ": [train] " in err and "[train] step" not in err   # as workers'
    return lines


def test_each_run_of_jobs_2_has_the_losses_of_the_same_run_trained_alone(tmp_path, capfd, counted):
    """Two runs at once, one of which diverges (lr 1e4) while the other trains on. The comparison
    runs in this process, its workers in theirs (what they print is captured with its own). The
    two runs share one data setting: compare loads it once and fits each run's configuration to it
    once, and the workers, handed both, load and fit nothing (counted by COUNT)."""
    grid = ("compare", "tiny", *TINY, "train.steps=8", "train.eval_every=4", "--schemes", "siamese",
            "--lrs", "1e-3,1e4")
    both = in_process(capfd, *grid, "--jobs", "2", "--out", str(tmp_path / "both"))
    assert both.returncode == 0, both.stderr
    assert counted() == {"load": 1, "fit": 2}
    threads = max(1, available_cores() // 2)
    out = both.stdout.splitlines()
    assert out[0] == f"compare: 2 runs at once, {threads} thread{'s' if threads > 1 else ''} each " \
                     f"(--jobs 2 on {available_cores()} core{'s' if available_cores() > 1 else ''})"
    ended = [line for line in out if line.startswith("  ")]
    assert len(ended) == 2 and "1/2 done, ETA " in ended[0] and "2/2 done in " in ended[1]
    assert out.index(ended[1]) < out.index(next(x for x in out if x.startswith("scheme")))
    # each run's start and its own final line, after its name; not its step lines
    assert "siamese-lr0.001-s0: started, 8 steps" in both.stderr and "[train] step" not in both.stderr
    assert "siamese-lr0.001-s0: [train] done: 8/8 steps" in both.stderr
    assert "siamese-lr10000-s0: [train] diverged at step " in both.stderr
    # alone: one run at a time in this process, with the thread count each concurrent run had
    lines = train_alone(grid, tmp_path / "alone", threads, capfd)
    assert lines[0].startswith(f"compare: 1 run at a time, {threads} thread")
    assert summary(tmp_path / "both" / "siamese-lr10000-s0")["diverged"]
    for name in ("siamese-lr0.001-s0", "siamese-lr10000-s0"):
        a, b = tmp_path / "both" / name, tmp_path / "alone" / name
        assert rows(a) == rows(b) and len(rows(a)) == (8 if "lr0.001" in name else len(rows(b)))
        assert summary(a)["environment"]["threads"] == summary(b)["environment"]["threads"] == threads
        assert summary(a)["final_val_loss"] == summary(b)["final_val_loss"]
    assert _table(tmp_path / "both") == _table(tmp_path / "alone")


def _table(out: Path) -> list[dict]:
    """``summary.csv`` but the speed (tokens/s, TFLOP/s, MFU)."""
    import csv

    with open(out / "summary.csv") as f:
        return [{k: v for k, v in r.items() if k not in ("tokens_per_s", "tflops", "mfu")}
                for r in csv.DictReader(f)]


# What a worker process runs first (a sitecustomize on its PYTHONPATH); the comparison's own
# process (``-m siamesenorm compare``) and the reference runs are left alone. SLOW_STEP_S: sleep
# that long before each step (wall time only: the numbers are untouched); CRASH_RUN: in the run of
# that name, raise in the training loop before step 3.
INJECT = '''import os, sys, time
if len(sys.argv) > 1 and os.path.isdir(sys.argv[1]):
    from siamesenorm.train import loop

    compute = loop.Trainer.compute
    crash = sys.argv[1].endswith(os.environ.get("CRASH_RUN", "/"))
    pause = float(os.environ.get("SLOW_STEP_S", "0"))

    def injected(self, *args, **kwargs):
        if crash and self.state.step == 2:
            raise RuntimeError("injected crash at step 3")
        time.sleep(pause)
        return compute(self, *args, **kwargs)

    loop.Trainer.compute = injected
'''


@pytest.fixture
def inject(tmp_path) -> str:
    """A folder holding the injection, for a worker's PYTHONPATH."""
    folder = tmp_path / "inject"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(INJECT)
    return str(folder)


def _until_trained(proc: subprocess.Popen, out: Path, names) -> None:
    """Wait while ``proc`` runs until every run of ``out`` in ``names`` has trained a step (a row
    in its metrics.jsonl: compare no longer shows the runs' step lines)."""
    import time

    deadline = time.monotonic() + 120
    while not all((out / n / "metrics.jsonl").is_file() and (out / n / "metrics.jsonl").stat().st_size
                  for n in names):
        assert proc.poll() is None, "the comparison ended before every run had trained a step"
        assert time.monotonic() < deadline, "no step trained in 120 s"
        time.sleep(0.05)


def _slowed(*args: str, inject: str, pause: float = 0.02) -> subprocess.Popen:
    """``siamesenorm ARGS`` in a process of its own, each training step ``pause`` seconds longer
    (a run of 3 s at least: a signal comes mid-way however fast the machine is); its output in
    pipes."""
    env = dict(os.environ, OMP_NUM_THREADS="1", SLOW_STEP_S=str(pause),
               PYTHONPATH=os.pathsep.join(p for p in (inject, SRC, os.environ.get("PYTHONPATH")) if p))
    return subprocess.Popen([sys.executable, "-m", "siamesenorm", *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)


def test_sigterm_stops_every_run_with_a_checkpoint_and_the_same_command_resumes_each_exactly(
        tmp_path, capsys, inject):
    # 60 steps of 50 ms at least (3 s a run): a checkpoint and a validation before and after
    # wherever the signal comes
    grid = ("compare", "tiny", *TINY, "train.steps=60", "train.checkpoint_every=20",
            "train.eval_every=30", "train.log_every=2", "--schemes", "pre,siamese", "--jobs", "2")
    threads = max(1, available_cores() // 2)
    train_alone(grid[:grid.index("--jobs")], tmp_path / "reference", threads, capsys)
    out = tmp_path / "exp"
    proc = _slowed(*grid, "--out", str(out), inject=inject, pause=0.05)
    try:
        _until_trained(proc, out, NAMES)
        # while it trains, the experiment and each run are locked
        assert main([*grid, "--out", str(out)]) == 2
        assert main(["train", "--resume", "--out", str(out / NAMES[0])]) == 2
        refusals = capsys.readouterr().err.strip().splitlines()
        assert len(refusals) == 2 and all("is in use by `siamesenorm compare`" in r for r in refusals)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, stderr
    assert "compare: SIGTERM: stopping the 2 running runs" in stderr
    assert stderr.rstrip().endswith("siamesenorm compare: terminated (SIGTERM)")
    stopped = {}
    for name in NAMES:
        s = summary(out / name)
        assert s["interrupted"] and 0 < s["steps"] < 60 and s["checkpoint_step"] == s["steps"], s
        assert f"  {name}: interrupted at step {s['steps']}" in stdout
        stopped[name] = s["steps"]
    assert not (out / "summary.csv").exists()
    assert main([*grid, "--out", str(out)]) == 0        # the same command (here in this process)
    again = capsys.readouterr()
    assert "skipped" not in again.out
    for name in NAMES:
        resumed, whole = out / name, tmp_path / "reference" / name
        assert rows(resumed) == rows(whole) and len(rows(whole)) == 60
        assert summary(resumed)["final_val_loss"] == summary(whole)["final_val_loss"]
        # the second session went on from where the first stopped
        assert f"{name}: resumed at step {stopped[name]}/60" in again.err


def test_a_stop_while_runs_wait_to_start_ends_the_comparison(tmp_path, inject):
    """Three runs, two at once: SIGTERM while the third waits stops the two running ones and the
    comparison exits (it looped forever with nothing running and one run pending), starting none."""
    grid = ("compare", "tiny", *TINY, "train.steps=100000", "train.eval_every=100000",
            "train.checkpoint_every=100000", "train.divergence_factor=1e9", "train.log_every=1",
            "--schemes", "pre,siamese,post", "--jobs", "2", "--out", str(tmp_path / "exp"))
    proc = _slowed(*grid, inject=inject)
    try:
        _until_trained(proc, tmp_path / "exp", NAMES)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, stderr
    assert "post-lr0.001-s0: training" not in stdout + stderr
    assert not (tmp_path / "exp" / "post-lr0.001-s0" / "summary.json").exists()
    for name in NAMES:
        assert summary(tmp_path / "exp" / name)["interrupted"]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_workers_stop_with_a_checkpoint_when_the_comparison_is_killed(tmp_path, inject):
    """kill -9 of ``compare`` (no handler runs): each worker gets SIGTERM from the kernel
    (PR_SET_PDEATHSIG), checkpoints and stops, and gives its run's lock back."""
    import time

    from siamesenorm.locks import check_free

    out = tmp_path / "exp"
    grid = ("compare", "tiny", *TINY, "train.steps=100", "train.log_every=1", "--schemes", "pre,siamese",
            "--jobs", "2", "--out", str(out))
    env = dict(os.environ, OMP_NUM_THREADS="1", SLOW_STEP_S="0.05",
               PYTHONPATH=os.pathsep.join(p for p in (inject, SRC, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.Popen([sys.executable, "-m", "siamesenorm", *grid], text=True, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        _until_trained(proc, out, NAMES)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all((out / n / "summary.json").exists() for n in NAMES):
        time.sleep(0.2)
    for name in NAMES:
        s = summary(out / name)
        assert s["interrupted"] and 0 < s["steps"] < 100 and s["checkpoint_step"] == s["steps"], s
    for name in NAMES:      # the worker gives the run's lock back as it exits
        while True:
            try:
                check_free(out / name, "compare")
                break
            except ConfigError:
                assert time.monotonic() < deadline, f"{name} is still held"
                time.sleep(0.2)


def test_repeated_parent_death_signals_stop_a_worker_once():
    """Linux sends the parent-death signal once per thread of the dying parent that the worker is
    handed to (kill -9 of a compare with threads): the worker turns the first into one SIGTERM, a
    checkpoint at the step boundary, and ignores the rest. (Before, the second SIGTERM stopped the
    step in flight without a checkpoint and a third, after training, killed the process before
    its summary: the test above failed on a loaded machine.)"""
    script = """
import os, signal
from siamesenorm.tasks import worker
from siamesenorm.train.interrupt import DeferredInterrupt
signal.signal(worker.PARENT_DEATH_SIGNAL, worker._parent_died)
with DeferredInterrupt() as stop:
    for _ in range(3):
        os.kill(os.getpid(), worker.PARENT_DEATH_SIGNAL)
    for _ in range(10000):    # the handlers run between bytecodes
        pass
    print(stop.requested, stop.terminated)
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (SRC, os.environ.get("PYTHONPATH")) if p))
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["True", "True"]


# Counts every load and fit of the language-model task's data, in whatever process it happens
# (compare's own, its workers'), one line each in $COUNT_FILE.
COUNT = '''import dataclasses, os
from siamesenorm.tasks import registry

_task = registry.TASKS["lm"]


def _counted(what, fn):
    def call(*args, **kwargs):
        with open(os.environ["COUNT_FILE"], "a") as file:
            file.write(what + "\\n")
        return fn(*args, **kwargs)
    return call


registry.TASKS["lm"] = dataclasses.replace(_task, load_data=_counted("load", _task.load_data),
                                           fit=_counted("fit", _task.fit))
'''


@pytest.fixture
def counted(tmp_path, monkeypatch):
    """Counts every load and fit of the language-model task's data from here on, in this process
    and in the workers it starts (COUNT); returns a function that reads the counts so far."""
    from siamesenorm.tasks import registry

    folder = tmp_path / "count"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(COUNT)
    counts = tmp_path / "counts.txt"
    monkeypatch.setenv("COUNT_FILE", str(counts))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH"))
                                                     if p))
    monkeypatch.setitem(registry.TASKS, "lm", registry.TASKS["lm"])      # put back after
    exec(COUNT, {})

    def read() -> dict[str, int]:
        lines = counts.read_text().split() if counts.exists() else []
        return {"load": lines.count("load"), "fit": lines.count("fit")}
    return read


def test_compare_loads_each_data_setting_once_and_fits_each_run_once(tmp_path, capfd, counted):
    """Two runs of one data setting: the data is loaded once (in compare) and each run's
    configuration fitted to it once. The comparison runs in this process, one run after the other
    (``--jobs 1``); with workers (``--jobs 2``, which get the data handed over, each its own copy,
    and trust the fitted config.yaml): the first test."""
    res = in_process(capfd, "compare", "tiny", *TINY, "train.steps=2", "train.eval_every=2", "--schemes",
                     "pre,siamese", "--jobs", "1", "--out", str(tmp_path / "exp"))
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "exp" / "summary.csv").exists()
    assert counted() == {"load": 1, "fit": 2}


def test_a_run_that_crashes_does_not_stop_its_neighbour(tmp_path, monkeypatch, inject, capfd):
    """A crash (an exception in the training loop of one worker, injected by a sitecustomize that
    only that run's process acts on) leaves the other run training; the same command then trains
    the failed run alone, from its checkpoint. (A divergence: the first test.) The comparison
    runs in this process, its workers in theirs."""
    monkeypatch.setenv("CRASH_RUN", "siamese-lr0.001-s0")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (inject, os.environ.get("PYTHONPATH")) if p))
    out = tmp_path / "exp"
    grid = ("compare", "tiny", *TINY, "train.steps=6", "train.eval_every=3", "train.checkpoint_every=2",
            "--schemes", "pre,siamese", "--jobs", "2", "--out", str(out))
    res = in_process(capfd, *grid)
    assert res.returncode == 1, res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("siamesenorm compare: error: 1 of 2 runs failed (siamese-lr0.001-s0: "
                           "RuntimeError: injected crash at step 3 (traceback: ")
    traceback = Path(last.split("(traceback: ")[1].split(")")[0])
    assert "injected crash" in traceback.read_text()
    shutil.rmtree(traceback.parent)
    assert "  siamese-lr0.001-s0: failed: RuntimeError: injected crash at step 3" in res.stdout
    assert summary(out / "pre-lr0.001-s0")["steps"] == 6 and "pre-lr0.001-s0: [train] done: 6/6" in res.stderr
    assert "siamese-lr0.001-s0: started, 6 steps" in res.stderr and "[train] step" not in res.stderr
    assert not (out / "siamese-lr0.001-s0" / "summary.json").exists()
    assert not (out / "summary.csv").exists() and not (out / "report.md").exists()
    # without the crash, the same command trains only the failed run, from its checkpoint
    monkeypatch.delenv("CRASH_RUN")
    assert main(list(grid)) == 0        # the same command
    again = capfd.readouterr()
    assert again.out.count("skipped") == 1
    assert "siamese-lr0.001-s0: resumed from its last checkpoint, 6 steps in all" in again.err
    assert summary(out / "siamese-lr0.001-s0")["steps"] == 6 and (out / "summary.csv").exists()


@pytest.mark.parametrize("value, fragment", [
    ("0", "must be at least 1 (runs at once) or auto, got 0"),
    ("-1", "must be at least 1 (runs at once) or auto, got -1"),
    ("two", "must be a whole number of runs at once (1 or more) or auto, got 'two'"),
    ("1.5", "got '1.5'"),
    ("", "got ''"),
])
def test_bad_jobs_on_the_command_line_are_one_line(tmp_path, capsys, value, fragment):
    out = tmp_path / "exp"
    for argv in (["--jobs", value], [f"--jobs={value}"]):
        with pytest.raises(SystemExit) as exit_:
            main(["compare", "tiny", *argv, "--out", str(out)])
        assert exit_.value.code == 2
        [err] = capsys.readouterr().err.strip().splitlines()
        assert err.startswith("siamesenorm compare: error: argument --jobs: ") and fragment in err
    assert not out.exists()


@pytest.mark.parametrize("value, fragment", [
    (0, "compare.jobs must be at least 1 (runs at once) or auto, got 0"),
    (-1, "compare.jobs must be at least 1"),
    ("many", "compare.jobs must be a whole number of runs at once (1 or more) or auto, got 'many'"),
    (True, "compare.jobs must be a whole number"),
    (2.5, "compare.jobs must be a whole number"),
])
def test_bad_jobs_in_a_preset_are_one_line_and_write_nothing(tmp_path, capsys, value, fragment):
    preset = tmp_path / "p.yaml"
    preset.write_text(yaml.safe_dump({"compare": {"schemes": ["pre"], "jobs": value}}))
    out = tmp_path / "exp"
    assert main(["compare", str(preset), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and fragment in err[0] and not out.exists()


def test_jobs_with_nproc_is_refused_in_one_line_and_auto_then_trains_one_at_a_time(tmp_path, capsys):
    out = tmp_path / "exp"
    assert main(["compare", "tiny", "--nproc", "2", "--jobs", "2", "--out", str(out)]) == 2
    [err] = capsys.readouterr().err.strip().splitlines()
    assert "--jobs 2 with --nproc 2: each run already spans several processes" in err
    assert not out.exists()
    cells = _cells(64, 12)
    assert choose(cells, "auto", nproc=2, cores=8).jobs == 1
    assert choose(cells, 1, nproc=2, cores=8).jobs == 1


def test_the_preset_and_the_command_line_set_jobs():
    from siamesenorm.experiments.grid import check_section, plan

    assert check_section({"compare": {"jobs": "auto"}}, None)["jobs"] == "auto"
    assert check_section({"compare": {"jobs": 3}}, None)["jobs"] == 3
    assert plan("default", []).jobs == "auto"           # the default comparison
    assert check_jobs("4", "--jobs") == 4 and check_jobs(" AUTO ", "--jobs") == "auto"
    with pytest.raises(ConfigError, match="--jobs must be at least 1"):
        check_jobs("0", "--jobs")


# ---- the choice, on mocked machines ---------------------------------------------------------------
def _cells(dim: int, n: int, device: str = "cpu", layers: int = 12) -> list:
    cfg = load_config("default", [f"model.dim={dim}", f"model.n_layers={layers}", f"train.device={device}"])
    return [SimpleNamespace(config=cfg)] * n


def test_auto_on_the_cpu_runs_one_run_per_core_and_gives_the_cores_left_over_as_threads(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)       # set by conftest: it would win
    small = _cells(64, 12)
    pick = choose(small, "auto", cores=2, memory=1 << 40)
    assert (pick.jobs, pick.threads) == (2, 1)
    gflop = 6 * small[0].config.model.estimated_parameters() * 8 * 128 / 1e9     # batch 8 x 128
    assert pick.line() == f"compare: 2 runs at once, 1 thread each (auto: width 64, {gflop:.3g} GFLOP a " \
                          "step, on 2 cores)"
    assert (choose(small, "auto", cores=32, memory=1 << 40).jobs, choose(small, "auto", cores=32,
                                                                         memory=1 << 40).threads) == (12, 2)
    pick = choose(small[:3], "auto", cores=32, memory=1 << 40)       # no more than the grid's runs
    assert (pick.jobs, pick.threads) == (3, 10)
    assert (choose(_cells(256, 12), "auto", cores=2, memory=1 << 40).jobs,
            choose(_cells(256, 12), "auto", cores=1, memory=1 << 40).jobs) == (2, 1)
    # runs too short to pay for a process each (the tiny preset: 20 steps) train here, one at a time
    tiny = [SimpleNamespace(config=load_config("tiny", []))] * 4
    pick = choose(tiny, "auto", cores=8, memory=1 << 40)
    assert (pick.jobs, pick.threads) == (1, 8) and "too little to pay for a process each" in pick.line()
    assert work_per_run(tiny[0].config) == 20 * work_per_step(tiny[0].config) < WORK_PER_PROCESS
    assert choose(tiny, 2, cores=8).jobs == 2            # unless asked
    # memory: no more at once than half the machine's memory holds by the runs' floor
    floor = memory_floor(small[0].config)["total"]
    assert choose(small, "auto", cores=32, memory=0).jobs == 1
    assert choose(small, "auto", cores=32, memory=10 * floor).jobs == 5
    # an explicit number is taken as given; the threads are the cores it leaves each
    assert (choose(small, 3, cores=8).jobs, choose(small, 3, cores=8).threads) == (3, 2)
    assert choose(small, 4, cores=2).threads == 1


def test_on_cuda_each_run_at_once_gets_its_own_device(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    gpus = _cells(64, 12, "cuda")
    pick = choose(gpus, "auto", cores=16, cuda_count=4)
    assert (pick.jobs, pick.threads, pick.devices) == (4, 4, ("0", "1", "2", "3"))
    assert "CUDA device 0, 1, 2, 3" in pick.line() and "one run per CUDA device" in pick.line()
    assert choose(gpus[:2], "auto", cores=16, cuda_count=4).devices == ("0", "1")
    assert choose(gpus, 6, cores=12, cuda_count=4).devices == ("0", "1", "2", "3", "0", "1")
    # the devices this process was given are the ones its children share out
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5,7")
    assert visible_devices(2) == ["5", "7"]
    assert choose(gpus, "auto", cores=16, cuda_count=2).devices == ("5", "7")
    # a named device: the runs share it, one at a time unless asked
    named = _cells(64, 12, "cuda:1")
    assert choose(named, "auto", cores=16, cuda_count=4).jobs == 1
    assert choose(named, 2, cores=16, cuda_count=4).devices is None
    # what a worker of slot 1 is started with
    env = worker_env(4, "7", Path("/tmp/x"), base={"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "5,7"})
    assert env["CUDA_VISIBLE_DEVICES"] == "7" and env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == "4"
    assert worker_env(1, None, Path("/tmp/x"), base={"CUDA_VISIBLE_DEVICES": "5,7"})["CUDA_VISIBLE_DEVICES"] \
        == "5,7"


def test_a_resumed_run_keeps_the_thread_count_it_started_with():
    assert threads_of({"environment": {"threads": 2}}, 1) == 2
    assert threads_of({"environment": {}}, 1) == 1 and threads_of(None, 3) == 3
    assert threads_of({"environment": {"threads": True}}, 1) == 1


def test_the_eta_is_the_work_left_at_the_speed_so_far():
    now = [100.0]
    eta = Eta(clock=lambda: now[0])
    eta.add("a", 100, 1.0)
    eta.add("b", 100, 1.0)
    eta.add("c", 50, 2.0)             # half the steps, twice the work a step
    assert eta.seconds_left() is None
    eta.start()
    now[0] = 110.0
    eta.progress("a", 50)
    eta.progress("b", 50)              # 100 of 300 units in 10 s
    assert eta.seconds_left() == pytest.approx(20.0)
    eta.finished("a", 20)              # a diverged at step 20 of this session: the rest leaves
    assert eta.work_left() == pytest.approx(50 + 100) and eta.seconds_left() == pytest.approx(10 * 150 / 70)
    eta.finished("b")                  # failed: what its log said it did
    eta.finished("c", 50)
    assert eta.seconds_left() == 0.0


def test_one_at_a_time_a_run_that_raises_does_not_stop_the_next_either(tmp_path, monkeypatch, capsys):
    from siamesenorm.experiments import compare, training
    from siamesenorm.experiments.training import RunsFailed

    real = training.run_task

    def failing(cfg, run_dir, **kwargs):
        if Path(run_dir).name.startswith("pre-"):
            raise RuntimeError("boom")
        return real(cfg, run_dir, **kwargs)

    monkeypatch.setattr(training, "run_task", failing)
    lines: list[str] = []
    with pytest.raises(RunsFailed, match=r"^1 of 2 runs failed \(pre-lr0.001-s0: RuntimeError: boom\); "):
        compare("tiny", [*TINY, "train.steps=2"], tmp_path / "exp", schemes=["pre", "siamese"], jobs=1,
                log=lines.append)
    assert "  pre-lr0.001-s0: failed: RuntimeError: boom; 1/2 done, ETA ?" in lines
    assert summary(tmp_path / "exp" / "siamese-lr0.001-s0")["steps"] == 2
    assert "RuntimeError: boom" in capsys.readouterr().err          # its traceback


def test_each_run_at_once_gets_its_slot_s_device_and_its_folder_stays_locked(tmp_path, monkeypatch):
    """train_in_workers with a stand-in for the worker process: three runs over two slots on two
    CUDA devices; the third takes the device of the slot that came free."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    from siamesenorm.experiments import training
    from siamesenorm.experiments.compare import load_data
    from siamesenorm.experiments.grid import plan
    from siamesenorm.experiments.jobs import Concurrency
    from siamesenorm.locks import held_by

    started, running = [], set()

    class StandIn:
        def __init__(self, name, run_dir, resume, threads, device, lock_fd, on_line, data):
            self.name, self.run_dir, self.device, self.lock_fd = name, run_dir, device, lock_fd
            assert isinstance(data, bytes)      # a fresh run gets its data, pickled
            self.signals, self.polls = 0, 0

        def start(self):
            assert self.device not in {w.device for w in running} and len(running) < 2
            running.add(self)
            started.append((self.name, self.device))

        def poll(self):
            assert held_by(self.run_dir)["pid"] == os.getpid() and isinstance(self.lock_fd, int)
            self.polls += 1
            return 0 if self.polls > (2 if self.name.startswith("pre") else 4) else None

        def finish(self):
            running.discard(self)
            return 1, training.Failure("stand-in")

    monkeypatch.setattr(training, "Worker", StandIn)
    p = plan("tiny", list(TINY), schemes=["pre", "post", "siamese"])
    cells, data = load_data(p.cells)
    todo = [training.Todo(i, cell, tmp_path / cell.name, None) for i, cell in enumerate(cells, 1)]
    eta = Eta()
    for item in todo:
        eta.add(item.cell.name, 20, 1.0)
    summaries, failures, lines = {}, {}, []
    view = GridView(3, 0, eta, io.StringIO())
    training.train_in_workers(todo, Concurrency(2, 1, ("0", "1"), "test"), data,
                              training.Finished(view, lines.append), summaries, failures,
                              lines.append)
    assert started == [("pre-lr0.001-s0", "0"), ("post-lr0.001-s0", "1"), ("siamese-lr0.001-s0", "0")]
    assert set(failures) == {c.name for c in p.cells} and not running
    assert all(held_by(tmp_path / c.name) is None for c in p.cells)       # every lock given back


def test_a_run_that_ended_before_a_stop_reached_it_is_reported_finished(tmp_path, monkeypatch):
    """After Ctrl-C, a worker whose run had written its final summary (``done: 300/300``) is a
    finished run, not one "stopped before its first step"; an interrupted one stays interrupted."""
    from siamesenorm.experiments import training

    calls = []
    done = SimpleNamespace(finished=lambda item, s: calls.append(("finished", s["steps"])),
                           interrupted=lambda item, s: calls.append(("interrupted", s and s["steps"])),
                           failed=lambda item, f: calls.append(("failed", f.line)))
    item = SimpleNamespace(cell=SimpleNamespace(name="pre"), run_dir=str(tmp_path), start_step=0)
    (tmp_path / "summary.json").write_text("{}")
    for code, interrupted in ((0, False), (143, False), (143, True)):
        figures = {"steps": 300 if not interrupted else 120, "interrupted": interrupted}
        monkeypatch.setattr(training, "read_summary", lambda path, f=figures: f)
        summaries, failures = {}, {}
        training._collect(item, code, None, True, done, summaries, failures)
        assert calls[-1] == (("interrupted", 120) if interrupted else ("finished", 300))
        assert bool(summaries) != interrupted and not failures


def test_more_jobs_than_runs_is_the_grid_size_and_the_line_says_so():
    """``--jobs 20000`` on a 4-run grid: 4 at once (not a memory refusal for 20000, nor a line
    promising 20000)."""
    four = _cells(64, 4)
    pick = choose(four, 20000, cores=2, memory=8 << 30)
    assert (pick.jobs, pick.threads) == (4, 1)
    assert pick.line() == ("compare: 4 runs at once, 1 thread each (--jobs 4 on 2 cores; --jobs 20000 "
                           "is more than the grid's 4 runs)")
    assert choose(four, 4, cores=2) == choose(four, 4, cores=2, memory=8 << 30)
    assert choose(four, 3, cores=2).jobs == 3
