"""Ctrl-C during training: finish the step in flight instead of tearing it apart."""

from __future__ import annotations

import signal
import sys
import threading


class DeferredInterrupt:
    """Within the ``with`` block, the first SIGINT only sets :attr:`requested` (the loop stops at
    the next step boundary, so no optimizer update is left half applied); a second one raises
    :class:`KeyboardInterrupt` at once. Outside the main thread, where Python cannot install a
    handler, nothing changes and SIGINT raises as usual."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None
        self._installed = False

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\ninterrupt: stopping after this step and saving a checkpoint (Ctrl-C again to stop "
              "at once)", file=sys.stderr, flush=True)

    def __enter__(self) -> DeferredInterrupt:
        if threading.current_thread() is threading.main_thread():
            try:
                self._previous = signal.signal(signal.SIGINT, self._handle)
                self._installed = True
            except ValueError:
                pass
        return self

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGINT, self._previous if self._previous is not None
                          else signal.default_int_handler)
            self._installed = False
