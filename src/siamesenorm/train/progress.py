"""A one-line progress display on stderr, redrawn in place with a carriage return."""

from __future__ import annotations

import sys
import time
from typing import TextIO


def _rate(tokens_per_s: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if tokens_per_s >= scale:
            return f"{tokens_per_s / scale:.1f}{unit} tok/s"
    return f"{tokens_per_s:.0f} tok/s"


class ProgressLine:
    """``step 12/200  loss 3.1416  lr 1.00e-03  12.3k tok/s``, redrawn at most ten times a second.

    ``enabled=None`` shows it only when the stream (stderr by default) is a terminal.
    """

    def __init__(self, total: int, enabled: bool | None = None, stream: TextIO | None = None) -> None:
        self.total = total
        self.stream = sys.stderr if stream is None else stream
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled = enabled
        self._width = 0
        self._last = float("-inf")

    def update(self, step: int, loss: float, lr: float, tokens_per_s: float) -> None:
        now = time.monotonic()
        if not self.enabled or (now - self._last < 0.1 and step < self.total):
            return
        self._last = now
        text = f"step {step}/{self.total}  loss {loss:.4f}  lr {lr:.2e}  {_rate(tokens_per_s)}"
        self.stream.write("\r" + text.ljust(self._width))
        self.stream.flush()
        self._width = len(text)

    def close(self) -> None:
        """End the line, so that what is printed next starts on a line of its own."""
        if self.enabled and self._width:
            self.stream.write("\n")
            self.stream.flush()
            self._width = 0
