"""Token corpora from ``.bin`` files: nanoGPT's headerless uint16 arrays and modded-nanogpt shards (a
header of 256 ``int32``: magic 20240520, version 1, token count; then the ``uint16`` tokens), told
apart by the magic. The fingerprint hashes every token (docs/security.md)."""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import numpy as np

from ...errors import UserError
from .corpus import Corpus

__all__ = ["SHARD_MAGIC", "SHARD_VERSION", "load_token_files", "read_token_file", "tokens_sha256",
           "write_shard"]

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
_HEADER_INTS = 256
_HEADER_BYTES = _HEADER_INTS * 4


def _format(path: Path) -> str:
    with path.open("rb") as f:
        head = f.read(4)
    magic = int.from_bytes(head, "little", signed=True) if len(head) == 4 else None
    return "modded-nanogpt" if magic == SHARD_MAGIC else "nanogpt"


def _header_like(path: Path, size: int) -> np.ndarray | None:
    """The first three ``int32`` of a file without the magic whose first 1,024 bytes still look like a
    shard header (zeros after those three), else ``None``."""
    if size < _HEADER_BYTES:
        return None
    header = np.fromfile(path, dtype="<i4", count=_HEADER_INTS)
    return header[:3] if header[:3].any() and not header[3:].any() else None


def read_token_file(path: str | Path) -> tuple[np.ndarray, str]:
    """``(tokens, format)`` of one ``.bin`` file; tokens are a read-only ``uint16`` memmap. A headerless
    file that looks like a shard gets a warning on stderr."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"token file {path} is a folder, not a .bin file")
    if not path.is_file():
        raise UserError(f"token file {path} does not exist")
    size = path.stat().st_size
    fmt = _format(path)
    if fmt == "nanogpt":
        if size == 0:
            raise UserError(f"token file {path} is empty")
        if size % 2:
            raise UserError(f"token file {path} has an odd size ({size} bytes); a headerless .bin "
                              "must hold whole uint16 tokens")
        header = _header_like(path, size)
        if header is not None:
            print(f"warning: token file {path} lacks the shard magic {SHARD_MAGIC} but its first "
                  f"{_HEADER_BYTES} bytes look like a shard header ({', '.join(map(str, header.tolist()))}, "
                  "then zeros); reading it as headerless uint16 tokens, those bytes included (a "
                  "damaged shard? write it again)", file=sys.stderr, flush=True)
        return np.memmap(path, dtype="<u2", mode="r"), fmt
    if size < _HEADER_BYTES:
        raise UserError(f"token file {path} starts with the shard magic {SHARD_MAGIC} but is shorter "
                          f"than its {_HEADER_BYTES}-byte header ({size} bytes)")
    header = np.fromfile(path, dtype="<i4", count=_HEADER_INTS)
    version, count = int(header[1]), int(header[2])
    if version != SHARD_VERSION:
        raise UserError(f"token file {path} is a modded-nanogpt shard of version {version}; only "
                          f"version {SHARD_VERSION} is supported")
    if count < 0 or size != _HEADER_BYTES + 2 * count:
        raise UserError(f"token file {path}: header says {count} tokens but the file holds "
                          f"{(size - _HEADER_BYTES) / 2:g} ({size} bytes)")
    if count == 0:
        return np.zeros(0, dtype="<u2"), fmt
    return np.memmap(path, dtype="<u2", mode="r", offset=_HEADER_BYTES, shape=(count,)), fmt


def write_shard(path: str | Path, tokens: np.ndarray) -> None:
    """Write ``tokens`` (all below 65536) as a modded-nanogpt shard (header + ``uint16``)."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 1 << 16):
        raise UserError("a shard holds uint16 tokens: every token must be in 0..65535")
    header = np.zeros(_HEADER_INTS, dtype="<i4")
    header[:3] = (SHARD_MAGIC, SHARD_VERSION, tokens.size)
    with Path(path).open("wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype("<u2").tobytes())


def tokens_sha256(tokens: np.ndarray) -> str:
    """SHA-256 of ``tokens`` as little-endian ``uint16``, in 32 MiB pieces (a memmap is not copied whole)."""
    digest = hashlib.sha256()
    step = 1 << 24
    for start in range(0, tokens.size, step):
        digest.update(memoryview(np.ascontiguousarray(tokens[start:start + step], dtype="<u2")))
    return digest.hexdigest()


def _read_many(paths: list[Path]) -> tuple[np.ndarray, list[str]]:
    arrays, formats = zip(*(read_token_file(p) for p in paths))
    tokens = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
    return tokens, list(formats)


def load_token_files(paths: list[Path], *, name: str | None = None,
                     val: list[Path] | None = None) -> Corpus:
    """Tokens of ``paths`` (taken in the order given) as a token corpus; ``val``: validation files."""
    if not paths:
        raise UserError(f"no .bin token files in {name}")
    tokens, formats = _read_many(paths)
    if tokens.size == 0:
        raise UserError(f"token files {name or paths[0]} hold no tokens")
    val_tokens = _read_many(val)[0] if val else None
    fingerprint = {"files": len(paths), "tokens": int(tokens.size), "sha256": tokens_sha256(tokens)}
    if val_tokens is not None:
        fingerprint["val_sha256"] = tokens_sha256(val_tokens)
    meta = {"files": [str(p) for p in paths], "formats": sorted(set(formats)),
            "max_token": int(tokens.max()), "fingerprint": fingerprint}
    return Corpus(name=name or str(paths[0]), tokens=tokens, meta=meta, val_tokens=val_tokens)
