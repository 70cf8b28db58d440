"""``siamesenorm ARGS`` in a process of its own, forked from one that has imported torch and the
package already: each command is still a fresh process (its own state, exit status, stdout and
stderr, ended as ``python -m siamesenorm`` ends), without paying for the imports every time.

:func:`command` forks the calling process (tests/test_faults_files.py's driver in its mount
namespace); :class:`Commands` keeps a process that does so for a test module
(tests/test_pinned_losses.py). Run as a script, this file is that process: one command a line on
stdin (``[args, stdout file, stderr file]`` in JSON), its exit status a line on stdout.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import select
import signal
import subprocess
import sys
import traceback
from pathlib import Path

# what every command imports before it does anything
IMPORTS = ("torch", "siamesenorm.cli", "siamesenorm.run", "siamesenorm.tasks", "siamesenorm.train")


def preload(modules: tuple[str, ...] | list[str] = ()) -> None:
    """Import :data:`IMPORTS` and ``modules`` (what a command imports beyond training, such as
    ``siamesenorm.hf.export``)."""
    for name in (*IMPORTS, *modules):
        importlib.import_module(name)


def command(args: list[str], out: str, err: str) -> int:
    """Fork: the child runs ``siamesenorm ARGS`` with its stdout in the file ``out``, its stderr
    in ``err``, nothing on stdin; returns its exit status."""
    pid = os.fork()
    if pid:
        return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    code = 1
    try:
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        for fd, path in ((1, out), (2, err)):
            os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
        sys.argv = ["siamesenorm", *args]
        from siamesenorm.cli import entry

        entry()
    except SystemExit as done:          # entry() ends so, unless a rank's group is joined
        code = done.code if isinstance(done.code, int) else 0 if done.code is None else 1
    except BaseException:
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()          # as the interpreter's exit would
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)


class Commands:
    """A process that imported what the commands import, forking one child per command; in a
    session of its own, so that a command that hangs is ended with it (and its ranks)."""

    def __init__(self, folder: Path, env: dict | None = None, imports: tuple[str, ...] = ()) -> None:
        self.folder = folder
        self.proc = subprocess.Popen([sys.executable, __file__, *imports], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env, start_new_session=True)

    def __call__(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
        out, err = self.folder / "stdout", self.folder / "stderr"
        self.proc.stdin.write(json.dumps([list(args), str(out), str(err)]) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if not line:
            self.kill()
            raise AssertionError(f"siamesenorm {' '.join(args)}: no exit status in {timeout} s, or its "
                                 "parent died")
        return subprocess.CompletedProcess(list(args), json.loads(line), out.read_text(), err.read_text())

    def kill(self) -> None:
        """End the process and every process of its session."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.kill()


if __name__ == "__main__":
    preload(sys.argv[1:])
    for request in sys.stdin:
        print(json.dumps(command(*json.loads(request))), flush=True)
    os._exit(0)         # nothing left to flush: no teardown to wait for
