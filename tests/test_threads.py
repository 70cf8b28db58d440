"""Threads chosen for the machine as it is (issue 51): the intra-op threads of ``train``, ``demo`` and
``compare`` follow the cores other processes leave free (affinity less the load average, faked here),
``--threads`` / ``train.threads`` / ``OMP_NUM_THREADS`` set them, and one line says which and why."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from helpers import cli_in_process as run
from siamesenorm import devices
from siamesenorm.devices import (
    Threads,
    check_threads,
    choose_threads,
    chosen_threads,
    run_threads,
    use_threads,
)
from siamesenorm.errors import UserError
from siamesenorm.experiments import training
from siamesenorm.experiments.jobs import choose
from siamesenorm.experiments.training import RunThreads, Todo
from siamesenorm.tasks import load_config

TINY = ("train.steps=4", "train.eval_every=4", "train.warmup=0", "data.max_bytes=40000")


@pytest.fixture
def machine(monkeypatch):
    """``machine(cores, load, busy=None)``: ``cores`` CPUs, a 1-minute load average of ``load`` (or a
    function giving it), ``busy`` of them busy now (default: as the load says, at most all), and no
    OMP_NUM_THREADS. Busy cores seen are handed the pids left out, in ``machine.excluded``."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    state = {"cores": 2, "load": 0.0, "busy": None}

    def load() -> float:
        return state["load"]() if callable(state["load"]) else state["load"]

    def busy_cores(exclude=()):
        set_machine.excluded.append(list(exclude))
        return min(load(), state["cores"]) if state["busy"] is None else state["busy"]

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(state["cores"])))
    monkeypatch.setattr(os, "getloadavg", lambda: (load(), load(), load()))
    monkeypatch.setattr(devices, "busy_cores", busy_cores)

    def set_machine(cores: int, load, busy: float | None = None) -> None:
        state.update(cores=cores, load=load, busy=busy)
    set_machine.excluded = []
    return set_machine


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "summary.json").read_text())


# ---- the one decision -----------------------------------------------------------------------------
def test_auto_takes_the_cores_other_processes_leave_free(machine):
    machine(2, 6.8)
    pick = choose_threads()
    assert pick == Threads(1, "2 cores, 2.0 busy, load 6.8", auto=True, seen=", 2.0 busy, load 6.8")
    assert pick.line() == "threads: 1 (2 cores, 2.0 busy, load 6.8)"
    machine(2, 0.3)         # a quiet machine: every core, as before
    assert choose_threads().count == 2
    machine(2, 0.6)         # more than half a core busy: that core is taken
    assert choose_threads().count == 1
    machine(8, 3.0)
    assert choose_threads().count == 5
    # the load average lags a minute: what the cores do now decides, both ways
    machine(2, 1.9, busy=0.1)       # a job that has just ended (or the previous command)
    assert choose_threads().line() == "threads: 2 (2 cores, 0.1 busy, load 1.9)"
    machine(2, 0.2, busy=2.0)       # jobs that have just begun
    assert choose_threads().count == 1
    machine(8, 0.0)         # shared by processes, within a ceiling (what the process had)
    assert choose_threads(processes=3).count == 2
    assert choose_threads(processes=3).line() == \
        "threads: 2 per process (3 processes on 8 cores, 0.0 busy, load 0.0)"
    assert choose_threads(ceiling=4).count == 4 and "the process had 4" in choose_threads(ceiling=4).why
    assert choose_threads(processes=16).count == 1          # never none
    machine.excluded.clear()        # one core at most: nothing to watch
    assert choose_threads(ceiling=1).count == 1 and machine.excluded == []


