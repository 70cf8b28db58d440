"""Exclusive locks on output folders (``.siamesenorm.lock`` under ``flock``): one writer per run
folder and per experiment folder; the lock of a process that died is simply taken."""

from __future__ import annotations

import errno
import json
import os
import socket
import stat
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .errors import UserError

try:
    import fcntl
except ImportError:      # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = ["LOCK_NAME", "FolderLock", "check_free", "folder_lock", "held_by"]

LOCK_NAME = ".siamesenorm.lock"
# Set by the launcher for the processes it starts: the pid whose locks they work under.

_held: dict[Path, FolderLock] = {}      # this process's locks, by resolved folder


def _key(folder: Path) -> Path:
    return Path(os.path.abspath(folder))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # someone else's process: alive
        return True
    except OSError:
        return False
    return True


# Opening a lock file: never through a symbolic link, never blocking on a FIFO.
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def _open_lock(path: Path, flags: int) -> int:
    """``os.open`` of the lock file without following a link; anything but a regular file is a
    :class:`UserError`."""
    try:
        fd = os.open(path, flags | _NOFOLLOW, 0o644)
    except OSError as error:
        if error.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO):
            _not_a_lock(path)
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        _not_a_lock(path)
    return fd


def _not_a_lock(path: Path) -> None:
    raise UserError(f"{path} is not a regular file (a symbolic link, a folder or a device), so it "
                      "is not siamesenorm's lock and is not written through; remove it and try again")


def held_by(folder: str | os.PathLike) -> dict | None:
    """What the lock file of ``folder`` says of its holder, or ``None``."""
    try:
        fd = _open_lock(Path(folder) / LOCK_NAME, os.O_RDONLY)
    except (OSError, UserError):
        return None
    try:
        with os.fdopen(fd, "rb") as f:
            info = json.loads(f.read(65536).decode("utf-8"))
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def _describe(info: dict | None) -> str:
    if not info:
        return "another process"
    where = f"pid {info.get('pid')}"
    if info.get("host") and info.get("host") != socket.gethostname():
        where += f" on {info['host']}"
    what = f"`siamesenorm {info['command']}`" if info.get("command") else "a process"
    since = f", since {info['since']}" if info.get("since") else ""
    return f"{what} ({where}{since})"


class FolderLock:
    """The exclusive lock of one folder, taken by :meth:`acquire` and given back by :meth:`release`."""

    def __init__(self, folder: Path, command: str) -> None:
        self.folder, self.command = folder, command
        self.path = folder / LOCK_NAME
        self.fd: int | None = None
        self.depth = 0
        self.created_folder = False

    # ---- taking it -------------------------------------------------------------------------------
    def acquire(self) -> None:
        if not self.folder.exists():
            self.folder.mkdir(parents=True, exist_ok=True)
            self.created_folder = True
        try:
            if fcntl is not None and self._flock():
                return
            self._exclusive_create()
        except BaseException:
            self._forget_folder()
            raise

    def _refuse(self, info: dict | None) -> None:
        raise UserError(f"{self.folder} is in use by {_describe(info)}; wait for it to finish, "
                          "or choose another folder")

    def _flock(self) -> bool:
        """Take the lock with ``flock``; ``False`` where the filesystem does not support it."""
        while True:
            fd = _open_lock(self.path, os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as error:
                os.close(fd)
                if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    self._refuse(held_by(self.folder))
                if error.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    return False
                raise
            # The file we locked must still be the folder's lock file: a holder that released it
            # meanwhile removed it, and the next one creates a new file.
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                same = False
            if same:
                self.fd = fd
                self._write_info()
                return True
            os.close(fd)

    def _exclusive_create(self) -> None:
        """The lock without ``flock``: create the file exclusively; take over a dead holder's."""
        for _ in range(3):
            try:
                self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
            except FileExistsError:
                if self.path.is_symlink() or not self.path.is_file():
                    _not_a_lock(self.path)
                info = held_by(self.folder)
                pid = info.get("pid") if info else None
                if (isinstance(pid, int) and info.get("host") == socket.gethostname()
                        and not _alive(pid)) or (info is None and self._old(self.path)):
                    self.path.unlink(missing_ok=True)       # left by a dead process: take it
                    continue
                self._refuse(info)
            else:
                self._write_info()
                return
        self._refuse(held_by(self.folder))

    @staticmethod
    def _old(path: Path) -> bool:
        """An unreadable lock file older than a minute: a holder that died while writing it."""
        try:
            return time.time() - path.stat().st_mtime > 60
        except OSError:
            return True

    def _write_info(self) -> None:
        info = {"pid": os.getpid(), "host": socket.gethostname(), "command": self.command,
                "since": time.strftime("%Y-%m-%d %H:%M:%S")}
        data = (json.dumps(info) + "\n").encode()
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, data, 0)

    # ---- giving it back --------------------------------------------------------------------------
    def release(self) -> None:
        if self.fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        except OSError:
            pass
        os.close(self.fd)         # drops the flock
        self.fd = None
        self._forget_folder()

    def _forget_folder(self) -> None:
        """Remove the folder again when taking the lock created it and nothing else was written."""
        if self.created_folder:
            try:
                self.folder.rmdir()
            except OSError:
                pass


def check_free(folder: str | os.PathLike, command: str) -> None:
    """Refuse ``folder`` (one line naming the holder) when a live process holds its lock; take nothing."""
    key = _key(Path(folder))
    path = key / LOCK_NAME
    if key in _held or not path.exists():
        return
    if fcntl is not None:
        try:
            fd = _open_lock(path, os.O_RDWR)
        except OSError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                FolderLock(key, command)._refuse(held_by(key))
        finally:
            os.close(fd)      # drops the probe's lock, if it got it
        return
    info = held_by(key)
    pid = info.get("pid") if info else None
    if isinstance(pid, int) and (info.get("host") != socket.gethostname() or _alive(pid)):
        FolderLock(key, command)._refuse(info)


@contextmanager
def folder_lock(folder: str | os.PathLike, command: str) -> Iterator[FolderLock | None]:
    """Hold the exclusive lock of ``folder`` (created if missing) for the ``with`` block: a one-line
    :class:`UserError` naming the holder when another live process holds it. Nests within a process;
    a folder it created that holds only the lock is removed again."""
    key = _key(Path(folder))
    mine = _held.get(key)
    if mine is not None:
        mine.depth += 1
        try:
            yield mine
        finally:
            mine.depth -= 1
        return
    lock = FolderLock(key, command)
    lock.acquire()
    _held[key] = lock
    try:
        yield lock
    finally:
        del _held[key]
        lock.release()
