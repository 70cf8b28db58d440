"""A closed, full or broken log stops the log, never the run (siamesenorm.streams)."""

from __future__ import annotations

import errno
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from siamesenorm.streams import LogStream

SRC = str(Path(__file__).resolve().parents[1] / "src")
# six steps, a line at each, a checkpoint at 3 and 6: the log is written to all through the run
SIX = ["train.steps=6", "train.eval_every=3", "train.checkpoint_every=3", "train.warmup=0",
       "train.log_every=1", "data.max_bytes=40000"]


class _Failing(io.StringIO):
    def __init__(self, error: BaseException) -> None:
        super().__init__()
        self.error, self.calls = error, 0

    def write(self, text: str) -> int:
        self.calls += 1
        raise self.error

    def flush(self) -> None:
        raise self.error


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, "No space left on device"),
                                   BrokenPipeError(errno.EPIPE, "Broken pipe"),
                                   ValueError("I/O operation on closed file.")])
def test_a_failing_stream_goes_mute_after_its_first_failure(error):
    inner = _Failing(error)
    log = LogStream(inner)
    assert log.write("abc") == 3
    log.flush()
    assert log.mute and log.write("more") == 4 and inner.calls == 1
    assert not log.isatty()


def test_no_stream_at_all_takes_every_write():
    log = LogStream(None)
    assert log.mute and log.write("x\n") == 2 and not log.isatty()
    log.flush()


def test_a_working_stream_is_written_through():
    inner = io.StringIO()
    log = LogStream(inner)
    log.write("line\n")
    log.flush()
    assert inner.getvalue() == "line\n" and not log.mute


def _env() -> dict:
    return dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""),
                OMP_NUM_THREADS="1")


def _finished(run: Path) -> dict:
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 6 and not summary.get("interrupted"), summary
    assert (run / "checkpoints").is_dir()
    return summary


@pytest.mark.parametrize("log", ["full", "reader_gone"])
def test_a_run_outlives_its_log(tmp_path, log):
    """``2>/dev/full`` and ``2>&1 | head -c 10``: the run trains to its end, saves its checkpoints
    and summary, and exits 0 (``2>&-``: the compare test below)."""
    run = tmp_path / "run"
    command = [sys.executable, "-m", "siamesenorm", "train", "tiny", *SIX, "--out", str(run)]
    if log == "full":
        if not os.path.exists("/dev/full"):
            pytest.skip("no /dev/full here")
        with open("/dev/full", "w") as full:
            done = subprocess.run(command, env=_env(), stdout=full, stderr=full, timeout=300)
    else:
        with subprocess.Popen(command, env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) as proc:
            assert len(proc.stdout.read(10)) == 10
            proc.stdout.close()             # the reader goes: every later write finds no reader
            proc.wait(timeout=300)
        done = proc
    assert done.returncode == 0
    _finished(run)


def test_compare_outlives_a_closed_log(tmp_path):
    """``compare ... 2>&-`` (Python starts without ``sys.stderr``): every run finishes."""
    out = tmp_path / "exp"
    done = subprocess.run([sys.executable, "-m", "siamesenorm", "compare", "tiny", *SIX[:2],
                           "train.warmup=0", "data.max_bytes=40000", "--schemes", "pre",
                           "--lrs", "1e-3", "--jobs", "1", "--out", str(out)],
                          env=_env(), stdout=subprocess.DEVNULL, timeout=300,
                          preexec_fn=lambda: os.close(2))
    assert done.returncode == 0
    runs = [p for p in out.rglob("summary.json") if p.parent != out]
    assert runs and all(json.loads(p.read_text())["steps"] == 6 for p in runs)
