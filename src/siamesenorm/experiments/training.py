"""Training the runs of a comparison: one after the other here, or several at once in worker processes
(:mod:`.workers`); a run that fails does not stop the others."""

from __future__ import annotations

import dataclasses
import pickle
import sys
import time
import traceback
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..devices import Threads, choose_threads, machine_now, set_threads, use_threads
from ..errors import RankFailed, UserError, environment_problem
from ..locks import folder_lock
from ..rundir import RunDir
from ..shapes import METRICS_ROW, read_rows, read_summary
from ..tasks import Run, launch_task, run_task
from ..train.progress import duration
from .disk import keep_last_checkpoint
from .eta import Eta
from .jobs import Concurrency, threads_of, work_per_step
from .view import GridView
from .workers import Failure, StopSignals, Worker


class RunsFailed(RankFailed):
    """Some runs failed (not all by a user's error) while the others went on; the command exits with 1."""


def grad_norm_peak(run_dir: Path, after: int = 0) -> tuple[float | None, int | None]:
    """The largest logged gradient norm (before clipping) after step ``after``, and its step."""
    best: tuple[float | None, int | None] = (None, None)
    for row in read_rows(RunDir(run_dir).metrics, METRICS_ROW):
        g = row.get("grad_norm")
        if row.get("step", 0) > after and isinstance(g, (int, float)) and \
                (best[0] is None or g > best[0]):
            best = (float(g), int(row["step"]))
    return best


def _one_line(summary: dict, peak: tuple) -> str:
    val = summary.get("final_val_loss")
    state = f"interrupted at step {summary['steps']} (checkpoint at step {summary.get('checkpoint_step')})" \
        if summary.get("interrupted") else \
        f"diverged at step {summary['diverged_at']}" if summary.get("diverged") else \
        f"stalled (zero gradient) from step {summary['stalled_at']}" if summary.get("stalled") else \
        f"final val loss {'-' if val is None else f'{val:.4f}'}"
    grad = "" if peak[0] is None else f", max grad norm {peak[0]:.3g} (step {peak[1]})"
    return f"{state}{grad}, {summary.get('wall_time_s', 0):.0f} s"


def data_key(cfg) -> tuple:
    """The data setting of a run: runs with the same key share the data loaded once."""
    return cfg.task, repr(cfg.data)


@dataclass
class Todo:
    """A run to train in this session; ``before``: the summary an interrupted session of it left."""

    index: int
    cell: Any
    run_dir: Path
    before: dict | None

    @property
    def start_step(self) -> int:
        """The step it resumes from (0 when it starts afresh)."""
        if self.before is None or not RunDir(self.run_dir).has_checkpoints():
            return 0
        return self.before.get("checkpoint_step") or 0


RECHECK_S = 10.0        # a run that starts sooner after the last look at the cores takes what it saw


class RunThreads:
    """Each run's threads, chosen as it starts: the cores other processes than this comparison's
    leave free, shared by ``processes`` runs at once, at most ``ceiling``; a resumed run's count is
    at most the one it started with."""

    def __init__(self, flag: int | None, processes: int, ceiling: int | None = None) -> None:
        self.flag, self.processes, self.ceiling = flag, processes, ceiling
        self.last: int | None = None        # the count last said
        self.seen: tuple[float, tuple] | None = None        # when the cores were last looked at, and what

    def pick(self, cfg: Any, exclude: Sequence[int] = ()) -> Threads:
        """``exclude``: the processes of this comparison's running runs."""
        given = set_threads(self.flag, cfg.train.threads, processes=self.processes)
        if given is not None:               # set by the user: nothing to look at
            return given
        now = time.monotonic()
        if self.seen is None or now - self.seen[0] > RECHECK_S:
            self.seen = now, machine_now(exclude, ceiling=self.ceiling, processes=self.processes)
        cores, busy, load = self.seen[1]
        return choose_threads(self.flag, cfg.train.threads, processes=self.processes, ceiling=self.ceiling,
                              cores=cores, busy=busy, load=load)

    def choose(self, item: Todo, resume: bool, exclude: Sequence[int] = ()) -> Threads:
        pick = self.pick(item.cell.config, exclude)
        started = threads_of(item.before, pick.count) if resume else pick.count
        if pick.auto and started < pick.count:
            pick = dataclasses.replace(pick, count=started, why=f"{pick.why}; as the run started")
        return pick

    def say(self, log, name: str, pick: Threads) -> None:
        """A line when ``pick`` differs from the count said before."""
        if self.last is not None and pick.count != self.last:
            log(f"compare: {name}: {pick.count} thread{'s' if pick.count != 1 else ''} ({pick.why})")
        self.last = pick.count


