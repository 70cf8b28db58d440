"""What ``compare`` shows on stderr while its runs train: on a terminal a view redrawn in place,
elsewhere plain lines, both fed by the runs' own ``[train]`` lines (docs/compare.md)."""

from __future__ import annotations

import io
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, redirect_stderr
from dataclasses import dataclass
from typing import TextIO

from tqdm import tqdm

from ..streams import LogStream
from ..train.progress import LOG_PREFIX, duration
from .eta import Eta

_STEP = re.compile(rf"{re.escape(LOG_PREFIX)} step (\d+)/(\d+) \| loss (\S+)(?: \| val loss (\S+))?")
_END = re.compile(rf"{re.escape(LOG_PREFIX)} (done|diverged|stalled|interrupted)\b")
REDRAW_S = 0.2              # the terminal view is redrawn at most this often
PROGRESS_MARKS = 10         # a log gets a grid line at each tenth of the grid's work ...
PROGRESS_EVERY_S = 300.0    # ... or after this long without one
SHOWN_IN_A_LINE = 4         # running runs named in that line


@dataclass
class RunState:
    """A running run as its log last showed it."""

    start: int          # the step this session started from
    steps: int
    step: int
    loss: str | None = None
    val_loss: str | None = None

    def text(self) -> str:
        return ", ".join([f"step {self.step}/{self.steps}",
                          *([f"loss {self.loss}"] if self.loss else []),
                          *([f"val loss {self.val_loss}"] if self.val_loss else [])])


