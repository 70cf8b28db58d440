"""The runs of a comparison in processes of their own (``python -m siamesenorm.tasks.worker``), several
at once. Each inherits its folder's open lock file, stops (checkpointed) when ``compare`` dies, and
gets signals only through :class:`StopSignals`."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import Terminated
from ..parallel.launch import ERROR_DIR_ENV, describe_death
from ..tasks.worker import DATA_FILE, STOP_WITH_ENV
from ..train.interrupt import SignalScope

_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])     # the folder that holds siamesenorm/


def worker_env(threads: int, device: str | None, errors: Path, base: dict | None = None) -> dict[str, str]:
    """This process's environment with ``threads`` intra-op threads, the CUDA device ``device`` (``None``:
    as it is), the failure folder ``errors``, and this process as the one whose death stops it."""
    env = dict(os.environ if base is None else base)
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
               **{ERROR_DIR_ENV: str(errors), STOP_WITH_ENV: str(os.getpid())})
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    if device is not None:
        env["CUDA_VISIBLE_DEVICES"] = device
    return env


@dataclass
class Failure:
    """Why a run failed: one line; ``user``: a user's error (a bad value, a full disk)."""

    line: str
    user: bool = False


@dataclass
class Worker:
    """One run training in a process of its own; each output line goes to ``on_line`` (from a thread)."""

    name: str
    run_dir: Path
    resume: bool
    threads: int
    device: str | None = None
    lock_fd: int | None = None
    on_line: Callable[[str], None] | None = field(default=None, repr=False)
    signals: int = 0                    # signals passed on to it
    proc: subprocess.Popen | None = field(default=None, repr=False)
    data: bytes | None = field(default=None, repr=False)     # the run's data, pickled (fresh runs)

    def start(self) -> None:
        self.errors = Path(tempfile.mkdtemp(prefix="siamesenorm-run-"))
        argv = [sys.executable, "-m", "siamesenorm.tasks.worker", str(self.run_dir),
                *(["--resume"] if self.resume else [])]
        try:
            if self.data is not None:   # in this process's own folder (mode 0700), as a pipe would
                handed = self.errors / DATA_FILE
                handed.write_bytes(self.data)
                argv += ["--data", str(handed)]
            self.proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         env=worker_env(self.threads, self.device, self.errors),
                                         pass_fds=() if self.lock_fd is None else (self.lock_fd,))
        except BaseException:       # no worker (a full disk, no such interpreter): no folder either
            shutil.rmtree(self.errors, ignore_errors=True)
            raise
        self.reader = threading.Thread(target=self._pass_through, name=f"log {self.name}", daemon=True)
        self.reader.start()

    def _pass_through(self) -> None:
        for raw in self.proc.stdout:
            if self.on_line is None:
                continue
            try:
                self.on_line(raw.decode("utf-8", "replace").rstrip("\r\n"))
            except Exception:       # a reader that fails must not block the run on a full pipe
                pass

    def poll(self) -> int | None:
        return self.proc.poll()

    def signal(self) -> None:
        """Pass on one stop request (SIGTERM: checkpoint and stop; a second one stops it at once)."""
        self.signals += 1
        try:
            os.kill(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass

    def finish(self) -> tuple[int, Failure | None]:
        """Wait for the process and its output: its exit status and failure, if it reported one. Its folder is
        removed unless it keeps a crash's traceback."""
        code = self.proc.wait()
        self.reader.join()
        self.proc.stdout.close()
        failure = read_failure(self.errors)
        (self.errors / DATA_FILE).unlink(missing_ok=True)
        stopped = self.signals > 0 and code == -signal.SIGTERM      # by us, before its handler was up
        if failure is None and code not in (0, 130, 143) and not stopped:
            failure = Failure(f"its process {describe_death(code)} and reported nothing (killed from "
                              "outside, out of memory, or a crash below Python)")
        if failure is None or failure.user or not _holds_files(self.errors):
            shutil.rmtree(self.errors, ignore_errors=True)
        return code, failure


def _holds_files(folder: Path) -> bool:
    try:
        return any(folder.iterdir())
    except OSError:
        return False


def read_failure(folder: Path) -> Failure | None:
    """The failure a worker recorded in ``folder`` (its ``rank0.error``), else ``None``."""
    try:
        _, kind, line = (folder / "rank0.error").read_text().rstrip("\n").split("\t", 2)
    except (OSError, ValueError):
        return None
    if kind == "user":
        return Failure(line, user=True)
    return Failure(f"{line} (traceback: {folder / 'rank0.traceback'})")


class StopSignals(SignalScope):
    """In the block Ctrl-C and SIGTERM only count (:attr:`count`); the caller passes each on to its workers.
    Outside the main thread nothing changes."""

    def __init__(self) -> None:
        self.count = 0
        self.terminated = False

    @property
    def requested(self) -> bool:
        return self.count > 0

    def error(self) -> KeyboardInterrupt:
        return Terminated() if self.terminated else KeyboardInterrupt()

    def _handle(self, signum, frame) -> None:
        if self.count == 0:
            self.terminated = signum == signal.SIGTERM
        self.count += 1

    def pass_on(self, workers) -> None:
        """Give every worker each stop request it has not had yet."""
        for worker in workers:
            while worker.signals < self.count:
                worker.signal()
