"""The time a comparison has left: the work left (steps x :func:`.jobs.work_per_step`) at the speed of
the work done since the first run started."""

from __future__ import annotations

import time
from collections.abc import Callable


class Eta:
    """The comparison's clock; :meth:`seconds_left` is the estimate."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.started: float | None = None
        self.runs: dict[str, list[float]] = {}      # name -> [work a step, steps left, steps done]

    def add(self, name: str, steps_left: int, work_per_step: float) -> None:
        self.runs[name] = [work_per_step, max(0, steps_left), 0]

    def start(self) -> None:
        if self.started is None:
            self.started = self.clock()

    def progress(self, name: str, steps_done: int) -> None:
        """``name`` has trained ``steps_done`` steps in this session."""
        run = self.runs[name]
        run[2] = min(max(0, steps_done), run[1])

    def finished(self, name: str, steps_done: int | None = None) -> None:
        """``name`` ended after ``steps_done`` steps of this session (``None``: as :meth:`progress` said);
        what it did not train leaves the grid."""
        run = self.runs[name]
        if steps_done is not None:
            run[2] = min(max(0, steps_done), run[1])
        run[1] = run[2]

    def work_done(self) -> float:
        return sum(w * done for w, _, done in self.runs.values())

    def work_left(self) -> float:
        return sum(w * (left - done) for w, left, done in self.runs.values())

    def elapsed(self) -> float:
        return 0.0 if self.started is None else self.clock() - self.started

    def seconds_left(self) -> float | None:
        """The time left at the speed so far; ``None`` before any work is done, 0 when none is left."""
        left, done = self.work_left(), self.work_done()
        if left <= 0:
            return 0.0
        if done <= 0:
            return None
        return self.elapsed() * left / done
