"""``python -m siamesenorm.tasks.worker RUN_DIR [--resume] [--data FILE]``: one rank of a run that ``--nproc``
started (:func:`~.runner.launch_task`), or one run of a ``compare --jobs N``
(:mod:`siamesenorm.experiments.workers`). The launcher has claimed and prepared ``RUN_DIR``; the
rank trains it from its ``config.yaml`` and reports a failure to the launcher as one line
(:func:`~siamesenorm.parallel.launch.report_failure`) instead of printing it. With
:data:`STOP_WITH_ENV` set to its parent's pid, the process is stopped as by one SIGTERM (a
checkpoint, then the end) when that parent dies, on Linux."""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading

from ..errors import Terminated, UserError, environment_problem
from ..parallel.env import exit_process
from ..parallel.launch import ERROR_DIR_ENV, report_failure
from ..streams import outlive_readers
from .runner import train_prepared

STOP_WITH_ENV = "SIAMESENORM_STOP_WITH"     # the pid whose death stops this process
DATA_FILE = "data.pickle"     # the name of the file compare hands a fresh run's data in


# Linux sends the parent-death signal each time the thread this process is parented to ends: a
# parent with several threads that dies at once (kill -9 of compare) sends it once per thread as the
# process is handed from one dying thread to the next. It comes as SIGHUP, which becomes one SIGTERM
# (a checkpoint, then the end): a second SIGTERM would stop the step in flight without one, and one
# after training would end the process before its summary is written.
PARENT_DEATH_SIGNAL = signal.SIGHUP


_parent_gone = threading.Event()


def _parent_died(signum, frame) -> None:
    """The first parent-death signal: one SIGTERM to this process; the repeats (Python may call
    this again for a signal that arrived before the first call ended): nothing."""
    if _parent_gone.is_set():
        return
    _parent_gone.set()
    signal.signal(PARENT_DEATH_SIGNAL, signal.SIG_IGN)
    os.kill(os.getpid(), signal.SIGTERM)


def _stop_with_parent() -> bool:
    """Ask Linux for a signal when the parent named by :data:`STOP_WITH_ENV` dies, which ends the
    run as one SIGTERM would; ``False`` when it is gone
    already (nothing is to be trained)."""
    pid = os.environ.get(STOP_WITH_ENV, "")
    if not pid.isdigit():
        return True
    if sys.platform.startswith("linux"):
        import ctypes

        signal.signal(PARENT_DEATH_SIGNAL, _parent_died)
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(PARENT_DEATH_SIGNAL))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    return os.getppid() == int(pid)


def _orphaned() -> bool:
    """Whether the parent named by :data:`STOP_WITH_ENV` is gone."""
    pid = os.environ.get(STOP_WITH_ENV, "")
    return pid.isdigit() and os.getppid() != int(pid)


def main(argv: list[str]) -> int:
    outlive_readers()       # a closed or broken log (a parent gone, a full disk) never stops a rank
    code = _train(*argv)
    if _orphaned():     # nobody reads the report folder any more: removed when empty
        try:
            os.rmdir(os.environ.get(ERROR_DIR_ENV, ""))
        except OSError:
            pass
    return code


def _handed_data(flags: tuple[str, ...]):
    """The data ``--data FILE`` hands over: pickled by the compare that started this process, in
    that process's own folder (mode 0700), as multiprocessing hands objects over a pipe."""
    if "--data" not in flags:
        return None
    with open(flags[flags.index("--data") + 1], "rb") as file:
        return pickle.load(file)


def _train(run_dir: str, *flags: str) -> int:
    if not _stop_with_parent():
        return 143
    try:
        train_prepared(run_dir, resume="--resume" in flags,
                       allow_data_change="--allow-data-change" in flags, data=_handed_data(flags))
    except UserError as error:
        report_failure(error, user_error=True)
        return 2
    except Terminated:      # the launcher passed on a SIGTERM: the checkpoint is saved
        return 143
    except KeyboardInterrupt:
        return 130
    except OSError as error:
        problem = environment_problem(error)
        report_failure(UserError(problem) if problem else error, user_error=problem is not None)
        return 2 if problem else 1
    except BaseException as error:
        report_failure(error, user_error=False)
        return 1
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
