"""Faults a cluster user meets: two processes pointed at one folder, a lock left by a dead process,
``--resume`` beside a live run. Each refusal is one stderr line with exit status 2, and the folder
it protects is left as it was."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from helpers import cli_in_process
from siamesenorm.errors import ConfigError
from siamesenorm.locks import LOCK_NAME, folder_lock, held_by
from siamesenorm.train.progress import LOG_PREFIX

SRC = str(Path(__file__).resolve().parents[1] / "src")
TINY = ["train.steps=2", "train.eval_every=2", "train.warmup=0", "data.max_bytes=40000"]
# A run that goes on until it is stopped: never diverging (at lr 1e-3 with no warm-up the tiny model's
# loss jumps above 3x its best after ~1,700 steps, a few seconds on a quiet machine, and the "live"
# command would then end before a test looks at it). No log lines: its stderr is read only at the end.
LONG = ["train.steps=100000", "train.eval_every=100000", "train.warmup=0", "data.max_bytes=40000",
        "train.checkpoint_every=100000", "train.divergence_factor=1e9", "train.log_every=0"]


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
                OMP_NUM_THREADS="1")


def cli(*args: str) -> subprocess.CompletedProcess:
    """The command in this process: what a process adds is checked where it matters (``Live``,
    the signal tests); the one-line refusals and resumes here need none. With ``--nproc`` in a
    process of its own, so that what its ranks print is captured with the rest."""
    if "--nproc" in args:
        return subprocess.run([sys.executable, "-m", "siamesenorm", *args], capture_output=True,
                              text=True, env=_env(), timeout=300)
    return cli_in_process(*args)


def one_line_refusal(res: subprocess.CompletedProcess, *fragments: str) -> str:
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert "Traceback" not in res.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


class Live:
    """A ``siamesenorm`` command running in the background until it holds ``folder``'s lock."""

    def __init__(self, folder: Path, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "siamesenorm", *args], env=_env(),
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 180
        while held_by(folder) is None or held_by(folder).get("pid") != self.proc.pid:
            if self.proc.poll() is not None:
                raise AssertionError(f"the background command ended: {self.proc.stderr.read()}")
            assert time.monotonic() < deadline, "the background command never took the lock"
            time.sleep(0.1)

    def stop(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        self.proc.wait(timeout=120)
        self.proc.stderr.close()


# ---- the lock itself -------------------------------------------------------------------------------
def test_the_lock_is_exclusive_names_its_holder_and_is_gone_after(tmp_path):
    folder = tmp_path / "run"
    with folder_lock(folder, "train") as lock:
        assert lock is not None and (folder / LOCK_NAME).exists()
        info = held_by(folder)
        assert info["pid"] == os.getpid() and info["command"] == "train"
        with folder_lock(folder, "compare"):        # nested in one process: free
            pass
        assert (folder / LOCK_NAME).exists()
        code = ("from siamesenorm.locks import folder_lock\n"
                f"with folder_lock({str(folder)!r}, 'train'): pass\n")
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=_env(), timeout=120)
        assert res.returncode != 0 and "UserError" in res.stderr
        assert f"pid {os.getpid()}" in res.stderr and "siamesenorm train" in res.stderr
    assert not folder.exists()         # created for the lock, nothing else written: removed again


def test_a_folder_with_files_stays_after_the_lock(tmp_path):
    folder = tmp_path / "run"
    with folder_lock(folder, "train"):
        (folder / "config.yaml").write_text("x: 1\n")
    assert folder.is_dir() and sorted(p.name for p in folder.iterdir()) == ["config.yaml"]


