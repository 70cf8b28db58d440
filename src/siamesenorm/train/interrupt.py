"""Ctrl-C and SIGTERM during training: finish the step in flight instead of tearing it apart."""

from __future__ import annotations

import os
import signal
import sys
import threading
from abc import ABC, abstractmethod

from ..errors import Terminated
from ..parallel.launch import ERROR_DIR_ENV

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class SignalScope(ABC):
    """Within the ``with`` block SIGINT and SIGTERM go to :meth:`_handle`, then the former handlers are back;
    outside the main thread nothing changes."""

    _previous: dict[int, object]

    @abstractmethod
    def _handle(self, signum, frame) -> None:
        """What SIGINT or SIGTERM does within the block (each subclass says)."""

    def __enter__(self):
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                try:
                    self._previous[sig] = signal.signal(sig, self._handle)
                except ValueError:
                    pass
        return self

    def __exit__(self, *exc) -> None:
        for sig, previous in self._previous.items():
            default = signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL
            signal.signal(sig, previous if previous is not None else default)
        self._previous = {}


class DeferredInterrupt(SignalScope):
    """Within the block the first SIGINT or SIGTERM only sets :attr:`requested` (the loop stops and
    checkpoints at the next step boundary); a second stops at once. :meth:`error` is the exception to
    stop with: ``Terminated`` after SIGTERM, ``KeyboardInterrupt`` after Ctrl-C."""

    def __init__(self) -> None:
        self.requested = False
        self.terminated = False     # the request came by SIGTERM

    def error(self) -> KeyboardInterrupt:
        return Terminated() if self.terminated else KeyboardInterrupt()

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise self.error()
        self.requested = True
        self.terminated = signum == signal.SIGTERM
        if self.terminated:
            note = "SIGTERM: stopping after this step and saving a checkpoint"
        else:
            note = "interrupt: stopping after this step and saving a checkpoint (Ctrl-C again to " \
                   "stop at once)"
        if os.environ.get(ERROR_DIR_ENV):
            return      # a rank of --nproc: its launcher reports the stop, once for all ranks
        isatty = getattr(sys.stderr, "isatty", None)
        lead = "\n" if isatty is not None and isatty() else ""     # below a live progress bar
        print(f"{lead}{note}", file=sys.stderr, flush=True)

