"""One training run of any task, from a configuration to a finished run directory.

:func:`run_task` is the same for every task: check the run directory, load and check the data,
fit the configuration to it, write ``config.yaml`` (and the task's assets), build the model from
``seed``, train it with the engine (:func:`siamesenorm.train.train`), and with the probes on
(``analysis.every > 0`` and ``analysis.at_end``) analyse the final model. What differs between
tasks comes from their :class:`~.spec.Task`.
"""

from __future__ import annotations

import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from ..analysis import TrainingProbes, analyze_model, write_analysis
from ..config import dump_config
from ..devices import deterministic, environment
from ..errors import ConfigError
from ..locks import check_free, folder_lock
from ..models.checkpointing import set_activation_checkpointing
from ..parallel import World, init_world, leave_world, on_main, parallel_mode
from ..parallel.launch import launch
from ..rundir import RunDir, check_out_dir, read_json, write_text
from ..train import TrainSettings, train
from .registry import get_task, saved_config

# Tasks whose runs may span processes: their evaluations run on every rank and write nothing, or
# write through rank 0 only. The image tasks' sample grids and FD-proxy cache are not there yet.
PARALLEL_TASKS = ("lm",)


def make_probe(cfg: Any, val_batches: list) -> TrainingProbes | None:
    """The training probes of ``analysis.every`` (None when off), on the first validation batch."""
    if cfg.analysis.every <= 0:
        return None
    x, y = val_batches[0]
    n = cfg.analysis.batch_size
    return TrainingProbes(cfg.analysis.every, (x[:n], y[:n]))


def check_data(cfg: Any) -> None:
    """Refuse what is wrong with ``cfg``'s data before anything is written (the task's
    ``check_data``: loaded and checked as its run would, without training a tokenizer)."""
    get_task(cfg.task).check_data(cfg)


def run_task(cfg: Any, run_dir: str | Path, *, resume: bool = False, progress: bool | None = None) -> dict:
    """Train ``cfg`` into ``run_dir`` (or continue the run there with ``resume``, from its own
    ``config.yaml``; ``cfg`` is then ignored); returns the summary.

    Every check (the run directory, the data, the sizes the data decides) happens before anything
    is written. A fresh run refuses a folder that already holds one.

    Under a launcher (``torchrun``, ``--nproc``) every process calls it: they join one process
    group, rank 0 checks the folder and the data and writes the config and the assets, the others
    then load the data as a resumed run does (the saved tokenizer), and all train one model
    together (:func:`siamesenorm.train.train`). A refusal on rank 0 is raised on every rank.
    """
    run_dir = Path(run_dir)
    check_out_dir(run_dir)
    check_free(run_dir, "train")
    if resume:
        _check_resumable(run_dir)
        cfg = saved_config(run_dir, f"cannot resume {run_dir}: it holds no config.yaml")
    world, device = init_world(cfg.train.device)
    try:
        with ExitStack() as held:
            return _run(cfg, run_dir, resume, progress, world, device, held)
    finally:
        leave_world(world)