class Finished:
    """The line of each run that ends, with the comparison's progress and ETA."""

    def __init__(self, view: GridView, log, keep_checkpoints: str = "last") -> None:
        self.view, self.log, self.keep_checkpoints = view, log, keep_checkpoints

    @property
    def total(self) -> int:
        return self.view.total

    @property
    def done(self) -> int:
        return self.view.done

    @property
    def eta(self) -> Eta:
        return self.view.eta

    def _progress(self) -> str:
        if self.done >= self.total:
            return f"{self.done}/{self.total} done in {duration(self.eta.elapsed())}"
        left = self.eta.seconds_left()
        return f"{self.done}/{self.total} done, ETA {'?' if left is None else duration(left)}"

    def finished(self, item: Todo, summary: dict) -> None:
        if self.keep_checkpoints == "last":
            keep_last_checkpoint(item.run_dir, summary)
        self.view.ended(item.cell.name, summary.get("steps", 0) - item.start_step)
        line = _one_line(summary, grad_norm_peak(item.run_dir))
        self.log(f"  {item.cell.name}: {line}; {self._progress()}")

    def failed(self, item: Todo, failure: Failure) -> None:
        self.view.ended(item.cell.name)         # what its log said it did
        self.log(f"  {item.cell.name}: failed: {failure.line}; {self._progress()}")

    def interrupted(self, item: Todo, summary: dict | None) -> None:
        self.view.stopped(item.cell.name, summary["steps"] - item.start_step if summary else 0)
        text = _one_line(summary, grad_norm_peak(item.run_dir)) if summary and summary.get("interrupted") \
            else "stopped before its first step"
        self.log(f"  {item.cell.name}: {text}")


def train_runs(todo: list[Todo], total: int, concurrency: Concurrency, nproc: int | None, data: dict,
               log, keep_checkpoints: str = "last",
               threads: int | None = None) -> tuple[dict[str, dict], dict[str, Failure]]:
    """Train ``todo`` as ``concurrency`` says (``threads``: ``--threads``): the summaries of the runs
    that ended and the failures of those that failed (an interruption is raised once all have stopped)."""
    eta = Eta()
    for item in todo:
        eta.add(item.cell.name, item.cell.config.train.steps - item.start_step,
                work_per_step(item.cell.config))
    spread = bool(nproc and nproc > 1)      # its processes write to stderr themselves
    view = GridView(total, total - len(todo), eta, live=False if spread else None)
    log = view.wrap(log)
    done = Finished(view, log, keep_checkpoints)
    summaries: dict[str, dict] = {}
    failures: dict[str, Failure] = {}
    try:
        if concurrency.jobs > 1:
            log(concurrency.line())
            chooser = RunThreads(threads, concurrency.jobs)
            chooser.last = concurrency.threads
            train_in_workers(todo, concurrency, data, done, summaries, failures, log, chooser)
        else:
            chooser = RunThreads(threads, nproc or 1, torch.get_num_threads())
            if spread:
                log(f"compare: 1 run at a time, each across {nproc} processes (--nproc {nproc})")
            else:       # here, within the threads this process has
                chooser.last = concurrency.threads
                log(concurrency.line())
            train_here(todo, nproc, data, done, summaries, failures, log, chooser)
    finally:
        view.close()
    return summaries, failures


