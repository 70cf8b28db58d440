"""Training runs from the command line's point of view: one entry per command, each reaching the
run's task through the registry (:mod:`siamesenorm.tasks`).

A run directory holds ``config.yaml`` (the fully resolved config, with the sizes the data set),
``metrics.jsonl``, ``summary.json`` and ``checkpoints/``, plus what its task keeps (a language
model's ``tokenizer/``, a DiT's ``samples/``); with ``analysis.every > 0`` also ``probes.jsonl``
and, from ``analysis.at_end``, ``analysis.json`` with its plots in ``analysis/``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .tasks import analyze_run, generate_text, load_config, load_trained, run_task

__all__ = ["analyze_run", "generate_text", "load_config", "load_trained", "run_training"]


def run_training(cfg: Any, run_dir: str | Path, *, resume: bool = False,
                 progress: bool | None = None, allow_data_change: bool = False,
                 changes: list[str] | None = None) -> dict:
    """Train ``cfg`` (any task's configuration, from :func:`load_config`) into ``run_dir``, or
    continue the run there with ``resume`` (``cfg`` may then be ``None``; ``allow_data_change``:
    go on when the run's data changed, keeping both records; ``changes``: with ``resume``,
    overrides of ``RESUME_SETTINGS``, ``train.steps=N`` training it further); returns the summary."""
    return run_task(cfg, run_dir, resume=resume, progress=progress, allow_data_change=allow_data_change,
                    changes=changes)
