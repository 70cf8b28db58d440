"""Errors a user can cause. The command line turns these into one line on stderr and exit status 2."""

from __future__ import annotations


class ConfigError(ValueError):
    """A bad configuration value: an unknown scheme, an option it does not have, a bad dimension."""


class RankFailed(RuntimeError):
    """One process of a run launched with ``--nproc`` crashed (not a user error). The command line
    prints its one line (which rank, the exception, where its traceback is) and exits with 1."""


class Terminated(KeyboardInterrupt):
    """The process was asked to stop by SIGTERM (what schedulers send before preempting a job).
    Training stops as after Ctrl-C (checkpoint, ``summary.json`` marked interrupted); the command
    line then exits with 143 (128 + SIGTERM), the status a shell reports for it."""
