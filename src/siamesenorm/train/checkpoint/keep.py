"""The older checkpoints kept beside the last (``step_<N>``), and their pruning."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def kept_name(path: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` goes when a newer one replaces it at ``path``."""
    return path.parent / f"step_{step}"


def older_checkpoints(path: str | os.PathLike) -> list[Path]:
    """The kept checkpoints beside ``path`` (``step_<N>`` folders), newest first."""
    path = Path(path)
    found = [p for p in path.parent.glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]), reverse=True)


def prune_checkpoints(path: str | os.PathLike, keep: int) -> None:
    """Delete the kept checkpoints beside ``path`` beyond the newest ``keep - 1`` (``path`` itself
    is the last of ``keep``)."""
    for stale in older_checkpoints(path)[max(keep - 1, 0):]:
        shutil.rmtree(stale, ignore_errors=True)
