"""One training run of any task, from a resolved configuration to a finished run folder.

A :class:`Run` claims its folder once (the lock, then the refusals, then clearing what a stopped run
of ours left), prepares it (data, the configuration fitted to it, ``config.yaml``, the task's
assets) and trains. Across processes rank 0 claims and prepares; with ``--nproc`` this process does,
then starts ranks (:mod:`.worker`) that read its ``config.yaml`` and only train.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import torch

from ..analysis import TrainingProbes, analyze_model, write_analysis
from ..config import build_config, dump_config
from ..devices import deterministic, environment, resolve_device
from ..errors import UserError
from ..locks import check_free, folder_lock
from ..models.checkpointing import set_activation_checkpointing
from ..parallel import World, init_world, leave_world, on_main, parallel_mode
from ..parallel.env import local_world_size
from ..parallel.launch import launch
from ..rundir import RunDir, check_out_dir, fill_unrecorded, plain, write_text
from ..shapes import read_summary
from ..train import train
from ..train.metrics import check_loggers
from .dryrun import check_fits
from .registry import TASKS, get_task, load_config, saved_config
from .spec import TaskData

# What ``train --resume`` takes besides the run's own config.yaml: the settings that cannot change
# what the run has done (its length, when it evaluates, checkpoints and logs).
RESUME_SETTINGS = ("train.steps", "train.eval_every", "train.checkpoint_every", "train.keep",
                   "train.log_every", "train.loggers")


class Run:
    """The run folder ``run_dir`` of one run. ``resume``: continue it from its ``config.yaml``;
    ``command`` names the lock's holder; ``restart``: replace an unfinished earlier attempt of this
    tool (only its files); ``allow_data_change``: resume on changed data, with a warning."""

    def __init__(self, run_dir: str | Path, *, resume: bool = False, command: str = "train",
                 restart: bool = False, allow_data_change: bool = False) -> None:
        self.run_dir, self.folder = Path(run_dir), RunDir(run_dir)
        self.resume, self.command, self.restart = resume, command, restart
        self.allow_data_change = allow_data_change

    def saved_config(self) -> Any:
        return saved_config(self.run_dir, f"cannot resume {self.run_dir}: it holds no config.yaml")

    def extended(self, cfg: Any, changes: list[str] | None) -> Any:
        """``cfg`` (the run's saved configuration) with ``changes`` (``train.steps=N`` and the
        other :data:`RESUME_SETTINGS` overrides; ``None``: as it is), checked as any configuration
        is. ``train.steps`` may grow (the run trains on), never shrink."""
        if not changes:
            return cfg
        new = load_config(str(self.folder.config), changes)
        if new.train.steps < cfg.train.steps:
            raise UserError(f"train.steps={new.train.steps} with --resume: {self.run_dir} planned "
                            f"{cfg.train.steps} steps; give at least that many (a run is trained "
                            "further, never cut short)")
        return new

    def record_extension(self, old: Any, cfg: Any, changes: list[str]) -> None:
        """Write ``cfg`` (``old`` with ``changes``) into ``config.yaml`` (the workers and a later
        ``--resume`` read it), record the change in the run's marker, and drop a finished run's
        ``summary.json`` when it trains on."""
        at = read_summary(self.folder.summary)["steps"] if self.folder.summary.is_file() else None
        entry = {"time": time.strftime("%Y-%m-%d %H:%M:%S"), "changes": list(changes), "at_step": at}
        if cfg.train.steps != old.train.steps:
            entry["schedule"] = (f"warm-up and cosine decay over {cfg.train.steps} steps (was "
                                 f"{old.train.steps}), followed from the step the run resumes at")
        write_text(self.folder.config, dump_config(cfg))
        self.folder.record_extension(entry)
        if cfg.train.steps > old.train.steps:
            self.folder.summary.unlink(missing_ok=True)

    @contextmanager
    def claimed(self) -> Iterator[None]:
        """Hold the folder: take its lock (refused when another process holds it), then refuse
        what this run cannot do there, then clear what a stopped run left. Nothing is written
        before the lock, and a refusal leaves the folder as it was."""
        check_out_dir(self.run_dir)
        check_free(self.run_dir, self.command)     # a live holder is the first thing to say
        if not self.resume:     # before the lock too: nothing is written into a folder refused
            self.folder.refuse_existing_run(self.restart)
        with folder_lock(self.run_dir, self.command):
            if self.resume:     # (the caller reads its config.yaml)
                if self.folder.stopped_before_first_checkpoint():
                    raise UserError(f"cannot resume {self.run_dir}: it stopped before its first "
                                      "checkpoint; start it again without --resume (the same "
                                      "command that started it)")
            else:
                self.folder.refuse_existing_run(self.restart)
                if self.folder.marked():        # an earlier attempt of ours: its files go
                    self.folder.clear_run_files()
            yield

    def refuse_changed_data(self, info: dict) -> None:
        """Refuse (writing nothing) to resume on data that differs from the record the run started
        with, unless ``allow_data_change``: before a resume's changes are written."""
        now = info.get("data")
        if not self.resume or self.allow_data_change or now is None:
            return
        now = json.loads(json.dumps(plain(now)))
        before, _ = fill_unrecorded(self.folder.recorded_data(), now)
        if before is not None and before != now:
            raise UserError(f"cannot resume {self.run_dir}: its data changed since the run "
                            f"started ({_difference(before, now)}); restore the data it "
                            "trained on, or add --allow-data-change to go on with the new "
                            "data (both records are kept)")

    def check_data(self, info: dict, world: World) -> dict:
        """``info`` for the summary, after comparing a resumed run's data record with the one it
        started with (its marker's, else its summary's): a change is refused (every rank alike),
        or with ``allow_data_change`` said once and recorded, both records kept. A fresh run's
        record is written (rank 0)."""
        now = info.get("data")
        if now is None:
            return info
        now = json.loads(json.dumps(plain(now)))
        if not self.resume:
            if world.main and self.folder.marked():
                self.folder.record_data(now)
            return info
        before, unknown = fill_unrecorded(self.folder.recorded_data(), now)
        history = self.folder.data_history()
        if unknown and world.main:
            print(f"note: {self.run_dir}: its data record, from an older siamesenorm, has no "
                  f"{', '.join(unknown)}; taken as unknown, the rest of the record is compared",
                  file=sys.stderr, flush=True)
            if before == now and self.folder.marked():
                self.folder.record_data(now)        # known from now on
        if before is not None and before != now:
            self.refuse_changed_data(info)
            if world.main:
                print(f"warning: {self.run_dir}: the data changed since the run started "
                      f"({_difference(before, now)}); going on with the new data "
                      "(--allow-data-change); summary.json keeps both records",
                      file=sys.stderr, flush=True)
                history = self.folder.record_data(now, replaced=before) if self.folder.marked() \
                    else [{"data": before}]
            else:
                history = [*history, {"data": before}]
        return {**info, **({"data_history": history} if history else {})}

    def prepare(self, cfg: Any, data: TaskData | None = None) -> tuple[Any, TaskData]:
        """The data and the configuration fitted to it (``data``: already loaded for this
        setting, with ``cfg`` fitted to it), and for a fresh run ``config.yaml`` and the task's
        assets written (none of them left behind when writing them fails, a full disk)."""
        task = get_task(cfg.task)
        if data is None:
            data = task.load_data(cfg, self.run_dir, self.resume)
            cfg = task.fit(cfg, data)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not self.resume:
            self.folder.mark()      # the run's first file: from here on the folder is a run of ours
            try:
                write_text(self.folder.config, dump_config(cfg))
                data.save(self.run_dir)
            except BaseException:
                self.folder.clear_run_files()
                raise
        return cfg, data

    def train(self, cfg: Any, data: TaskData, world: World, device: torch.device,
              progress: bool | None) -> dict:
        """Build the model from ``seed`` and train it (every rank), then analyse it (probes on)."""
        task = get_task(cfg.task)
        with deterministic(cfg.train.deterministic):
            torch.manual_seed(cfg.seed)
            model = task.build_model(cfg, device)
            if cfg.train.activation_checkpointing != "none":
                set_activation_checkpointing(model, cfg.train.activation_checkpointing)
            probe = None
            if cfg.analysis.every > 0:
                x, y = data.val_batches[0]
                n = cfg.analysis.batch_size
                probe = TrainingProbes(cfg.analysis.every, (x[:n], y[:n]))
            info = self.check_data({**data.info(cfg), "environment": environment(device, world.size)},
                                   world)
            summary = train(model, data.batches(cfg), cfg.train, self.run_dir, seed=cfg.seed,
                            eval_batches=data.val_batches, resume=self.resume, device=device,
                            evaluation=task.evaluation(cfg, data, self.run_dir, device),
                            progress=progress, probe=probe, info=info)
            if probe is not None and cfg.analysis.at_end and not summary.get("diverged") \
                    and not summary.get("interrupted"):
                batches = [tuple(t.to(device) for t in b)
                           for b in data.analysis_batches(cfg, cfg.analysis.batches)]
                result = analyze_model(model, batches, loss_fn=task.loss_fn, head_fn=task.head_fn)
                write_analysis(self.run_dir, result, source="validation")
        return summary


