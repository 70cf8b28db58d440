"""Errors a user can cause. The command line turns these into one line on stderr and exit status 2."""

from __future__ import annotations

import errno

# The longest message a UserError keeps: a line a person reads (the longest the library writes,
# an unknown key with the keys known beside it, is some 400 characters). A value given by mistake
# or on purpose can be megabytes: its message keeps its start (which key) and end (how to fix it).
MAX_MESSAGE_CHARS = 500


def one_line(message: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``message`` cut to at most ``limit`` characters: its start and end, the characters left out counted."""
    if len(message) <= limit:
        return message
    tail = limit // 4
    head = limit - tail - 48        # 48: room for the note, however many are left out
    left_out = len(message) - head - tail
    return f"{message[:head]} ...({left_out:,} characters left out)... {message[-tail:]}"


class UserError(ValueError):
    """Something the user gave that cannot be used (a bad value, a damaged checkpoint, a folder holding
    something else); its message is cut to :func:`one_line`."""

    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(one_line(message) if isinstance(message, str) else message, *args)


ConfigError = UserError     # its name before issue 35; kept for code that catches it


class RankFailed(RuntimeError):
    """One process of a run launched with ``--nproc`` crashed (not a user error); the command exits with 1."""


class Terminated(KeyboardInterrupt):
    """The process got SIGTERM: training stops as after Ctrl-C, and the command exits with 143."""


# Operating-system errors about the files and folders a command was given or writes (a read-only or
# full disk, a path it may not use, a name too long): the user's to fix, so one line and exit 2.
ENVIRONMENT_ERRNOS = {errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT,
                      errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR, errno.ENOENT, errno.EEXIST,
                      errno.EFBIG, errno.EIO, errno.EINVAL, errno.ELOOP, errno.EXDEV}


def environment_problem(err: OSError) -> str | None:
    """``err`` as one line (what the system said, and of which path) when it is one of
    :data:`ENVIRONMENT_ERRNOS`; else ``None``."""
    if err.errno not in ENVIRONMENT_ERRNOS:
        return None
    what = err.strerror or str(err)
    paths = [str(p) for p in (err.filename, err.filename2) if p is not None]
    return f"{what}: {' -> '.join(paths)}" if paths else what