def _failure_of(error: Exception) -> Failure:
    """A run's exception as one line; a crash's traceback is printed (stderr) first."""
    if isinstance(error, UserError):
        return Failure(str(error), user=True)
    if isinstance(error, OSError) and environment_problem(error):
        return Failure(environment_problem(error), user=True)
    if isinstance(error, RankFailed):
        return Failure(str(error))
    traceback.print_exception(error, file=sys.stderr)
    first = (str(error).splitlines() or [""])[0]
    return Failure(f"{type(error).__name__}: {first}".rstrip(": "))


def train_here(todo: list[Todo], nproc: int | None, data: dict, done: Finished,
                summaries: dict, failures: dict, log, chooser: RunThreads | None = None) -> None:
    """Train ``todo`` one after the other here, each with the threads ``chooser`` gives it as it starts."""
    view = done.view
    chooser = chooser or RunThreads(None, nproc or 1, torch.get_num_threads())
    for item in todo:
        name, cfg = item.cell.name, item.cell.config
        log(f"[{item.index}/{done.total}] {name}: training")
        # a run with a checkpoint resumes; any other starts afresh, replacing what an earlier
        # attempt left (the folder is this experiment's)
        resume = RunDir(item.run_dir).has_checkpoints()
        pick = chooser.choose(item, resume)
        chooser.say(log, name, pick)
        view.started(name, item.start_step if resume else 0, cfg.train.steps, resume)
        try:
            with use_threads(pick):
                if nproc and nproc > 1:
                    summary = launch_task(cfg, item.run_dir, nproc=nproc, resume=resume, command="compare",
                                          restart=not resume)
                else:
                    with view.capture(name):
                        summary = run_task(cfg, item.run_dir, resume=resume, command="compare",
                                           restart=not resume, data=None if resume else data[data_key(cfg)])
        except Exception as error:      # not KeyboardInterrupt: Ctrl-C and SIGTERM stop the comparison
            with view.paused():
                failures[name] = _failure_of(error)
            done.failed(item, failures[name])
            continue
        summaries[name] = summary
        done.finished(item, summary)


def train_in_workers(todo: list[Todo], concurrency: Concurrency, data: dict, done: Finished,
                      summaries: dict, failures: dict, log, chooser: RunThreads | None = None) -> None:
    """Train ``todo``, ``concurrency.jobs`` at once in worker processes; Ctrl-C or SIGTERM stops them all
    (checkpointed) and is raised once they have ended."""
    pending, running = list(todo), {}
    chooser = chooser or RunThreads(None, concurrency.jobs)
    pickled: dict = {}      # each data setting pickled once, for the fresh runs' workers
    free = list(range(concurrency.jobs))
    view, passed_on = done.view, 0
    with StopSignals() as stop:
        try:
            while running or (pending and not stop.requested):   # after a stop: no new start
                while pending and free and not stop.requested:
                    item, slot = pending.pop(0), min(free)
                    log(f"[{item.index}/{done.total}] {item.cell.name}: training")
                    try:
                        ours = [w.proc.pid for _, w, _ in running.values() if getattr(w, "proc", None)]
                        started = _start_worker(item, concurrency, slot, data, pickled, view, stop,
                                                chooser, log, ours)
                    except Exception as error:
                        with view.paused():
                            failures[item.cell.name] = _failure_of(error)
                        done.failed(item, failures[item.cell.name])
                        continue
                    if started is None:         # a stop came while its folder was prepared
                        done.interrupted(item, None)
                    else:
                        free.remove(slot)
                        running[slot] = started
                stop.pass_on(worker for _, worker, _ in running.values())
                if stop.count > passed_on:
                    _say_stopping(stop, passed_on, len(running), view)
                    passed_on = stop.count
                ended = [slot for slot, (_, worker, _) in running.items() if worker.poll() is not None]
                if not ended:
                    view.tick()
                    time.sleep(0.1)
                for slot in ended:
                    item, worker, claim = running.pop(slot)
                    free.append(slot)
                    with claim:
                        code, failure = worker.finish()
                    _collect(item, code, failure, stop.requested, done, summaries, failures)
        finally:        # an error of this loop: the workers stop (checkpointed) before it is raised
            for _, worker, claim in running.values():
                with claim:
                    worker.signal()
                    worker.finish()
    if stop.requested:
        raise stop.error()