def _difference(before: Any, now: Any, where: str = "data") -> str:
    """Where two data records differ, in a few words: the first differing entry, values shortened."""
    if isinstance(before, dict) and isinstance(now, dict):
        for key in [*before, *(k for k in now if k not in before)]:
            if before.get(key) != now.get(key):
                return _difference(before.get(key), now.get(key), f"{where}.{key}")

    def short(value: Any) -> str:
        text = json.dumps(value, sort_keys=True)
        return text if len(text) <= 40 else text[:37] + "..."

    return f"{where} was {short(before)}, is now {short(now)}"


def run_task(cfg: Any, run_dir: str | Path, *, resume: bool = False, progress: bool | None = None,
             data: TaskData | None = None, command: str = "train", restart: bool = False,
             allow_data_change: bool = False, changes: list[str] | None = None) -> dict:
    """Train ``cfg`` into ``run_dir`` (``resume``: continue the run there from its own config,
    with ``changes`` to :data:`RESUME_SETTINGS`); returns the summary. ``data``: already loaded,
    ``cfg`` fitted to it. Every refusal comes before anything is written. Under a launcher rank 0
    claims and prepares while the others wait, then all train one model."""
    run = Run(run_dir, resume=resume, command=command, restart=restart,
              allow_data_change=allow_data_change)
    old = None
    if resume:
        old = run.saved_config()
        cfg = run.extended(old, changes)
    world, device = init_world(cfg.train.device)
    try:
        with ExitStack() as held:
            if world.distributed:
                check_distributed(cfg, world)
            check_fits(cfg, device, world.size, local_world_size(world))
            check_loggers(cfg.train.loggers)

            def claim_and_prepare():
                held.enter_context(run.claimed())
                prepared = run.prepare(cfg, data)
                if changes:                 # once its data has loaded, and was found the same
                    run.refuse_changed_data(prepared[1].info(prepared[0]))
                    run.record_extension(old, prepared[0], changes)
                return prepared

            prepared = on_main(world, claim_and_prepare)
            if world.main:
                cfg, data = prepared
            else:       # rank 0 has saved the assets: load the data as a resumed run does
                data = get_task(cfg.task).load_data(cfg, run.run_dir, True)
                cfg = get_task(cfg.task).fit(cfg, data)
            return run.train(cfg, data, world, device, progress)
    finally:
        leave_world(world)


