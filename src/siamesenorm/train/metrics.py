"""The run's metric log: ``metrics.jsonl`` (one JSON object per logged step) and, when the optional
``tensorboard`` package is installed, the same scalars under ``tb/``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ..rundir import RunDir, open_jsonl, plain


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
    """

    def __init__(self, run_dir: Path, keep_until: int | None = None, tensorboard: bool = True) -> None:
        layout = RunDir(run_dir)
        self.path = layout.metrics
        self._file = open_jsonl(self.path, keep_until)
        self._tb = _tensorboard(layout.tensorboard, None if keep_until is None else keep_until + 1) \
            if tensorboard else None

    def write(self, row: dict[str, Any]) -> None:
        row = plain(row)
        self._file.write(json.dumps(row, allow_nan=False) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in row.items():
                if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self._tb.add_scalar(key, value, row["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()
