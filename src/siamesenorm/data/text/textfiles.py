"""Text corpora from files: the UTF-8 text files among those named, joined in order.

The shared reader :func:`join_text_files` takes files in the order given, skips those that are not
UTF-8 text (invalid UTF-8 or containing NUL bytes), joins the rest with :data:`SEPARATOR`, and
stops at ``max_bytes`` (UTF-8 bytes of the result), cutting the last file at a character boundary.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import ConfigError
from .corpus import Corpus

__all__ = ["SEPARATOR", "JoinedText", "folder_files", "join_text_files", "load_text_files",
           "text_fingerprint"]

SEPARATOR = "\n\n"


@dataclass
class JoinedText:
    """The result of :func:`join_text_files`: the text, the files used, the files skipped."""

    text: str
    used: list[Path] = field(default_factory=list)
    skipped: list[Path] = field(default_factory=list)
    truncated: bool = False


def read_utf8(path: Path) -> str | None:
    """The file's text, or ``None`` when it is not UTF-8 text (bad encoding or NUL bytes)."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return None
    return None if "\x00" in text else text


def join_text_files(paths: list[Path], max_bytes: int | None = None) -> JoinedText:
    """Concatenate the UTF-8 files among ``paths`` (in order) up to ``max_bytes`` bytes."""
    if max_bytes is not None and max_bytes <= 0:
        raise ConfigError(f"max_bytes must be positive, got {max_bytes}")
    out = JoinedText("")
    pieces: list[bytes] = []
    size = 0
    for path in paths:
        text = read_utf8(path)
        if text is None:
            out.skipped.append(path)
            continue
        if not text:
            continue
        data = (SEPARATOR if pieces else "").encode("utf-8") + text.encode("utf-8")
        if max_bytes is not None and size + len(data) > max_bytes:
            # Cut at a character boundary: drop the bytes of a partial last character.
            data = data[:max_bytes - size].decode("utf-8", errors="ignore").encode("utf-8")
            out.truncated = True
        if data.strip():
            pieces.append(data)
            out.used.append(path)
            size += len(data)
        if out.truncated:
            break
    out.text = b"".join(pieces).decode("utf-8")
    return out


def text_fingerprint(text: str, n_files: int) -> dict:
    """``{"files", "bytes", "sha256"}`` of a text corpus: equal fingerprints, equal text."""
    data = text.encode("utf-8")
    return {"files": n_files, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def folder_files(root: Path) -> list[Path]:
    """Every regular file under ``root``, recursively, sorted by relative path; hidden ones skipped."""
    files = [p for p in root.rglob("*")
             if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _joined_or_refused(files: list[Path], name: str, max_bytes: int | None) -> JoinedText:
    joined = join_text_files(files, max_bytes)
    if not joined.text.strip():
        if len(files) == 1:
            problem = "is not UTF-8 text" if joined.skipped else "is empty"
            raise ConfigError(f"corpus file {files[0]} {problem}")
        raise ConfigError(f"corpus {name} has no readable text: {len(files)} files, "
                          f"{len(joined.skipped)} not UTF-8 text, the rest empty")
    return joined


def load_text_files(files: list[Path], name: str, *, max_bytes: int | None = None,
                    val_files: list[Path] | None = None) -> Corpus:
    """The UTF-8 text of ``files`` (in order) as a text corpus; ``val_files`` give validation text."""
    if not files:
        raise ConfigError(f"corpus {name} holds no files")
    joined = _joined_or_refused(files, name, max_bytes)
    val_text = _joined_or_refused(val_files, "val", None).text if val_files else None
    meta = {"files": len(files), "max_bytes": max_bytes, "skipped_files": len(joined.skipped),
            "truncated": joined.truncated, "fingerprint": text_fingerprint(joined.text, len(joined.used))}
    return Corpus(name=name, text=joined.text, meta=meta, val_text=val_text)