def test_busy_cores_are_read_from_proc_stat_leaving_out_the_processes_named(tmp_path, monkeypatch):
    """Two samples of /proc/stat 0.1 s apart: cpu1 (outside this process's CPUs) does not count, and
    the ticks of the processes left out are taken away."""
    samples = iter([(100, 400, 100, 900, 1000), (160, 440, 150, 950, 1060), (160, 440, 150, 950, 1060)])

    def write(_=None) -> None:
        busy0, idle0, busy2, idle2, pid_ticks = next(samples)
        (tmp_path / "stat").write_text(
            f"cpu  1 2 3 4 5 6 7 8 9 10\ncpu0 {busy0} 0 0 {idle0} 0 0 0 0 0 0\n"
            f"cpu1 999 0 0 0 0 0 0 0 0 0\ncpu2 {busy2} 0 0 {idle2} 0 0 0 0 0 0\nintr 1 2 3\n")
        (tmp_path / "42").mkdir(exist_ok=True)
        (tmp_path / "42" / "stat").write_text(f"42 (a (b) c) R {'0 ' * 10}{pid_ticks} 0 0 0 0\n")
    write()
    monkeypatch.setattr(devices, "PROC", tmp_path)
    monkeypatch.setattr(devices.time, "sleep", write)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 2})
    # 200 ticks on cpu0 and cpu2, 110 of them busy, 60 of those the left-out process's: 2 x 50/200
    assert devices.busy_cores([42, 99999]) == pytest.approx(0.5)
    assert devices.busy_cores() is None      # no tick between the samples: unknown, not a guess


def test_the_flag_then_omp_num_threads_then_train_threads_then_the_machine(machine, monkeypatch):
    machine(2, 6.8)
    assert choose_threads(3, 4) == Threads(3, "--threads 3")
    assert choose_threads(None, 4) == Threads(4, "train.threads=4")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert choose_threads(None, 4) == Threads(2, "OMP_NUM_THREADS=2")
    assert choose_threads(3, 4).count == 3
    for junk in ("", "0", "two", "4,2"):        # not a thread count: the machine decides
        monkeypatch.setenv("OMP_NUM_THREADS", junk)
        assert choose_threads().count == 1


@pytest.mark.parametrize("value, want", [(None, None), ("auto", None), (" AUTO ", None), (3, 3), ("2", 2)])
def test_thread_counts_and_auto_are_read(value, want):
    assert check_threads(value) == want


@pytest.mark.parametrize("value, fragment", [
    (0, "must be at least 1"), (-2, "must be at least 1"), ("two", "whole number"),
    (1.5, "whole number"), (True, "whole number")])
def test_other_values_are_refused_naming_the_setting(value, fragment):
    with pytest.raises(UserError, match=fragment) as error:
        check_threads(value, "--threads")
    assert str(error.value).startswith("--threads ")


def test_use_threads_sets_and_restores_and_a_run_keeps_them():
    before = torch.get_num_threads()
    with use_threads(Threads(1, "--threads 1"), announce=True):
        assert torch.get_num_threads() == 1
        with run_threads(3) as line:     # the command chose: train.threads does not change it
            assert torch.get_num_threads() == 1 and line == "threads: 1 (--threads 1)"
        with run_threads(None) as line:
            assert line is None         # said once
    assert torch.get_num_threads() == before and chosen_threads() == (None, None)


def test_a_library_run_takes_train_threads_unless_omp_num_threads_is_set(monkeypatch):
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    with run_threads(1) as line:
        assert torch.get_num_threads() == 1 and line is None
    assert torch.get_num_threads() == before
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    with run_threads(3):
        assert torch.get_num_threads() == before


# ---- compare: processes or threads -----------------------------------------------------------------
def _cells(preset: str, runs: int) -> list:
    return [SimpleNamespace(config=load_config(preset, []))] * runs


def test_compare_shares_the_free_cores_and_says_when_the_load_cut_them(machine):
    small, tiny = _cells("default", 4), _cells("tiny", 2)
    pick = choose(small, "auto", cores=2, load=6.8, memory=1 << 40)    # one single-threaded run per core
    assert (pick.jobs, pick.threads) == (2, 1) and "load" not in pick.line()
    pick = choose(tiny, "auto", cores=2, load=6.8)
    assert (pick.jobs, pick.threads) == (1, 1)
    assert pick.line().endswith("too little to pay for a process each, on 2 cores, load 6.8)")
    assert choose(tiny, "auto", cores=2, load=0.2).threads == 2
    pick = choose(tiny, "auto", cores=2, busy=1.8, load=0.2)         # busy now, the average behind
    assert pick.threads == 1 and pick.line().endswith("on 2 cores, 1.8 busy, load 0.2)")
    pick = choose(small, 2, cores=8, load=5.0)
    assert (pick.jobs, pick.threads) == (2, 1) and pick.line().endswith("(--jobs 2 on 8 cores, load 5.0)")
    assert choose(small, 2, cores=8).threads == 4          # faked cores, no load: idle
    # threads the user set: as many runs as leave each its threads
    pick = choose(small, "auto", threads=3, cores=8, memory=1 << 40)
    assert (pick.jobs, pick.threads) == (2, 3) and pick.line().endswith("on 8 cores; --threads 3)")
    machine(8, 6.0)         # the machine measured, not faked
    assert choose(small, 2).threads == 1


