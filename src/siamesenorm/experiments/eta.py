"""The time a comparison has left, from the speed of its runs so far.

A run's work is its steps times its FLOPs a step (:func:`.jobs.work_per_step`), so a grid whose
variants differ in size is weighed by what each costs. The speed is the work done in this session
(finished runs, and the steps the running ones have logged) over the time since the first run
started, which counts every run trained at once; the time left is the work left at that speed. A
run that stops early (diverged, stalled, failed) leaves the grid with what it did.
"""

from __future__ import annotations

import time
from collections.abc import Callable


class Eta:
    """The comparison's clock: :meth:`add` each run to train, :meth:`progress` a running run's
    steps, :meth:`finished` a run that ended; :meth:`seconds_left` is the estimate."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.started: float | None = None
        self.runs: dict[str, list[float]] = {}      # name -> [work a step, steps left, steps done]

    def add(self, name: str, steps_left: int, work_per_step: float) -> None:
        self.runs[name] = [work_per_step, max(0, steps_left), 0]

    def start(self) -> None:
        """The first run starts (the clock starts once)."""
        if self.started is None:
            self.started = self.clock()

    def progress(self, name: str, steps_done: int) -> None:
        """``name`` has trained ``steps_done`` steps in this session."""
        run = self.runs[name]
        run[2] = min(max(0, steps_done), run[1])

    def finished(self, name: str, steps_done: int | None = None) -> None:
        """``name`` ended after ``steps_done`` steps of this session (``None``: as many as its
        :meth:`progress` said); what it did not train leaves the grid."""
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