def launch_task(cfg: Any, run_dir: str | Path, *, nproc: int, resume: bool = False,
                command: str = "train", restart: bool = False, allow_data_change: bool = False,
                changes: list[str] | None = None) -> dict:
    """:func:`run_task` across ``nproc`` processes of this machine: this process claims and
    prepares the folder, then torchrun's launcher (:func:`siamesenorm.parallel.launch`) starts the
    ranks on it (:mod:`.worker`); returns rank 0's summary. A failure in any process is one line
    (UserError or RankFailed) after all have stopped."""
    run = Run(run_dir, resume=resume, command=command, restart=restart, allow_data_change=allow_data_change)
    with run.claimed():
        if resume:
            old = run.saved_config()
            cfg = run.extended(old, changes)
        check_distributed(cfg, World(0, nproc))
        check_fits(cfg, resolve_device(cfg.train.device), nproc, nproc)
        check_loggers(cfg.train.loggers)
        if not resume:
            run.prepare(cfg)
        elif changes:               # refused on changed data before the change is written
            if not allow_data_change:
                task = get_task(cfg.task)
                data = task.load_data(cfg, run.run_dir, True)
                run.refuse_changed_data(data.info(task.fit(cfg, data)))
            run.record_extension(old, cfg, changes)
        flags = [*(["--resume"] if resume else []), *(["--allow-data-change"] if allow_data_change else [])]
        launch(nproc, ["-m", "siamesenorm.tasks.worker", str(run.run_dir), *flags], what=f"run {run_dir}")
    summary = read_summary(run.folder.summary)
    if summary.get("interrupted"):
        raise KeyboardInterrupt
    return summary


def train_prepared(run_dir: str | Path, resume: bool, allow_data_change: bool = False,
                   data: TaskData | None = None) -> dict:
    """What each rank :func:`launch_task` starts does: train the run its launcher prepared (and
    holds) in ``run_dir``, from its ``config.yaml``. ``data``: the run's data as its launcher
    loaded it (compare's workers), to which ``config.yaml`` is fitted already."""
    run = Run(run_dir, resume=resume, allow_data_change=allow_data_change)
    cfg = _fitted_config(run.folder)
    world, device = init_world(cfg.train.device)
    try:
        if data is None:
            task = get_task(cfg.task)
            data = task.load_data(cfg, run.run_dir, True)
            cfg = task.fit(cfg, data)
        return run.train(cfg, data, world, device, progress=None)
    finally:
        leave_world(world)


def _fitted_config(folder: RunDir) -> Any:
    """The ``config.yaml`` the launcher checked, fitted and wrote, read without checking it again."""
    if not folder.config.is_file():
        raise UserError(f"{folder.path} holds no config.yaml")
    classes = {name: task.config_class for name, task in TASKS.items()}
    return build_config(classes, str(folder.config), trusted=True)


def check_distributed(cfg: Any, world: World) -> None:
    """What a run across processes cannot do yet, refused before anything is written."""
    parallel_mode(cfg.train.parallel, world)
    if not get_task(cfg.task).multi_process:
        parallel = ", ".join(name for name, task in TASKS.items() if task.multi_process)
        raise UserError(f"task {cfg.task} trains in one process; runs across processes support "
                          f"task {parallel} (launched with {world.size} processes)")
    if cfg.analysis.every > 0:
        raise UserError("the training probes (analysis.every) run in one process only; set "
                          "analysis.every=0 and run `siamesenorm analyze` on the finished run")