def test_each_run_is_given_threads_as_it_starts_and_a_resumed_one_no_more_than_it_had(machine, tmp_path,
                                                                                     monkeypatch):
    monkeypatch.setattr(training, "RECHECK_S", -1.0)        # every run looks again
    cfg = load_config("tiny", [])
    todo = Todo(1, SimpleNamespace(config=cfg, name="a"), tmp_path, None)
    chooser = RunThreads(None, 1, ceiling=2)
    machine(2, 0.2)
    assert chooser.choose(todo, resume=False).count == 2
    machine(2, 6.8)
    assert chooser.choose(todo, resume=False).count == 1
    # this comparison's running runs are not other processes: their pids are left out
    assert chooser.choose(todo, resume=False, exclude=[7, 8]).count == 1 and machine.excluded[-1] == [7, 8]
    # a resumed run: the count it started with, unless the machine gives fewer now
    machine(2, 0.0)
    resumed = Todo(1, todo.cell, tmp_path, {"environment": {"threads": 1}})
    pick = chooser.choose(resumed, resume=True)
    assert pick.count == 1 and pick.why.endswith("as the run started")
    machine(2, 6.8)
    had_two = Todo(1, todo.cell, tmp_path, {"environment": {"threads": 2}})
    assert chooser.choose(had_two, resume=True).count == 1
    assert RunThreads(2, 1).choose(resumed, resume=True).count == 2     # --threads: as given
    # a run that starts within RECHECK_S of the last look takes what was seen then
    monkeypatch.setattr(training, "RECHECK_S", 3600.0)
    machine(2, 0.0)
    assert chooser.choose(todo, resume=False).count == 1


# ---- the commands ----------------------------------------------------------------------------------
def test_train_says_its_threads_as_it_starts_and_records_them(machine, tmp_path):
    machine(2, 6.8)
    res = run("train", "tiny", *TINY, "--out", str(tmp_path / "loaded"), threads=2)
    assert res.returncode == 0, res.stderr
    err = res.stderr.splitlines()
    assert err[0] == "[train] threads: 1 (2 cores, 2.0 busy, load 6.8)"
    assert sum("threads" in x for x in err) == 1
    assert summary(tmp_path / "loaded")["environment"]["threads"] == 1
    machine(2, 0.1)
    res = run("train", "tiny", *TINY, "--out", str(tmp_path / "quiet"), threads=2)
    assert res.stderr.splitlines()[0] == "[train] threads: 2 (2 cores, 0.1 busy, load 0.1)"
    assert summary(tmp_path / "quiet")["environment"]["threads"] == 2


@pytest.mark.parametrize("args, line, count", [
    (("--threads", "2"), "[train] threads: 2 (--threads 2)", 2),
    (("train.threads=2",), "[train] threads: 2 (train.threads=2)", 2),
    (("train.threads=auto",), "[train] threads: 1 (2 cores, 2.0 busy, load 6.8)", 1),
    (("--threads", "1", "train.threads=2"), "[train] threads: 1 (--threads 1)", 1)])
def test_train_takes_the_flag_and_the_key(machine, tmp_path, args, line, count):
    machine(2, 6.8)
    res = run("train", "tiny", *TINY, *args, "--out", str(tmp_path / "run"), threads=2)
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines()[0] == line
    assert summary(tmp_path / "run")["environment"]["threads"] == count


def test_omp_num_threads_is_respected_and_a_resume_takes_the_flag(machine, tmp_path, monkeypatch):
    machine(2, 0.0)
    res = run("train", "tiny", *TINY, "--out", str(tmp_path / "run"), env={"OMP_NUM_THREADS": "1"}, threads=2)
    assert res.stderr.splitlines()[0] == "[train] threads: 1 (OMP_NUM_THREADS=1)"
    res = run("train", "--resume", "--threads", "2", "train.steps=6", "--out", str(tmp_path / "run"))
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines()[0] == "[train] threads: 2 (--threads 2)"
    assert summary(tmp_path / "run")["environment"]["threads"] == 2


