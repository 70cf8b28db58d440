"""The model folders siamesenorm writes: which folder may be written or replaced (only one it wrote,
listed in :data:`MARKER`), and how (a temporary folder renamed into place)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .. import __version__
from ..errors import UserError
from ..rundir import as_created, check_out_dir, library_os_error

__all__ = ["MARKER", "check_model_folder", "writing_model_folder"]

MARKER = ".siamesenorm-model-folder.json"     # {"written_by": ..., "files": [relative paths]}
_MAX_MARKER_BYTES = 1 << 20
_SHOWN = 4          # the entries a refusal names


def check_model_folder(out: str | os.PathLike, *, force: bool, flag: str = "--out",
                       force_flag: str = "--force") -> Path:
    """Refuse (:class:`UserError`, naming ``flag``) a model folder ``out`` that may not be written: a
    file, a dangling link, the root, a mount point, one holding the current or home folder, a folder
    not empty unless ``force``, and even then one holding anything siamesenorm did not write. Returns
    ``out`` with its links resolved."""
    out = Path(out)
    check_out_dir(out, flag)
    if out.is_symlink() and not out.exists():
        raise UserError(f"{flag} {out} is a link to {os.readlink(out)}, which does not exist; remove "
                        f"the link or choose another {flag}")
    target = out.resolve()
    if target.parent == target:
        raise UserError(f"{flag} {out} is the root folder; choose a folder of its own for the model")
    for holds, what in ((_cwd(), "the current folder"), (_home(), "your home folder")):
        if holds is not None and (target == holds or target in holds.parents):
            raise UserError(f"{flag} {out} holds {what} ({holds}); choose another folder")
    if not target.exists():
        return target
    if os.path.ismount(target):
        raise UserError(f"{flag} {out} is a mount point, which a rename cannot replace; write the model "
                        "into a folder inside it")
    try:
        empty = not any(target.iterdir())
        foreign = [] if empty else _not_ours(target)
    except OSError as error:
        raise UserError(f"cannot read {flag} {out}: {error.strerror or error}") from None
    if empty:
        return target
    shown = ", ".join(foreign[:_SHOWN - 1]) + (", ..." if len(foreign) >= _SHOWN else "")
    if foreign:
        not_ours = f"holds files siamesenorm did not write ({shown})"
        if not force:
            raise UserError(f"{flag} {out} is a folder that is not empty and {not_ours}; choose another "
                            f"folder ({force_flag} replaces only a model folder siamesenorm wrote)")
        raise UserError(f"{flag} {out} {not_ours}; {force_flag} replaces only a model folder "
                        "siamesenorm wrote: remove them or choose another folder")
    if not force:
        raise UserError(f"{flag} {out} is a folder that is not empty; add {force_flag} to replace it, "
                        "or choose another folder")
    return target


@contextmanager
def writing_model_folder(out: str | os.PathLike, *, force: bool, written_by: str, flag: str = "--out",
                         force_flag: str = "--force") -> Iterator[Path]:
    """Yield an empty temporary folder beside ``out`` to write the model into; then record its files in
    :data:`MARKER` and rename it to ``out``. On a failure ``out`` is as it was."""
    target = check_model_folder(out, force=force, flag=flag, force_flag=force_flag)
    tmp = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        # a fresh name, made exclusively: nothing planted beside the folder is followed or deleted
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        yield tmp
        _write_marker(tmp, written_by)
        for path in (tmp, *tmp.rglob("*")):     # mkdtemp's 0700, safetensors' 0600
            as_created(path)
        check_model_folder(out, force=force, flag=flag, force_flag=force_flag)    # still so
        _move_into_place(tmp, target)
    except Exception as error:
        found = library_os_error(error, out)
        if found is not None:
            raise found from None
        raise
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def _cwd() -> Path | None:
    try:
        return Path.cwd().resolve()
    except OSError:             # the current folder was deleted
        return None


def _home() -> Path | None:
    try:
        return Path.home().resolve()
    except (RuntimeError, KeyError, OSError):      # no HOME and no password entry
        return None


def _write_marker(folder: Path, written_by: str) -> None:
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))
    record = {"written_by": f"siamesenorm {__version__} ({written_by})", "files": files}
    (folder / MARKER).write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")


def _marked(folder: Path) -> set[str]:
    """What the folder's :data:`MARKER` lists (nothing when it is missing, a link or damaged)."""
    path = folder / MARKER
    try:
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode) or info.st_size > _MAX_MARKER_BYTES:
            return set()
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return set()
    files = record.get("files") if isinstance(record, dict) else None
    if not isinstance(files, list) or not all(isinstance(f, str) for f in files):
        return set()
    return set(files) | {MARKER}


def _not_ours(folder: Path) -> list[str]:
    """The first entries of ``folder`` its marker does not list, or links (a folder's with a ``/``)."""
    ours, found, todo = _marked(folder), [], [folder]
    while todo and len(found) < _SHOWN:
        with os.scandir(todo.pop()) as entries:
            listing = sorted(entries, key=lambda e: e.name)
        for entry in listing:
            name = Path(entry.path).relative_to(folder).as_posix()
            is_dir = entry.is_dir(follow_symlinks=False)
            if name not in ours or entry.is_symlink():
                found.append(name + ("/" if is_dir else ""))
                if len(found) >= _SHOWN:
                    break
            elif is_dir:
                todo.append(Path(entry.path))
    return found


def _move_into_place(tmp: Path, target: Path) -> None:
    """Rename ``tmp`` to ``target``; an existing ``target`` is moved aside and deleted only once the new
    one is in place (put back if the rename fails)."""
    if not target.exists() or not any(target.iterdir()):
        os.replace(tmp, target)            # an empty folder is replaced by the rename itself
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
    try:
        os.replace(target, old)            # onto the empty folder just made
    except OSError:
        old.rmdir()
        raise
    try:
        os.replace(tmp, target)
    except OSError:
        os.replace(old, target)
        raise
    shutil.rmtree(old, ignore_errors=True)
