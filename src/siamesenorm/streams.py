"""Standard output and error that a run outlives: a closed, full or broken log stops the log, never
the run."""

from __future__ import annotations

import os
import sys
from typing import TextIO

__all__ = ["LogStream", "outlive_readers"]


class LogStream:
    """A text stream around ``stream`` (``None``: none) whose ``write`` and ``flush`` never raise: once
    one fails, it is mute for good and its file descriptor becomes ``/dev/null``."""

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
    """A closed file descriptor 1 or 2 becomes ``/dev/null``, so that no file the run opens later takes
    its number."""
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
