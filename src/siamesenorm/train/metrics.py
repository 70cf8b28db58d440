"""The run's metric log: ``metrics.jsonl`` (one JSON object per logged step) and, when the optional
``tensorboard`` package is installed, the same scalars under ``tb/``."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from ..rundir import RunDir, open_jsonl, plain, write_text


def _tensorboard(log_dir: Path, purge_step: int | None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:  # tensorboard is an optional extra
        return None
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)


class MetricsLog:
    """Appends rows to ``run_dir/metrics.jsonl``, flushed row by row.

    ``keep_until=None`` starts an empty log; an integer keeps the existing rows up to that step and
    drops the later ones (a resumed run repeats them), so the log never holds a step twice (a line
    a killed run left cut short is dropped; see :func:`~siamesenorm.rundir.read_jsonl`). Numeric
    values other than ``step`` also go to TensorBoard under ``run_dir/tb`` when it can be imported.

    The log keeps its lines in memory too: when the file is deleted, replaced or cut short under the
    live run (a careless ``rm``, a full disk's truncation), the next write notices, says so on
    stderr and rewrites the file from them, so no row is lost silently.
    """

    def __init__(self, run_dir: Path, keep_until: int | None = None, tensorboard: bool = True) -> None:
        layout = RunDir(run_dir)
        self.path = layout.metrics
        self._file = open_jsonl(self.path, keep_until)
        self._lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        self._size = sum(len(line.encode("utf-8")) for line in self._lines)
        self._tb = _tensorboard(layout.tensorboard, None if keep_until is None else keep_until + 1) \
            if tensorboard else None

    def _check(self) -> None:
        """Rewrite the file from the rows held here when it is gone, replaced or shorter than
        what was written (and say so)."""
        try:
            on_disk = os.stat(self.path)
        except FileNotFoundError:
            what = "deleted"
        else:
            if not os.path.samestat(on_disk, os.fstat(self._file.fileno())):
                what = "replaced"
            elif on_disk.st_size < self._size:
                what = "cut short"
            else:
                return
        print(f"warning: {self.path} was {what} while the run was writing it; rewriting it from "
              f"the {len(self._lines)} rows this run holds", file=sys.stderr, flush=True)
        self._file.close()
        write_text(self.path, "".join(self._lines))
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, row: dict[str, Any]) -> None:
        row = plain(row)
        line = json.dumps(row, allow_nan=False) + "\n"
        self._check()
        try:
            self._file.write(line)
            self._file.flush()
        except OSError as error:    # a full disk: the OS's words, naming the file
            self._failed = True
            if error.filename is not None or error.errno is None:
                raise
            raise OSError(error.errno, error.strerror, str(self.path)) from None
        self._lines.append(line)
        self._size += len(line.encode("utf-8"))
        if self._tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, row["step"])

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:     # the rows a full disk refused: already raised once by write
            if not getattr(self, "_failed", False):
                raise
        if self._tb is not None:
            self._tb.close()
