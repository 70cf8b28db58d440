"""``python -m siamesenorm.tasks.worker RUN_DIR [--resume]``: one rank of a run that ``--nproc``
started (:func:`~.runner.launch_task`). The launcher has claimed and prepared ``RUN_DIR``; the rank
trains it from its ``config.yaml`` and reports a failure to the launcher as one line
(:func:`~siamesenorm.parallel.launch.report_failure`) instead of printing it."""

from __future__ import annotations

import sys

from ..errors import ConfigError, Terminated, environment_problem
from ..parallel.env import exit_process
from ..parallel.launch import report_failure
from .runner import train_prepared


def main(argv: list[str]) -> int:
    run_dir, *flags = argv
    try:
        train_prepared(run_dir, resume="--resume" in flags,
                       allow_data_change="--allow-data-change" in flags)
    except ConfigError as error:
        report_failure(error, user_error=True)
        return 2
    except Terminated:      # the launcher passed on a SIGTERM: the checkpoint is saved
        return 143
    except KeyboardInterrupt:
        return 130
    except OSError as error:
        problem = environment_problem(error)
        report_failure(ConfigError(problem) if problem else error, user_error=problem is not None)
        return 2 if problem else 1
    except BaseException as error:
        report_failure(error, user_error=False)
        return 1
    return 0


if __name__ == "__main__":
    exit_process(main(sys.argv[1:]))
