"""The older checkpoints kept beside the last (``step_<N>``), and their pruning."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .names import CHECKSUM_FILE, KEPT_PREFIX


def kept_name(path: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` goes when a newer one replaces it at ``path``."""
    return path.parent / f"{KEPT_PREFIX}{step}"


def older_checkpoints(path: str | os.PathLike) -> list[Path]:
    """The kept checkpoints beside ``path`` (``step_<N>`` folders), newest first."""
    path = Path(path)
    n = len(KEPT_PREFIX)
    found = [p for p in path.parent.glob(f"{KEPT_PREFIX}*") if p.is_dir() and p.name[n:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[n:]), reverse=True)


def written_here(folder: Path) -> bool:
    """Whether ``folder`` is as a run writes it: a real folder, all files in ``checksums.json``, no link."""
    if folder.is_symlink():
        return False
    try:
        listed = json.loads((folder / CHECKSUM_FILE).read_text(encoding="utf-8"))
        inside = [p for p in folder.rglob("*") if p != folder / CHECKSUM_FILE]
    except (OSError, ValueError):
        return False
    if not isinstance(listed, dict) or any(p.is_symlink() for p in inside):
        return False
    files = {p.relative_to(folder).as_posix() for p in inside if p.is_file()}
    return files == set(listed)


def prune_checkpoints(path: str | os.PathLike, keep: int) -> None:
    """Delete the kept checkpoints beside ``path`` beyond the newest ``keep - 1``; only folders
    :func:`written_here` count, so a ``step_<N>`` a person made stays."""
    ours = [p for p in older_checkpoints(path) if written_here(p)]
    for stale in ours[max(keep - 1, 0):]:
        shutil.rmtree(stale, ignore_errors=True)
