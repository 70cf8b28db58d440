"""The older checkpoints kept beside the last (``step_<N>``), and their pruning."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .names import CHECKSUM_FILE


def kept_name(path: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` goes when a newer one replaces it at ``path``."""
    return path.parent / f"step_{step}"


def older_checkpoints(path: str | os.PathLike) -> list[Path]:
    """The kept checkpoints beside ``path`` (``step_<N>`` folders), newest first."""
    path = Path(path)
    found = [p for p in path.parent.glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]), reverse=True)


def written_here(folder: Path) -> bool:
    """Whether ``folder`` is a checkpoint as a run writes it and nothing else: a real folder (no
    link) whose ``checksums.json`` lists every file in it, none of them a link. A ``step_<N>``
    folder a person made, or a checkpoint someone added files to, is not."""
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
    """Delete the kept checkpoints beside ``path`` beyond the newest ``keep - 1`` (``path`` itself
    is the last of ``keep``); only folders :func:`written_here` are counted and deleted, so that a
    ``step_<N>`` the run did not write (a person's, one in a shared scratch folder) stays."""
    ours = [p for p in older_checkpoints(path) if written_here(p)]
    for stale in ours[max(keep - 1, 0):]:
        shutil.rmtree(stale, ignore_errors=True)
