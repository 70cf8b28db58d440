"""One training run of any task, from a configuration to a finished run directory.

:func:`run_task` is the same for every task: check the run directory, load and check the data,
fit the configuration to it, write ``config.yaml`` (and the task's assets), build the model from
``seed``, train it with the engine (:func:`siamesenorm.train.train`), and with the probes on
(``analysis.every > 0`` and ``analysis.at_end``) analyse the final model. What differs between
tasks comes from their :class:`~.spec.Task`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..analysis import TrainingProbes, analyze_model, write_analysis
from ..config import dump_config
from ..devices import resolve_device
from ..rundir import RunDir, check_out_dir
from ..train import TrainSettings, train
from .registry import get_task, saved_config


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
    """
    run_dir = Path(run_dir)
    check_out_dir(run_dir)
    if resume:
        cfg = saved_config(run_dir, f"cannot resume {run_dir}: it holds no config.yaml")
    else:
        RunDir(run_dir).refuse_existing_run()
    task = get_task(cfg.task)
    device = resolve_device(cfg.train.device)
    data = task.load_data(cfg, run_dir, resume)
    cfg = task.fit_config(cfg, data)
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        RunDir(run_dir).config.write_text(dump_config(cfg))
        task.save_assets(run_dir, data)

    torch.manual_seed(cfg.seed)
    model = task.build_model(cfg, device)
    probe = make_probe(cfg, data.val_batches)
    settings = TrainSettings.from_config(cfg.train, data.val_batches, cfg.seed)
    summary = train(model, data.sampler, settings, run_dir, resume=resume, device=device,
                    extra_eval=task.extra_eval(cfg, data, run_dir, device), progress=progress, probe=probe,
                    info=task.summary_info(data))
    if probe is not None and cfg.analysis.at_end and not summary.get("diverged") \
            and not summary.get("interrupted"):
        batches = [tuple(t.to(device) for t in b) for b in task.end_batches(cfg, data, cfg.analysis.batches)]
        result = analyze_model(model, batches, loss_fn=task.loss_fn, head_fn=task.head_fn)
        write_analysis(run_dir, result, source="validation")
    return summary