def _run(cfg: Any, run_dir: Path, resume: bool, progress: bool | None, world: World,
         device: torch.device, held: ExitStack) -> dict:
    task = get_task(cfg.task)
    if world.distributed:
        _check_distributed(cfg, world)

    def prepare():
        if not resume:
            RunDir(run_dir).refuse_existing_run()
        data = task.load_data(cfg, run_dir, resume)
        fitted = task.fit_config(cfg, data)
        # Everything is checked: take the folder (one writer at a time), then look again, since
        # another process may have started a run there since the first look.
        held.enter_context(folder_lock(run_dir, "train"))
        if not resume:
            RunDir(run_dir).refuse_existing_run()
            RunDir(run_dir).clear_stopped_run()       # killed before its first checkpoint
        run_dir.mkdir(parents=True, exist_ok=True)
        if not resume:
            write_text(RunDir(run_dir).config, dump_config(fitted))
            task.save_assets(run_dir, data)
        return data, fitted

    prepared = on_main(world, prepare)
    if world.main:
        data, cfg = prepared
    else:       # rank 0 has saved the assets: load the data as a resumed run does
        data = task.load_data(cfg, run_dir, True)
        cfg = task.fit_config(cfg, data)

    held.enter_context(deterministic(cfg.train.deterministic))
    torch.manual_seed(cfg.seed)
    model = task.build_model(cfg, device)
    if cfg.train.activation_checkpointing != "none":
        set_activation_checkpointing(model, cfg.train.activation_checkpointing)
    probe = make_probe(cfg, data.val_batches)
    settings = TrainSettings.from_config(cfg.train, data.val_batches, cfg.seed)
    summary = train(model, data.sampler, settings, run_dir, resume=resume, device=device,
                    extra_eval=task.extra_eval(cfg, data, run_dir, device), progress=progress, probe=probe,
                    info={**task.summary_info(data),
                          "environment": environment(device, world.size)})
    if probe is not None and cfg.analysis.at_end and not summary.get("diverged") \
            and not summary.get("interrupted"):
        batches = [tuple(t.to(device) for t in b) for b in task.end_batches(cfg, data, cfg.analysis.batches)]
        result = analyze_model(model, batches, loss_fn=task.loss_fn, head_fn=task.head_fn)
        write_analysis(run_dir, result, source="validation")
    return summary


def launch_task(cfg: Any, run_dir: str | Path, *, nproc: int, resume: bool = False) -> dict:
    """:func:`run_task` across ``nproc`` processes of this machine, started by torchrun's launcher
    (:func:`siamesenorm.parallel.launch`); returns rank 0's summary. What can be checked here is
    checked before a process starts; a failure in any process is one line (ConfigError or
    RankFailed) after all have stopped."""
    run_dir = Path(run_dir)
    check_out_dir(run_dir)
    check_free(run_dir, "train")
    if resume:
        _check_resumable(run_dir)
        cfg = saved_config(run_dir, f"cannot resume {run_dir}: it holds no config.yaml")
    else:
        RunDir(run_dir).refuse_existing_run()
    if nproc > 1:
        _check_distributed(cfg, World(0, nproc))
    with folder_lock(run_dir, "train"), \
            tempfile.TemporaryDirectory(prefix="siamesenorm-launch-") as tmp:
        if not resume:
            RunDir(run_dir).refuse_existing_run()       # again, under the lock
        args = ["-m", "siamesenorm", "train", "--out", str(run_dir)]
        if resume:
            args.append("--resume")
        else:
            preset = Path(tmp) / "config.yaml"
            preset.write_text(dump_config(cfg))
            args.append(str(preset))
        launch(nproc, args, what=f"run {run_dir}")
    summary = read_json(RunDir(run_dir).summary)
    if summary.get("interrupted"):
        raise KeyboardInterrupt
    return summary


def _check_resumable(run_dir: Path) -> None:
    """Refuse ``--resume`` of a run that has nothing to resume from, saying what to do instead."""
    if RunDir(run_dir).stopped_before_first_checkpoint():
        raise ConfigError(f"cannot resume {run_dir}: it stopped before its first checkpoint; start "
                          "it again without --resume (the same command that started it)")


def _check_distributed(cfg: Any, world: World) -> None:
    """What a run across processes cannot do yet, refused before anything is written."""
    parallel_mode(cfg.train.parallel, world)
    if cfg.task not in PARALLEL_TASKS:
        raise ConfigError(f"task {cfg.task} trains in one process; runs across processes support "
                          f"task {', '.join(PARALLEL_TASKS)} (launched with {world.size} processes)")
    if cfg.analysis.every > 0:
        raise ConfigError("the training probes (analysis.every) run in one process only; set "
                          "analysis.every=0 and run `siamesenorm analyze` on the finished run")
