"""What an experiment keeps on disk: a run that finished only ``checkpoints/last`` (unless
``compare.keep_checkpoints`` is ``all``), a run that may be resumed every checkpoint it wrote."""

from __future__ import annotations

import os
from pathlib import Path

from ..rundir import RunDir
from ..train.checkpoint.keep import older_checkpoints, prune_checkpoints, written_here


def finished_cleanly(summary: dict) -> bool:
    """Whether the run trained to its end (neither interrupted nor failed) and checkpointed there."""
    return not any(summary.get(k) for k in ("interrupted", "failed", "diverged", "stalled")) \
        and summary.get("checkpoint_step") == summary.get("steps")


def keep_last_checkpoint(run_dir: Path, summary: dict) -> None:
    """Delete the older checkpoints of a run that finished cleanly, once its ``checkpoints/last`` is whole."""
    last = RunDir(run_dir).last_checkpoint
    if finished_cleanly(summary) and written_here(last):
        prune_checkpoints(last, keep=1)


def file_bytes(folder: Path) -> int:
    """The sum of the sizes of the files under ``folder`` (links are not followed)."""
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            path = Path(root, name)
            if not path.is_symlink():
                total += path.stat().st_size
    return total


def _size(n: int) -> str:
    for unit, size in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"


def kept_line(out: Path, names: list[str], keep_checkpoints: str) -> str:
    """One line: the bytes the experiment keeps, the share of checkpoints, and which ones its runs keep."""
    total, checkpoints, with_last, with_older = file_bytes(out), 0, 0, 0
    for name in names:
        run = RunDir(out / name)
        if not run.checkpoints.is_dir():
            continue
        size = file_bytes(run.checkpoints.resolve())
        checkpoints += size
        total += size if run.checkpoints.is_symlink() else 0
        with_last += run.last_checkpoint.is_dir()
        with_older += bool(older_checkpoints(run.last_checkpoint))
    n = len(names)
    what = ("its last checkpoint" if n == 1 else "the last checkpoint of each") if with_last == n else \
        f"the last checkpoint of {with_last} ({n - with_last} have none)"
    if with_older:
        what += f", and older ones of {with_older}" + \
            (" (compare.keep_checkpoints: all)" if keep_checkpoints == "all" else "")
    return (f"{out} keeps {_size(total)} ({_size(checkpoints)} of it checkpoints): "
            f"{n} run{'s' if n != 1 else ''}, {what}")