class GridView:
    """The progress of a grid of ``total`` runs on ``stream`` (default stderr): ``live`` (default: a
    terminal) redraws one view in place, otherwise plain lines. Safe to call from several threads."""

    def __init__(self, total: int, done: int, eta: Eta, stream: TextIO | None = None, *,
                 live: bool | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        stream = sys.stderr if stream is None else stream
        self.stream = stream if isinstance(stream, LogStream) else LogStream(stream)
        self.live = _is_terminal(self.stream) if live is None else live
        self.total, self.done, self.eta, self.clock = total, done, eta, clock
        self.running: dict[str, RunState] = {}
        self.ascii = not _unicode(self.stream)
        self._lock = threading.RLock()
        self._drawn = 0                     # lines of the live view now on screen
        self._last_draw = self._last_line = clock()
        self._mark = 0                      # tenths of the work the log's last grid line showed
        self._closed = False

    # ---- what happens to the runs
    def started(self, name: str, start: int, steps: int, resumed: bool = False) -> None:
        """``name`` starts or ``resumed`` at step ``start`` (0: not known) of ``steps``."""
        with self._lock:
            self.eta.start()
            self.running[name] = RunState(start, steps, start)
            if self.live:
                self._draw()
            elif not resumed:
                self._emit(f"{name}: started, {steps} steps")
            else:
                self._emit(f"{name}: resumed at step {start}/{steps}" if start else
                           f"{name}: resumed from its last checkpoint, {steps} steps in all")

    def run_line(self, name: str, line: str) -> None:
        """A line ``name`` wrote: a step line updates the view; its final line is shown in a log;
        any other line is shown, after the name."""
        with self._lock:
            run, step = self.running.get(name), _STEP.match(line)
            if step:
                if run is not None:
                    run.step, run.loss = int(step.group(1)), step.group(3)
                    run.val_loss = step.group(4) or run.val_loss
                    if name in self.eta.runs:
                        self.eta.progress(name, run.step - run.start)
            elif not (self.live and _END.match(line)):     # on a terminal, the view shows it
                self._emit(f"{name}: {line}")
            self.tick()

    def ended(self, name: str, steps_done: int | None = None) -> None:
        """``name`` ended (finished or failed) after ``steps_done`` steps of this session."""
        with self._lock:
            self.done += 1
            self._leave(name, steps_done)

    def stopped(self, name: str, steps_done: int | None = None) -> None:
        """``name`` was interrupted after ``steps_done`` steps of this session; it stays to do."""
        with self._lock:
            self._leave(name, steps_done)

    def _leave(self, name: str, steps_done: int | None) -> None:
        if name in self.eta.runs:
            self.eta.finished(name, steps_done)
        self.running.pop(name, None)
        if self.live:
            self._draw()

    # ---- output
    def note(self, text: str) -> None:
        """A line of the comparison's own on the view's stream (above the view on a terminal)."""
        with self._lock:
            self._emit(text)

    @contextmanager
    def paused(self) -> Iterator[None]:
        """The view off the screen for the block (to print elsewhere), then back."""
        with self._lock:
            self._erase()
            try:
                yield
            finally:
                try:
                    sys.stdout.flush()
                except (AttributeError, OSError, ValueError):
                    pass
                if self.live and not self._closed:
                    self._draw()

    def wrap(self, log: Callable[[str], None]) -> Callable[[str], None]:
        """``log`` (which prints, to stdout) printing with the view out of the way."""
        def say(text: str) -> None:
            with self.paused():
                log(text)
        return say

    @contextmanager
    def capture(self, name: str) -> Iterator[None]:
        """What a run in this process writes to stderr in the block goes to :meth:`run_line`."""
        lines = _Lines(lambda line: self.run_line(name, line))
        try:
            with redirect_stderr(lines):
                yield
        finally:
            lines.end()

    def tick(self) -> None:
        """Redraw the view when due; in a log, the grid line when due."""
        with self._lock:
            now = self.clock()
            if self.live:
                if now - self._last_draw >= REDRAW_S:
                    self._draw()
                return
            mark = int(self._fraction() * PROGRESS_MARKS)
            if self.running and mark < PROGRESS_MARKS and (
                    mark > self._mark or now - self._last_line >= PROGRESS_EVERY_S):
                self._mark, self._last_line = mark, now
                runs = [f"{name} {run.text()}" for name, run in self.running.items()]
                more = len(runs) - SHOWN_IN_A_LINE
                self._emit(f"compare: {self.grid_text()}; " + "; ".join(
                    runs[:SHOWN_IN_A_LINE] + ([f"{more} more running"] if more > 0 else [])))

    def close(self) -> None:
        with self._lock:
            self._erase()
            self._closed = True

    def grid_text(self) -> str:
        """``3/18 done, 2 running, 13 pending, elapsed 1m02s, ETA 5m10s``."""
        left = self.eta.seconds_left()
        pending = max(0, self.total - self.done - len(self.running))
        return (f"{self.done}/{self.total} done, {len(self.running)} running, {pending} pending, "
                f"elapsed {duration(self.eta.elapsed())}, ETA {'?' if left is None else duration(left)}")

    def lines(self, rows: int = 1000) -> list[str]:
        """The live view in at most ``rows`` lines: the grid, then each running run."""
        width = max([len(name) for name in (*self.running, *self.eta.runs)] or [0])
        out = [f"{'compare':<{width + 2}} {self._bar(self._fraction())} {self.grid_text()}"]
        shown = list(self.running.items())
        if len(shown) > rows - 1:
            shown = shown[:max(0, rows - 2)]
        for name, run in shown:
            figures = ", ".join([*([f"loss {run.loss}"] if run.loss else []),
                                 *([f"val loss {run.val_loss}"] if run.val_loss else [])])
            out.append(f"  {name:<{width}} {self._bar(run.step / max(1, run.steps))} "
                       f"{run.step}/{run.steps} {figures}".rstrip())
        if len(shown) < len(self.running):
            out.append(f"  and {len(self.running) - len(shown)} more running")
        return out[:max(1, rows)]

    def _fraction(self) -> float:
        done, left = self.eta.work_done(), self.eta.work_left()
        return done / (done + left) if done + left > 0 else 0.0

    def _bar(self, fraction: float) -> str:
        return tqdm.format_meter(round(1000 * fraction), 1000, 0, ascii=self.ascii,
                                 bar_format="{percentage:3.0f}%|{bar:16}|")

    def _emit(self, text: str) -> None:
        if self.live:
            self._erase()
        self.stream.write(text + "\n")
        self.stream.flush()
        if self.live and not self._closed:
            self._draw()

    def _erase(self) -> None:
        if self._drawn:
            self.stream.write(f"\x1b[{self._drawn}A\r\x1b[J")     # up, to the left, clear below
            self.stream.flush()
            self._drawn = 0

    def _draw(self) -> None:
        if self._closed:
            return
        columns, rows = _size(self.stream)
        lines = [line[:columns - 1] for line in self.lines(rows - 1)]
        text = f"\x1b[{self._drawn}A\r\x1b[J" if self._drawn else ""
        self.stream.write(text + "".join(line + "\n" for line in lines))
        self.stream.flush()
        self._drawn, self._last_draw = len(lines), self.clock()


class _Lines(io.TextIOBase):
    """A text stream that hands each complete line to ``on_line`` (not a terminal)."""

    def __init__(self, on_line: Callable[[str], None]) -> None:
        super().__init__()
        self.on_line, self.partial = on_line, ""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        *whole, self.partial = (self.partial + text).split("\n")
        for line in whole:
            self.on_line(line.rstrip("\r"))
        return len(text)

    def end(self) -> None:
        if self.partial:
            line, self.partial = self.partial, ""
            self.on_line(line)


def _is_terminal(stream: TextIO) -> bool:
    return stream.isatty() and os.environ.get("TERM") != "dumb"


def _size(stream: TextIO) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(stream.fileno())
    except (AttributeError, OSError, ValueError):
        return 100, 24
    return size.columns or 100, size.lines or 24


def _unicode(stream: TextIO) -> bool:
    try:
        "█▏".encode(getattr(stream, "encoding", None) or "ascii")
    except (UnicodeError, LookupError):
        return False
    return True
