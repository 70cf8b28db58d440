"""The run's metric log: ``metrics.jsonl`` (one JSON object per logged step) and, when the optional
``tensorboard`` package is installed, the same scalars under ``tb/``."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

METRICS_FILE = "metrics.jsonl"


def plain(value: Any) -> Any:
    """``value`` as strict JSON: a non-finite float becomes ``None`` (``null``), containers recurse,
    and a number-like object (a 0-D tensor, a numpy scalar) becomes its Python number."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (str, bool, int)) or value is None:
        return value
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return value


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented strict JSON to ``path`` through a temporary file and a rename."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(plain(obj), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _rows_until(path: Path, step: int) -> list[str]:
    """The well-formed lines of ``path`` whose ``step`` is at most ``step``."""
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a crash
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] <= step:
            kept.append(line)
    return kept


def _tensorboard(log_dir: Path, purge_step: int | None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:  # tensorboard is an optional extra
        return None
    return SummaryWriter(log_dir=str(log_dir), purge_step=purge_step)


class MetricsLog:
    """Appends rows to ``run_dir/metrics.jsonl``, flushed row by row.

    ``keep_until=None`` starts an empty log; an integer keeps the existing rows up to that step and
    drops the later ones (a resumed run repeats them), so the log never holds a step twice. Numeric
    values other than ``step`` also go to TensorBoard under ``run_dir/tb`` when it can be imported.
    """

    def __init__(self, run_dir: Path, keep_until: int | None = None, tensorboard: bool = True) -> None:
        self.path = Path(run_dir) / METRICS_FILE
        kept = _rows_until(self.path, keep_until) if keep_until is not None and self.path.exists() \
            else []
        tmp = self.path.with_name(f".{METRICS_FILE}.tmp-{os.getpid()}")
        tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
        os.replace(tmp, self.path)
        self._file = open(self.path, "a", encoding="utf-8")
        self._tb = _tensorboard(Path(run_dir) / "tb", None if keep_until is None else keep_until + 1) \
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