FLAGS = [(("--threads", "0"), "argument --threads: must be at least 1 (threads per process) or auto, got 0"),
         (("--threads", "many"), "argument --threads: must be a whole number of threads")]
KEYS = [(("train.threads=0",), "train.threads must be at least 1"),
        (("train.threads=-3",), "train.threads must be at least 1"),
        (("train.threads=two",), "train.threads must be a whole number of threads"),
        (("train.threads=1.5",), "train.threads must be"),
        (("train.threads=true",), "train.threads must be")]


@pytest.mark.parametrize("command, args, fragment", [
    *[(c, a, f) for c in ("train", "compare") for a, f in FLAGS + KEYS], *[("demo", a, f) for a, f in FLAGS]])
def test_bad_thread_counts_are_one_line_with_status_2_and_write_nothing(tmp_path, command, args, fragment):
    out = tmp_path / "out"
    res = run(command, *(("tiny", "--out", str(out)) if command != "demo" else ()), *args)
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert fragment in res.stderr and "Traceback" not in res.stderr and not out.exists()


def test_compare_says_its_threads_and_rechecks_them_between_runs(machine, tmp_path, monkeypatch):
    monkeypatch.setattr(training, "RECHECK_S", -1.0)        # runs of seconds: every one looks again
    out = tmp_path / "exp"
    first = out / "pre-lr0.001-s0" / "summary.json"
    machine(2, lambda: 6.8 if first.exists() else 0.1)     # the load comes once the first run ends
    res = run("compare", "tiny", *TINY, "--schemes", "pre,siamese", "--out", str(out), threads=2)
    assert res.returncode == 0, res.stderr
    lines = [x for x in res.stdout.splitlines() if x.startswith("compare: ")]
    assert lines[0].startswith("compare: 1 run at a time, 2 threads (auto: ") and "load" not in lines[0]
    assert lines[1] == "compare: siamese-lr0.001-s0: 1 thread (2 cores, 2.0 busy, load 6.8)"
    assert summary(out / "pre-lr0.001-s0")["environment"]["threads"] == 2
    assert summary(out / "siamese-lr0.001-s0")["environment"]["threads"] == 1
    again = run("compare", "tiny", *TINY, "--schemes", "pre", "--threads", "1",
                "--out", str(tmp_path / "one"), threads=2)
    assert again.stdout.startswith("compare: 1 run at a time, 1 thread (auto: ")
    assert summary(tmp_path / "one" / "pre-lr0.001-s0")["environment"]["threads"] == 1


def test_demo_says_its_threads_first(machine):
    machine(2, 6.8)
    res = run("demo", "--schemes", "pre", "--layers", "2", "--dim", "32", "--steps", "2", threads=2)
    assert res.returncode == 0, res.stderr
    assert res.stdout.splitlines()[0] == "threads: 1 (2 cores, 2.0 busy, load 6.8)"
    res = run("demo", "--schemes", "pre", "--layers", "2", "--dim", "32", "--steps", "2", "--threads", "2")
    assert res.stdout.splitlines()[0] == "threads: 2 (--threads 2)"


@pytest.fixture
def eight_threads():
    """torch at 8 intra-op threads (what the process had, the ceiling), then as before."""
    before = torch.get_num_threads()
    torch.set_num_threads(8)
    yield
    torch.set_num_threads(before)


def test_nproc_gives_each_process_its_share_through_omp_num_threads(machine, monkeypatch, capsys,
                                                                    eight_threads):
    """``--nproc``'s launcher: each process's OMP_NUM_THREADS, from the command's choice or the free cores."""
    import torch.distributed.launcher.api as api

    from siamesenorm.parallel.launch import launch

    seen = []
    monkeypatch.setattr(api, "elastic_launch", lambda config, entrypoint: lambda *args: seen.append(
        os.environ["OMP_NUM_THREADS"]))
    machine(8, 4.0)
    launch(2, ["-c", "pass"])
    with use_threads(choose_threads(None, None, processes=2, ceiling=8), announce=True):
        launch(2, ["-c", "pass"])
    assert seen == ["2", "2"] and "OMP_NUM_THREADS" not in os.environ
    assert capsys.readouterr().err == \
        "[train] threads: 2 per process (2 processes on 8 cores, 4.0 busy, load 4.0)\n"
    monkeypatch.setenv("OMP_NUM_THREADS", "3")         # the user's, as it is
    launch(2, ["-c", "pass"])
    assert seen[-1] == "3"
