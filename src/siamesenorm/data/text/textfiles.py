"""Text corpora from files: the UTF-8 text files among those named, joined in order with
:data:`SEPARATOR` up to ``max_bytes``, reading little more of a file than is used."""

from __future__ import annotations

import codecs
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import UserError
from .corpus import Corpus

__all__ = ["SEPARATOR", "JoinedText", "folder_files", "join_text_files", "load_text_files",
           "text_fingerprint"]

SEPARATOR = "\n\n"
# How much of a file at least is read to tell text from binary, when only a little of it is used.
SNIFF_BYTES = 8192


@dataclass
class JoinedText:
    text: str
    used: list[Path] = field(default_factory=list)
    skipped: list[Path] = field(default_factory=list)
    truncated: bool = False


def read_utf8(path: Path, limit: int | None = None) -> tuple[str | None, bool]:
    """``(text, more)``: the file's text, or ``None`` when it is not UTF-8 text (bad encoding, NUL bytes).
    With ``limit``, its first ``limit`` bytes (whole characters) and whether the file goes on; at most
    ``max(limit, SNIFF_BYTES)`` bytes are read."""
    window = None if limit is None else max(limit, SNIFF_BYTES)
    with path.open("rb") as f:
        data = f.read() if window is None else f.read(window + 1)
    whole = window is None or len(data) <= window
    try:  # a character cut at the end of the window is dropped, not an error
        text = codecs.getincrementaldecoder("utf-8")().decode(data[:window], final=whole)
    except UnicodeDecodeError:
        return None, False
    if "\x00" in text:
        return None, False
    if limit is None or len(data) <= max(limit, 0):
        return text, False
    return text.encode("utf-8")[:max(limit, 0)].decode("utf-8", errors="ignore"), True


def join_text_files(paths: list[Path], max_bytes: int | None = None) -> JoinedText:
    """The UTF-8 files among ``paths`` joined in order, up to ``max_bytes`` bytes."""
    if max_bytes is not None and max_bytes <= 0:
        raise UserError(f"max_bytes must be positive, got {max_bytes}")
    out = JoinedText("")
    pieces: list[bytes] = []
    size = 0
    for path in paths:
        separator = (SEPARATOR if pieces else "").encode("utf-8")
        text, more = read_utf8(path, None if max_bytes is None else max_bytes - size - len(separator))
        if text is None:
            out.skipped.append(path)
            continue
        out.truncated = more
        data = separator + text.encode("utf-8")
        if text and data.strip():
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


def visible_files(root: Path) -> Iterator[Path]:
    """The files under ``root`` (links to files too, not to folders), in no order, never entering a
    hidden folder (``.venv``, ``.git``: a hidden file or folder is skipped, so is what it holds)."""
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if not d.startswith(".")]
        yield from (Path(folder, name) for name in names if not name.startswith("."))


def folder_files(root: Path) -> list[Path]:
    """Every regular file under ``root``, recursively, sorted by relative path; hidden ones skipped."""
    files = [p for p in visible_files(root) if p.is_file()]
    return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _joined_or_refused(files: list[Path], name: str, max_bytes: int | None) -> JoinedText:
    joined = join_text_files(files, max_bytes)
    if not joined.text.strip():
        if len(files) == 1:
            problem = "is not UTF-8 text" if joined.skipped else "is empty"
            raise UserError(f"corpus file {files[0]} {problem}")
        raise UserError(f"corpus {name} has no readable text: {len(files)} files, "
                          f"{len(joined.skipped)} not UTF-8 text, the rest empty")
    return joined


def load_text_files(files: list[Path], name: str, *, max_bytes: int | None = None,
                    val_files: list[Path] | None = None) -> Corpus:
    """The UTF-8 text of ``files`` (in order) as a text corpus; ``val_files`` give validation text."""
    if not files:
        raise UserError(f"corpus {name} holds no files")
    joined = _joined_or_refused(files, name, max_bytes)
    val_text = _joined_or_refused(val_files, "val", None).text if val_files else None
    meta = {"files": len(files), "max_bytes": max_bytes, "skipped_files": len(joined.skipped),
            "truncated": joined.truncated, "fingerprint": text_fingerprint(joined.text, len(joined.used))}
    return Corpus(name=name, text=joined.text, meta=meta, val_text=val_text)
