"""Standard output and error that a run outlives: a closed, full or broken log stops the log, never
the run.

A run started with ``2>&-`` (Python then has no ``sys.stderr``), ``2>/dev/full`` (every write
fails) or ``2>&1 | head -c 10`` (the reader exits mid-run) goes on training, checkpoints and writes
its ``summary.json``; only what it would have printed is lost. :func:`outlive_readers` sets this up
for a process; :class:`LogStream` is the stream it installs.
"""

from __future__ import annotations

import os
import sys
from typing import TextIO

__all__ = ["LogStream", "outlive_readers"]


class LogStream:
    """A text stream around ``stream`` (``None``: there is none) whose ``write`` and ``flush``
    never raise for the file behind it: once one fails (a closed, full or broken file), the stream
    is mute for good and its file descriptor becomes ``/dev/null``, so that what the process or
    its children write to it at the C level is dropped too."""

    def __init__(self, stream: TextIO | None) -> None:
        self._stream = stream
        self.mute = stream is None

    def write(self, text: str) -> int:
        if not self.mute:
            try:
                return self._stream.write(text)
            except (OSError, ValueError):
                self._silence()
        return len(text)

    def flush(self) -> None:
        if not self.mute:
            try:
                self._stream.flush()
            except (OSError, ValueError):
                self._silence()

    def isatty(self) -> bool:
        return not self.mute and self._stream.isatty()

    def _silence(self) -> None:
        self.mute = True
        try:
            _to_null(self._stream.fileno())
        except (OSError, ValueError):
            pass

    def __getattr__(self, name: str):
        if self._stream is None:
            raise AttributeError(name)
        return getattr(self._stream, name)


def _to_null(fd: int) -> None:
    null = os.open(os.devnull, os.O_WRONLY)
    if null != fd:
        os.dup2(null, fd)
        os.close(null)


def _open_or_null(fd: int) -> None:
    """A closed file descriptor 1 or 2 becomes ``/dev/null``: a file the run opens later would
    take the number, and what C code writes to standard error would land in it."""
    try:
        os.fstat(fd)
    except OSError:
        _to_null(fd)


def outlive_readers() -> None:
    """Make this process's ``sys.stdout`` and ``sys.stderr`` :class:`LogStream` s (once)."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        stream = getattr(sys, name)
        if isinstance(stream, LogStream):
            continue
        if stream is None:
            _open_or_null(fd)
        setattr(sys, name, LogStream(stream))