def test_a_lock_left_by_a_killed_process_is_taken(tmp_path):
    folder = tmp_path / "run"
    code = ("import time\nfrom siamesenorm.locks import folder_lock\n"
            f"with folder_lock({str(folder)!r}, 'train'):\n"
            "    print('held', flush=True)\n    time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], env=_env(), stdout=subprocess.PIPE,
                            text=True)
    assert proc.stdout.readline().strip() == "held"
    proc.kill()
    proc.wait()
    proc.stdout.close()
    assert held_by(folder)["pid"] == proc.pid      # the file is still there, its holder is not
    with folder_lock(folder, "train"):
        assert held_by(folder)["pid"] == os.getpid()


def test_a_stale_lock_file_without_a_holder_is_taken(tmp_path):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / LOCK_NAME).write_text(json.dumps({"pid": 999999999, "host": "elsewhere"}))
    with folder_lock(folder, "train"):
        assert held_by(folder)["pid"] == os.getpid()


def test_a_refused_lock_is_a_config_error(tmp_path, monkeypatch):
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / LOCK_NAME).write_text(json.dumps({"pid": os.getppid(), "host": "elsewhere",
                                                "command": "compare"}))
    import siamesenorm.locks as locks

    monkeypatch.setattr(locks, "fcntl", None)       # the exclusive-create fallback
    with pytest.raises(ConfigError, match="in use by `siamesenorm compare`"):
        with folder_lock(folder, "train"):
            pass
    assert held_by(folder)["command"] == "compare"  # the holder's file is left alone


# ---- through the command line ---------------------------------------------------------------------
def test_a_second_train_into_a_live_run_is_refused_and_changes_nothing(tmp_path):
    run_dir = tmp_path / "run"
    live = Live(run_dir, "train", "tiny", *LONG, "--out", str(run_dir))
    try:
        config = run_dir / "config.yaml"
        deadline = time.monotonic() + 120
        while not config.exists():
            assert time.monotonic() < deadline
            time.sleep(0.1)
        before = config.read_bytes()
        res = cli("train", "tiny", *TINY, "train.lr=5e-3", "--out", str(run_dir))
        one_line_refusal(res, str(run_dir), "in use by `siamesenorm train`", f"pid {live.proc.pid}")
        res = cli("train", "--resume", "--out", str(run_dir))
        one_line_refusal(res, str(run_dir), "in use by")
        assert config.read_bytes() == before
        assert yaml.safe_load(before)["train"]["lr"] != 5e-3
        assert live.proc.poll() is None           # the live run goes on
    finally:
        live.stop()


def test_a_second_compare_into_a_live_experiment_is_refused(tmp_path):
    out = tmp_path / "exp"
    live = Live(out, "compare", "tiny", *LONG, "--schemes", "pre", "--out", str(out))
    try:
        res = cli("compare", "tiny", *TINY, "--schemes", "pre", "--out", str(out))
        one_line_refusal(res, str(out), "in use by `siamesenorm compare`")
        # a train into the run compare is training: refused too
        deadline = time.monotonic() + 120
        runs = []
        while not runs:
            runs = [p for p in out.iterdir() if p.is_dir() and held_by(p)]
            assert time.monotonic() < deadline
            time.sleep(0.1)
        res = cli("train", "--resume", "--out", str(runs[0]))
        one_line_refusal(res, str(runs[0]), "in use by `siamesenorm compare`")
    finally:
        live.stop()
    # the killed compare's lock does not stand in the way of the next one
    res = cli("compare", "tiny", *TINY, "--schemes", "pre", "--out", str(tmp_path / "exp2"))
    assert res.returncode == 0, res.stderr


def test_a_run_whose_process_was_killed_resumes_past_its_lock(tmp_path):
    run_dir = tmp_path / "run"
    res = cli("train", "tiny", *TINY, "train.checkpoint_every=1", "--out", str(run_dir))
    assert res.returncode == 0, res.stderr
    assert not (run_dir / LOCK_NAME).exists()
    (run_dir / LOCK_NAME).write_text(json.dumps({"pid": 999999999, "host": "x"}))  # left behind
    res = cli("train", "--resume", "--out", str(run_dir))
    assert res.returncode == 0, res.stderr


