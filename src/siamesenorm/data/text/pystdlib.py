"""The ``pystdlib`` corpus: the running interpreter's standard-library ``*.py`` source, without tests
and site-packages, in sorted path order; the fingerprint includes the Python version."""

from __future__ import annotations

import os
import platform
import sysconfig
from pathlib import Path

from ...errors import UserError
from .corpus import Corpus
from .textfiles import join_text_files, text_fingerprint

__all__ = ["EXCLUDED_DIRS", "load_pystdlib", "stdlib_files"]

DEFAULT_MAX_BYTES = 8_000_000

# A file is left out when any directory on its path (relative to the stdlib root) has one of these
# names: installed packages, the test suites (test/, tests/, idlelib/idle_test, lib2to3/tests, ...)
# and byte-code caches.
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test",
                           "__pycache__"})


def stdlib_files(root: str | Path | None = None) -> list[Path]:
    """The standard library's ``*.py`` files under ``root`` (the interpreter's), sorted."""
    root = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in EXCLUDED_DIRS]
        found += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def load_pystdlib(*, max_bytes: int = DEFAULT_MAX_BYTES) -> Corpus:
    """The first ``max_bytes`` UTF-8 bytes of the joined standard-library source."""
    root = Path(sysconfig.get_paths()["stdlib"])
    joined = join_text_files(stdlib_files(root), max_bytes)
    if not joined.text:
        raise UserError(f"pystdlib: no standard-library Python source under {root}; "
                          "this interpreter ships without it, so name a text corpus instead")
    fingerprint = text_fingerprint(joined.text, len(joined.used))
    fingerprint["python"] = platform.python_version()
    meta = {"root": str(root), "max_bytes": max_bytes, "truncated": joined.truncated,
            "skipped_files": len(joined.skipped), "fingerprint": fingerprint}
    return Corpus(name="pystdlib", text=joined.text, meta=meta)
