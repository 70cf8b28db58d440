"""Tasks: the kinds of run (``lm``, ``vit``, ``dit``), peers behind one interface.

Each task is one module that builds a :class:`Task` (:mod:`.spec`): its run configuration, how to
load and check its data, build its model, evaluate it and read it back. The registry
(:mod:`.registry`) finds a task by the ``task`` key of a configuration; :mod:`.runner` trains a run
of any task, and :mod:`.finished` loads, analyses and generates from a finished one. Commands
reach the tasks only through these.
"""

from .finished import analyze_run, generate_text, load_trained
from .registry import TASKS, get_task, load_config, saved_config
from .runner import Run, launch_task, run_task
from .spec import Task, TaskData

__all__ = ["TASKS", "Run", "Task", "TaskData", "analyze_run", "generate_text", "get_task", "load_config",
           "launch_task", "load_trained", "run_task", "saved_config"]
