"""Training runs from the command line's point of view: one entry per command, each reaching the run's
task through the registry (:mod:`siamesenorm.tasks`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .tasks import analyze_run, generate_text, load_config, load_trained, run_task

__all__ = ["analyze_run", "generate_text", "load_config", "load_trained", "run_training"]


def run_training(cfg: Any, run_dir: str | Path, *, resume: bool = False,
                 progress: bool | None = None, allow_data_change: bool = False,
                 changes: list[str] | None = None) -> dict:
    """Train ``cfg`` (from :func:`load_config`) into ``run_dir``, or continue the run there with
    ``resume`` (``cfg`` may then be ``None``; ``changes``: overrides such as ``train.steps=N``;
    ``allow_data_change``: go on though the run's data changed); returns the summary."""
    return run_task(cfg, run_dir, resume=resume, progress=progress, allow_data_change=allow_data_change,
                    changes=changes)