def _start_worker(item: Todo, concurrency: Concurrency, slot: int, data: dict, pickled: dict,
                  view: GridView, stop: StopSignals, chooser: RunThreads, log,
                  ours: Sequence[int] = ()) -> tuple[Todo, Worker, ExitStack] | None:
    """Claim and prepare ``item``'s folder, then start its worker, which inherits the lock (and gets a fresh
    run's data); ``None`` when a stop came meanwhile."""
    cfg, run_dir = item.cell.config, item.run_dir
    resume = RunDir(run_dir).has_checkpoints()
    run = Run(run_dir, resume=resume, command="compare", restart=not resume)
    claim = ExitStack()
    try:
        claim.enter_context(run.claimed())
        lock = claim.enter_context(folder_lock(run_dir, "compare"))     # the one run.claimed() holds
        if not resume:
            run.prepare(cfg, data[data_key(cfg)])
        if stop.requested:
            claim.close()
            return None
        pick = chooser.choose(item, resume, ours)
        chooser.say(log, item.cell.name, pick)
        device = concurrency.devices[slot] if concurrency.devices else None
        key = data_key(cfg)
        if not resume and key not in pickled:
            pickled[key] = pickle.dumps(data[key], protocol=pickle.HIGHEST_PROTOCOL)
        name = item.cell.name
        worker = Worker(name, run_dir, resume, pick.count, device, lock.fd,
                        on_line=lambda line: view.run_line(name, line),
                        data=None if resume else pickled[key])
        view.started(name, item.start_step if resume else 0, cfg.train.steps, resume)
        worker.start()
    except BaseException:
        claim.close()
        raise
    return item, worker, claim


def _say_stopping(stop: StopSignals, before: int, running: int, view: GridView) -> None:
    what = "SIGTERM" if stop.terminated else "interrupt"
    if before == 0:
        note = (f"compare: {what}: stopping the {running} running run{'s' if running != 1 else ''} after "
                "the current step, each with a checkpoint, and starting no more (the same command "
                "resumes them; again to stop at once)")
    else:
        note = "compare: stopping the running runs at once"
    view.note(note)


def _collect(item: Todo, code: int, failure: Failure | None, stopping: bool, done: Finished,
             summaries: dict, failures: dict) -> None:
    """What a worker's end means for its run: finished, interrupted (stopped by us), or failed."""
    name, path = item.cell.name, RunDir(item.run_dir).summary
    if failure is None and code == 0:
        try:
            summaries[name] = read_summary(path)
        except UserError as error:
            failure = Failure(str(error), user=True)
        else:
            done.finished(item, summaries[name])
            return
    if failure is None and stopping:
        summary = read_summary(path) if path.exists() else None
        if summary is not None and not summary.get("interrupted"):     # it ended before the stop
            summaries[name] = summary                                   # reached it
            done.finished(item, summary)
        else:
            done.interrupted(item, summary)
        return
    if failure is None:
        failure = Failure(f"its process was stopped from outside (exit status {code}); its last "
                          "checkpoint is kept: the same command resumes it")
    failures[name] = failure
    done.failed(item, failure)


def raise_failures(failures: dict[str, Failure], total: int) -> None:
    """One line naming every failed run; :class:`UserError` when all were a user's errors."""
    which = "; ".join(f"{name}: {failure.line}" for name, failure in failures.items())
    line = (f"{len(failures)} of {total} runs failed ({which}); the others ended as usual, and the "
            "same command trains the failed ones again (finished runs are skipped)")
    if all(f.user for f in failures.values()):
        raise UserError(line)
    raise RunsFailed(line)