# ---- signals ----------------------------------------------------------------------------------------
# What the signalled process runs first (a sitecustomize on its PYTHONPATH): each training step
# SLOW_STEP_S seconds longer (wall time only: the numbers are untouched), so that a signal comes
# mid-run however fast the machine is, while the resumed and reference runs (here) take few steps.
SLOW = '''import os, time
from siamesenorm.train import loop

compute, pause = loop.Trainer.compute, float(os.environ["SLOW_STEP_S"])


def slowed(self, *args, **kwargs):
    time.sleep(pause)
    return compute(self, *args, **kwargs)


loop.Trainer.compute = slowed
'''


def test_sigterm_checkpoints_writes_the_summary_exits_143_and_resumes_exactly(tmp_path):
    """What a scheduler sends before preempting a job: handled as Ctrl-C is (the step in flight
    finishes, a checkpoint and summary.json are written), exit status 143; the resumed run ends
    where an uninterrupted one does."""
    # 60 steps of 50 ms at least (3 s): the signal comes after step 5, with steps to spare
    steps = ["train.steps=60", "train.eval_every=30", "train.warmup=0", "data.max_bytes=40000",
             "train.checkpoint_every=1000", "train.log_every=3"]
    run_dir, slow = tmp_path / "run", tmp_path / "slow"
    slow.mkdir()
    (slow / "sitecustomize.py").write_text(SLOW)
    env = _env()
    env.update(SLOW_STEP_S="0.05", PYTHONPATH=str(slow) + os.pathsep + env["PYTHONPATH"])
    proc = subprocess.Popen([sys.executable, "-m", "siamesenorm", "train", "tiny", *steps, "--out",
                             str(run_dir)], env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 180
    while not metrics.exists() or metrics.read_text().count("\n") < 5:
        assert proc.poll() is None, proc.stderr.read()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert [line for line in lines if not line.startswith(LOG_PREFIX)] == [
        "SIGTERM: stopping after this step and saving a checkpoint",
        "siamesenorm train: terminated (SIGTERM)"]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] and 5 <= summary["steps"] < 60
    # the run's log (every 3 steps) ends with where it stopped
    final = [line for line in lines if line.startswith(LOG_PREFIX)][-1]
    assert final.startswith(f"{LOG_PREFIX} interrupted at step {summary['steps']}/60 after "), final
    assert not (run_dir / LOCK_NAME).exists()
    res = cli("train", "--resume", "--out", str(run_dir))
    assert res.returncode == 0, res.stderr
    ref = tmp_path / "ref"
    assert cli("train", "tiny", *steps, "--out", str(ref)).returncode == 0

    def losses(folder):
        return {r["step"]: r["loss"] for r in map(json.loads, (folder / "metrics.jsonl").open())}

    assert losses(run_dir) == losses(ref)


