"""``--nproc N``: N processes on this machine through torchrun's elastic agent (docs/scaling.md). Each
reports a failure into :data:`ERROR_DIR_ENV`; the launcher raises the first as one line."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import uuid
from pathlib import Path

from ..devices import choose_threads, chosen_threads
from ..errors import RankFailed, Terminated, UserError

__all__ = ["ERROR_DIR_ENV", "launch", "report_failure"]

ERROR_DIR_ENV = "SIAMESENORM_ERROR_DIR"   # where each process reports its failure


def report_failure(error: BaseException, user_error: bool) -> bool:
    """Under :func:`launch`, record this process's failure for the launcher and return True (the
    caller then prints nothing); elsewhere return False. ``user_error``: a UserError's line."""
    folder = os.environ.get(ERROR_DIR_ENV)
    if not folder:
        return False
    rank = os.environ.get("RANK", "0")
    line = str(error) if user_error else f"{type(error).__name__}: {error}".strip()
    first = (line.splitlines() or [type(error).__name__])[0]
    detail = Path(folder) / f"rank{rank}.traceback"
    if not user_error:
        detail.write_text("".join(traceback.format_exception(error)))
    record = Path(folder) / f"rank{rank}.error"
    tmp = record.with_suffix(".tmp")
    tmp.write_text(f"{time.time():.6f}\t{'user' if user_error else 'crash'}\t{first}\n")
    os.replace(tmp, record)
    return True


def _first_report(folder: Path) -> tuple[int, str, str] | None:
    """``(rank, kind, line)`` of the earliest failure a process recorded, if any."""
    found = []
    for file in folder.glob("rank*.error"):
        try:
            stamp, kind, line = file.read_text().rstrip("\n").split("\t", 2)
            found.append((float(stamp), int(file.stem[4:]), kind, line))
        except (OSError, ValueError):
            continue
    if not found:
        return None
    _, rank, kind, line = min(found)
    return rank, kind, line


def _quiet_agent() -> None:
    """Silence the agent's logs: the failure's one line is ours to print."""
    prefixes = ("torch.distributed.elastic", "torch.distributed.launcher", "torch.distributed.run")
    # the agent's modules set their own loggers' level (WARNING), so each one is set, not only these
    for name in [*prefixes, *list(logging.root.manager.loggerDict)]:
        if name.startswith(prefixes):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def launch(nproc: int, args: list[str], *, what: str = "run") -> None:
    """Run ``python ARGS...`` in ``nproc`` processes of one world on this machine; returns when all
    succeeded, raises :class:`UserError` or :class:`RankFailed` (one line) when one failed."""
    if nproc < 1:
        raise UserError(f"--nproc must be at least 1, got {nproc}")
    if os.environ.get("WORLD_SIZE") not in (None, "", "1"):
        raise UserError("--nproc starts its own processes; it cannot run under torchrun "
                          f"(WORLD_SIZE={os.environ['WORLD_SIZE']}): leave out --nproc")
    import torch
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    _quiet_agent()
    folder = Path(tempfile.mkdtemp(prefix="siamesenorm-ranks-"))
    saved = {k: os.environ.get(k) for k in (ERROR_DIR_ENV, "OMP_NUM_THREADS")}
    os.environ[ERROR_DIR_ENV] = str(folder)
    choice, line = chosen_threads()     # the command's, else the free cores shared out
    if choice is None and saved["OMP_NUM_THREADS"] is None:
        choice = choose_threads(processes=nproc, ceiling=torch.get_num_threads())
    if choice is not None:
        os.environ["OMP_NUM_THREADS"] = str(choice.count)
    if line:
        print(f"[train] {line}", file=sys.stderr, flush=True)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc,
                          run_id=f"siamesenorm-{uuid.uuid4().hex[:8]}", rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.2,
                          start_method="spawn")
    failed: ChildFailedError | None = None
    try:
        elastic_launch(config, entrypoint=sys.executable)(*args)
    except ChildFailedError as error:
        failed = error
    except SignalException as error:    # the processes got it too and saved their checkpoint
        _remove(folder)
        raise (Terminated() if error.sigval == signal.SIGTERM else KeyboardInterrupt()) from None
    except BaseException:
        _remove(folder)
        raise
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    if failed is None:
        _remove(folder)
        return
    silent = _died_silently(failed, folder)
    report = _first_report(folder)
    if silent is not None or report is None:
        rank, code = silent if silent is not None else \
            min((r, f.exitcode) for r, f in failed.failures.items())
        _remove(folder)
        raise RankFailed(f"rank {rank} of the {what} {describe_death(code)} and reported nothing "
                         "(killed from outside, out of memory, or a crash below Python)")
    rank, kind, line = report
    if kind == "user":
        _remove(folder)
        raise UserError(line)
    raise RankFailed(f"rank {rank} of the {what} failed: {line} "
                     f"(traceback: {folder / f'rank{rank}.traceback'})")


def _died_silently(failed, folder: Path) -> tuple[int, int] | None:
    """``(rank, exit code)`` of the lowest rank that died without reporting, not by the agent's SIGTERM:
    the cause, of which the others' errors (a peer's connection reset) are the consequence."""
    stopped = (-signal.SIGTERM, 128 + signal.SIGTERM, 128 + signal.SIGINT)   # 143, 130: our handler's
    dead = [(rank, f.exitcode) for rank, f in failed.failures.items()
            if f.exitcode not in stopped and not (folder / f"rank{rank}.error").exists()]
    return min(dead) if dead else None


def describe_death(code: int) -> str:
    """How a process with exit status ``code`` ended (a negative status: killed by that signal)."""
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _remove(folder: Path) -> None:
    shutil.rmtree(folder, ignore_errors=True)
