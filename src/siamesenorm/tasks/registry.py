"""The registry of tasks: every command finds a kind of run here, by the ``task`` key of its
configuration, and nowhere else.

Adding a task is a module that builds a :class:`~.spec.Task` (see :mod:`.lm`, :mod:`.vit`,
:mod:`.dit`) and its entry in :data:`TASKS`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..config import build_config
from ..errors import UserError
from ..rundir import RunDir
from . import dit, lm, vit
from .spec import Task

TASKS: dict[str, Task] = {task.name: task for task in (lm.TASK, vit.TASK, dit.TASK)}
DEFAULT_TASK = "lm"


def get_task(name: str) -> Task:
    """The task called ``name`` (a one-line error naming the known ones otherwise)."""
    try:
        return TASKS[name]
    except (KeyError, TypeError):       # TypeError: a value no name can be (a list)
        raise UserError(f"task: unknown value {name!r}; choose one of {', '.join(TASKS)}") from None


def load_config(preset: str | None = None, overrides: list[str] | tuple[str, ...] = (),
                extra: list[tuple[str, Any]] | tuple[tuple[str, Any], ...] = (),
                preset_data: dict | None = None) -> Any:
    """The run configuration of a preset (a name in ``configs/`` or a YAML path) with ``key=value``
    ``overrides`` and already parsed ``extra`` pairs, every value checked
    (:func:`siamesenorm.config.build_config`). The ``task`` key (``lm`` by default, ``vit``,
    ``dit``) picks the task's configuration class, wherever it is set. ``preset_data``: the preset
    already read (:func:`siamesenorm.config.read_preset`), to resolve several from one reading."""
    classes = {name: task.config_class for name, task in TASKS.items()}
    return build_config(classes, preset, overrides, extra, default=DEFAULT_TASK, preset_data=preset_data)


def saved_config(run_dir: str | Path, missing: str) -> Any:
    """The configuration a run saved in ``run_dir/config.yaml``; ``missing`` is the one-line error
    when it has none."""
    path = RunDir(run_dir).config
    if not path.is_file():
        raise UserError(missing)
    return load_config(str(path))