# ---- checkpoints you can trust ----------------------------------------------------------------------
def _flip(file: Path, count: int = 1000) -> None:
    data = bytearray(file.read_bytes())
    step = max(1, len(data) // count)
    for i in range(len(data) // 2 % step, len(data), step):
        data[i] ^= 0xFF
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flip model", "truncate model", "flip state", "drop state"])
def test_a_damaged_checkpoint_is_refused_with_one_line(tmp_path, damage):
    run_dir = tmp_path / "run"
    res = cli("train", "tiny", *TINY, "--out", str(run_dir))
    assert res.returncode == 0, res.stderr
    ckpt = run_dir / "checkpoints" / "last"
    sums = json.loads((ckpt / "checksums.json").read_text())
    assert set(sums) == {"model.safetensors", "state.pt"}
    what, name = damage.split()
    file = ckpt / ("model.safetensors" if name == "model" else "state.pt")
    if what == "flip":
        _flip(file)
    elif what == "truncate":
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    else:
        file.unlink()
    if what == "drop":      # no state.pt: there is no checkpoint at all any more
        return
    for args in (("train", "--resume", "--out", str(run_dir)),
                 ("generate", str(run_dir), "--prompt", "a", "--max-new-tokens", "4")):
        res = cli(*args)
        one_line_refusal(res, f"checkpoint {ckpt} is damaged", file.name)


def test_checksums_cover_every_file_of_a_sharded_layout(tmp_path):
    from siamesenorm.train.checkpoint import verify_checksums, write_checksums

    folder = tmp_path / "ckpt"
    (folder / "dcp").mkdir(parents=True)
    (folder / "dcp" / "__0_0.distcp").write_bytes(b"abc" * 100)
    (folder / "state.pt").write_bytes(b"state")
    write_checksums(folder)
    verify_checksums(folder)
    _flip(folder / "dcp" / "__0_0.distcp", 1)
    with pytest.raises(ConfigError, match="dcp/__0_0.distcp does not match"):
        verify_checksums(folder)
    (folder / "dcp" / "__0_0.distcp").unlink()
    with pytest.raises(ConfigError, match="dcp/__0_0.distcp is missing"):
        verify_checksums(folder)
    (folder / "checksums.json").write_text("{not json")
    with pytest.raises(ConfigError, match="checksums.json is unreadable"):
        verify_checksums(folder)


def _losses(folder: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, (folder / "metrics.jsonl").open())}


def test_the_last_k_checkpoints_are_kept(tmp_path):
    six = ["train.steps=6", "train.eval_every=6", "train.warmup=0", "data.max_bytes=40000",
           "train.checkpoint_every=2"]
    for keep, want in ((2, {"last", "step_4"}), (3, {"last", "step_4", "step_2"}), (1, {"last"})):
        run_dir = tmp_path / f"keep{keep}"
        res = cli("train", "tiny", *six, f"train.keep_checkpoints={keep}", "--out", str(run_dir))
        assert res.returncode == 0, res.stderr
        assert {p.name for p in (run_dir / "checkpoints").iterdir()} == want


def test_resume_falls_back_to_the_newest_good_checkpoint_and_says_so(tmp_path):
    six = ["train.steps=6", "train.eval_every=6", "train.warmup=0", "data.max_bytes=40000",
           "train.checkpoint_every=2"]
    run_dir = tmp_path / "run"
    assert cli("train", "tiny", *six, "--out", str(run_dir)).returncode == 0
    want = _losses(run_dir)
    _flip(run_dir / "checkpoints" / "last" / "model.safetensors")
    res = cli("train", "--resume", "--out", str(run_dir))
    assert res.returncode == 0, res.stderr
    warning = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert len(warning) == 1 and "is damaged" in warning[0]
    assert f"resuming from {run_dir / 'checkpoints' / 'step_4'} instead" in warning[0]
    names = {p.name for p in (run_dir / "checkpoints").iterdir()}
    assert "last" in names and any(n.startswith("damaged-") for n in names)
    assert _losses(run_dir) == want            # steps 5 and 6 again, exactly as the first time
    # every checkpoint damaged: the last one's problem, one line
    for folder in (run_dir / "checkpoints").iterdir():
        if not folder.name.startswith("damaged-"):
            _flip(folder / "state.pt")
    res = cli("train", "--resume", "--out", str(run_dir))
    one_line_refusal(res, "is damaged", "state.pt")


def test_a_run_killed_before_its_first_checkpoint_is_started_again_by_train(tmp_path):
    run_dir = tmp_path / "run"
    live = Live(run_dir, "train", "tiny", *LONG, "--out", str(run_dir))
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not metrics.exists() or metrics.read_text().count("\n") < 3:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    live.stop()                                    # kill -9: no checkpoint, no summary
    res = cli("train", "--resume", "--out", str(run_dir))
    one_line_refusal(res, "stopped before its first checkpoint", "without --resume")
    res = cli("train", "tiny", *TINY, "--out", str(run_dir))
    assert res.returncode == 0, res.stderr
    assert sorted(_losses(run_dir)) == [1, 2]      # a fresh log: nothing of the killed run
    res = cli("train", "tiny", *TINY, "--out", str(run_dir))   # now it holds a finished run
    one_line_refusal(res, "already holds a run")


def test_truncated_experiment_and_run_summaries_are_one_line(tmp_path):
    out = tmp_path / "exp"
    res = cli("compare", "tiny", *TINY, "--schemes", "pre", "--out", str(out))
    assert res.returncode == 0, res.stderr
    marker = out / "experiment.json"
    good = marker.read_bytes()
    marker.write_bytes(good[: len(good) // 2])
    one_line_refusal(cli("compare", "tiny", *TINY, "--schemes", "pre", "--out", str(out)),
                     f"{marker} is damaged")
    marker.write_bytes(good)
    [summary] = [p / "summary.json" for p in out.iterdir() if p.is_dir()]
    summary.write_bytes(summary.read_bytes()[:10])
    one_line_refusal(cli("compare", "tiny", *TINY, "--schemes", "pre", "--out", str(out)),
                     f"{summary} is damaged")


def test_atomic_writes_leave_no_partial_file_when_the_disk_is_full(tmp_path, monkeypatch):
    import errno as _errno

    from siamesenorm.rundir import write_json, write_text

    target = tmp_path / "summary.json"
    write_json(target, {"a": 1})

    def full(fd):
        raise OSError(_errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError):
        write_text(target, "x" * 1000)
    assert json.loads(target.read_text()) == {"a": 1}         # the old file, whole
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]   # no temporary left


def test_a_run_whose_gradient_stays_zero_stops_as_stalled(tmp_path):
    """A model that no longer learns (here its loss ignores every parameter, as a dead or
    corrupted model's does) stops after ``stall_steps`` steps of zero gradient, reported failed."""
    import dataclasses
    from types import SimpleNamespace

    import dist_worker as w


    class Dead(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, y):
            return SimpleNamespace(loss=self.inner(x, y).loss * 0.0 + 5.5)

    settings = dataclasses.replace(w.settings(30, "none", 1), stall_steps=5)
    summary = w.train(Dead(w.build("pre", {})), w.source(), settings, tmp_path / "run", progress=False)
    assert summary["stalled"] and summary["failed"] and not summary["diverged"]
    assert summary["stalled_at"] == 1 and summary["steps"] == 5
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert rows[-1] == {"step": 5, "stalled": True, "stalled_at": 1}
    # a live model's gradient is never exactly zero: the same settings train to the end
    summary = w.train(w.build("pre", {}), w.source(), settings, tmp_path / "live", progress=False)
    assert not summary["stalled"] and summary["steps"] == 30


@pytest.mark.parametrize("damage", ["delete", "truncate", "replace"])
def test_a_metric_log_damaged_under_a_live_run_is_rewritten_with_every_row(tmp_path, capsys,
                                                                           damage):
    from siamesenorm.train.metrics import MetricsLog

    log = MetricsLog(tmp_path, None, loggers=())
    for step in (1, 2, 3):
        log.write({"step": step, "loss": 1.0 / step})
    path = tmp_path / "metrics.jsonl"
    if damage == "delete":
        path.unlink()
    elif damage == "truncate":
        path.write_bytes(path.read_bytes()[:20])
    else:
        path.rename(tmp_path / "old.jsonl")
        path.write_text('{"step": 99}\n')
    log.write({"step": 4, "loss": 0.25})
    log.write({"step": 5, "loss": 0.2})
    log.close()
    assert [json.loads(line)["step"] for line in path.open()] == [1, 2, 3, 4, 5]
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"warning: {path} was ") and "3 rows" in err[0]


# ---- the operating system says no -------------------------------------------------------------------
@pytest.mark.parametrize("command", ["train", "compare"])
@pytest.mark.parametrize("where", ["proc", "long"])
def test_an_output_path_the_system_refuses_is_one_line(tmp_path, command, where):
    out = "/proc/siamesenorm-test/run" if where == "proc" else str(tmp_path / ("x" * 300) / "run")
    args = ("train", "tiny", *TINY, "--out", out) if command == "train" else \
        ("compare", "tiny", *TINY, "--schemes", "pre", "--out", out)
    line = one_line_refusal(cli(*args))
    assert ("File name too long" if where == "long" else "/proc/siamesenorm-test") in line
    assert list(tmp_path.iterdir()) == []                 # nothing left behind


def test_export_and_analyze_into_a_refused_path_are_one_line(tmp_path):
    run_dir = tmp_path / "run"
    assert cli("train", "tiny", *TINY, "--out", str(run_dir)).returncode == 0
    one_line_refusal(cli("export", str(run_dir), "--out", "/proc/siamesenorm-test/w.safetensors"),
                     "/proc/siamesenorm-test")
    one_line_refusal(cli("analyze", str(run_dir), "--batches", "1", "--out",
                         "/proc/siamesenorm-test/a"), "/proc/siamesenorm-test")


def _disk_full(*args, **kwargs):
    import errno as _errno

    raise OSError(_errno.ENOSPC, "No space left on device", "metrics.jsonl")


def test_a_full_disk_at_the_start_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    from siamesenorm import cli as cli_module
    from siamesenorm.tasks import runner

    monkeypatch.setattr(runner, "write_text", _disk_full)
    run_dir = tmp_path / "run"
    assert cli_module.main(["train", "tiny", *TINY, "--out", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["siamesenorm train: error: No space left on device: metrics.jsonl"]
    assert not run_dir.exists()


def test_a_full_disk_mid_run_is_one_line_and_the_run_resumes_exactly(tmp_path, monkeypatch, capsys):
    from siamesenorm import cli as cli_module
    from siamesenorm.train.metrics import MetricsLog

    six = ["train.steps=6", "train.eval_every=6", "train.warmup=0", "data.max_bytes=40000",
           "train.checkpoint_every=2"]
    real = MetricsLog.write

    def write(self, row, evaluated=()):
        if row.get("step") == 3:
            _disk_full()
        real(self, row, evaluated)

    monkeypatch.setattr(MetricsLog, "write", write)
    run_dir = tmp_path / "run"
    assert cli_module.main(["train", "tiny", *six, "--out", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    logged = [line.split(" | ")[0] for line in err if line.startswith(f"{LOG_PREFIX} step")]
    assert logged == [f"{LOG_PREFIX} step 1/6", f"{LOG_PREFIX} step 2/6"]   # the steps recorded
    assert [line for line in err if not line.startswith(LOG_PREFIX)] == [
        "siamesenorm train: error: No space left on device: metrics.jsonl"]
    assert not (run_dir / LOCK_NAME).exists()
    monkeypatch.setattr(MetricsLog, "write", real)
    assert cli("train", "--resume", "--out", str(run_dir)).returncode == 0
    ref = tmp_path / "ref"
    assert cli("train", "tiny", *six, "--out", str(ref)).returncode == 0
    assert _losses(run_dir) == _losses(ref)


def test_a_read_only_output_folder_is_one_line(tmp_path, monkeypatch, capsys):
    """As root (CI) a chmod does not stop writes: the file system's answer is simulated where the
    first write happens, the folder's lock."""
    import errno as _errno

    from siamesenorm import cli as cli_module
    from siamesenorm import locks

    real = os.open

    def read_only(path, flags, *args):
        if str(path).endswith(LOCK_NAME):
            raise OSError(_errno.EROFS, "Read-only file system", str(path))
        return real(path, flags, *args)

    monkeypatch.setattr(locks.os, "open", read_only)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert cli_module.main(["train", "tiny", *TINY, "--out", str(run_dir)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"siamesenorm train: error: Read-only file system: {run_dir / LOCK_NAME}"]
    assert list(run_dir.iterdir()) == []
