"""The atomic write: a fresh hidden folder beside the target, fsynced, checksummed, swapped in."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
from pathlib import Path

from ...errors import UserError
from ...rundir import as_created
from .names import CHECKSUM_FILE, OLD_MARK


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file, or a directory's entries) to disk; a no-op where the OS refuses."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _hidden(path: Path, kind: str) -> list[Path]:
    return sorted(path.parent.glob(f".{path.name}.{kind}-*"))


def _recover(path: Path, clean: bool) -> None:
    """Put a checkpoint whose swap was cut short back at ``path``; with ``clean``, delete leftovers."""
    olds = _hidden(path, "old")
    if not path.exists() and olds:
        os.replace(olds.pop(), path)
        _fsync(path.parent)
    if clean:
        for leftover in olds + _hidden(path, "tmp"):
            shutil.rmtree(leftover, ignore_errors=True)


def new_temporary(path: Path) -> Path:
    """A fresh hidden directory beside ``path`` for its next version (after recovering a cut-short swap)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _recover(path, clean=True)
    folder = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    as_created(folder)          # readable as the run's other folders are, not owner-only
    return folder


def _digest(file: Path) -> str:
    with open(file, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_checksums(folder: Path) -> None:
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != CHECKSUM_FILE)
    sums = {p.relative_to(folder).as_posix(): {"sha256": _digest(p), "bytes": p.stat().st_size}
            for p in files}
    target = folder / CHECKSUM_FILE
    target.write_text(json.dumps(sums, indent=1) + "\n", encoding="utf-8")
    _fsync(target)


def verify_checksums(path: str | os.PathLike) -> None:
    """Refuse a checkpoint whose files do not match its ``checksums.json``; one without it (older) passes."""
    path = Path(path)
    file = path / CHECKSUM_FILE
    if not file.exists():
        return
    damaged = f"checkpoint {path} is damaged"
    try:
        sums = json.loads(file.read_text(encoding="utf-8"))
        entries = [(rel, want["sha256"], want["bytes"]) for rel, want in sums.items()]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        raise UserError(f"{damaged}: its {CHECKSUM_FILE} is unreadable") from None
    for rel, sha, size in entries:
        part = path / rel
        if not part.is_file():
            raise UserError(f"{damaged}: {rel} is missing")
        if part.stat().st_size != size or _digest(part) != sha:
            raise UserError(f"{damaged}: {rel} does not match the checksum written with it "
                              "(changed, flipped or cut-short bytes); restore it from a copy")


def install(tmp: Path, path: Path, keep_as: Path | None = None) -> None:
    """Swap the complete ``tmp`` in at ``path`` (checksums recorded); ``keep_as`` keeps the one replaced."""
    write_checksums(tmp)
    _fsync(tmp)
    old = None
    if path.exists():
        if keep_as is not None and not keep_as.exists():
            os.replace(path, keep_as)
        else:
            old = path.parent / f".{path.name}{OLD_MARK}{uuid.uuid4().hex[:12]}"
            os.replace(path, old)
    os.replace(tmp, path)
    _fsync(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
