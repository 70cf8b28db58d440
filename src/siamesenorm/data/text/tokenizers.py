"""Tokenizers: bytes (the default) and a byte-level BPE trained locally, behind one interface. A saved
tokenizer is ``tokenizer_kind.json`` (kind, vocab size) plus, for BPE, ``bpe.json``."""

from __future__ import annotations

import importlib
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ...errors import UserError
from ...rundir import replacing, write_text

__all__ = ["BPETokenizer", "ByteTokenizer", "Tokenizer", "import_tokenizers", "load_tokenizer"]

DESCRIPTOR = "tokenizer_kind.json"
_BPE_FILE = "bpe.json"


def _as_int_list(ids: Iterable[int] | Any) -> list[int]:
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(i) for i in ids]


class Tokenizer(ABC):
    """Text <-> token ids. Subclasses set ``kind`` (the name saved in the descriptor)."""

    kind: ClassVar[str]

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Number of distinct ids; every id ``encode`` returns is below it."""

    @abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``."""

    @abstractmethod
    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; ids that do not form valid text decode to U+FFFD."""

    def encode_array(self, text: str) -> np.ndarray:
        """``encode(text)`` as a 1-D integer array (a faster path where a subclass has one)."""
        return np.asarray(self.encode(text), dtype=np.int64)

    def save(self, directory: str | Path) -> Path:
        """Write the tokenizer into ``directory`` (created if needed); returns the directory."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._save_files(directory)
        descriptor = {"kind": self.kind, "vocab_size": self.vocab_size}
        # the descriptor last and atomically: a directory without it holds no (complete) tokenizer
        write_text(directory / DESCRIPTOR, json.dumps(descriptor, indent=2) + "\n")
        return directory

    def _save_files(self, directory: Path) -> None:  # noqa: B027 (optional hook, not abstract)
        """Write what the kind needs besides the descriptor (nothing by default)."""

    @classmethod
    @abstractmethod
    def _load(cls, directory: Path, descriptor: dict) -> Tokenizer:
        """Rebuild from a directory written by :meth:`save`."""


class ByteTokenizer(Tokenizer):
    """UTF-8 bytes as tokens: 256 ids, no training, every text round-trips exactly."""

    kind = "bytes"

    @property
    def vocab_size(self) -> int:
        return 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)

    def decode(self, ids: Iterable[int]) -> str:
        """Bytes decoded with ``errors="replace"``; an id outside 0..255 also becomes U+FFFD."""
        ids = _as_int_list(ids)
        if all(0 <= i < 256 for i in ids):
            return bytes(ids).decode("utf-8", errors="replace")
        pieces, run = [], []
        for i in ids:
            if 0 <= i < 256:
                run.append(i)
            else:
                pieces += [bytes(run).decode("utf-8", errors="replace"), "\ufffd"]
                run = []
        pieces.append(bytes(run).decode("utf-8", errors="replace"))
        return "".join(pieces)

    @classmethod
    def _load(cls, directory: Path, descriptor: dict) -> ByteTokenizer:
        return cls()


def import_tokenizers():
    """The ``tokenizers`` package, or a UserError that says how to install it."""
    try:
        return importlib.import_module("tokenizers")
    except ImportError:
        raise UserError("the BPE tokenizer needs the tokenizers package: pip install tokenizers "
                          "(or pip install 'siamesenorm[bpe]')") from None


# A cut between "\n" and a printable ASCII character, with a printable ASCII character before the
# "\n", falls on a boundary of the byte-level pre-tokenizer's GPT-2 pattern (the "\n" is a
# whitespace token of its own either way), so encoding the pieces separately gives the same ids as
# encoding the whole text.
_SAFE_CUT = re.compile(r"(?<=[!-~]\n)(?=[!-~])")
_PIECE_CHARS = 1 << 16


def _pieces(text: str, size: int | None = None) -> Iterator[str]:
    """``text`` in pieces of at least ``size`` characters, cut only where encoding is unaffected."""
    size = size or _PIECE_CHARS
    start = 0
    while start < len(text):
        cut = _SAFE_CUT.search(text, start + size) if start + size < len(text) else None
        end = cut.start() if cut else len(text)
        yield text[start:end]
        start = end


class BPETokenizer(Tokenizer):
    """Byte-level BPE (GPT-2 style) from the ``tokenizers`` package, trained on local text: any text
    round-trips, and merges stop at ``vocab_size`` ids or when repeated pairs run out."""

    kind = "bpe"

    def __init__(self, backend: Any) -> None:
        """Wrap a trained ``tokenizers.Tokenizer``; use :meth:`train` to make one."""
        self._backend = backend

    @classmethod
    def train(cls, text: str, vocab_size: int = 1024, min_frequency: int = 2) -> BPETokenizer:
        """Learn merges on ``text`` up to ``vocab_size`` ids (at least 256: the bytes)."""
        tk = import_tokenizers()
        if vocab_size < 256:
            raise UserError(f"BPE vocab_size must be at least 256 (the byte alphabet), got {vocab_size}")
        if not text:
            raise UserError("cannot train a BPE tokenizer on empty text")
        backend = tk.Tokenizer(tk.models.BPE())
        backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = tk.decoders.ByteLevel()
        trainer = tk.trainers.BpeTrainer(
            vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
            initial_alphabet=tk.pre_tokenizers.ByteLevel.alphabet(), special_tokens=[])
        backend.train_from_iterator(_pieces(text), trainer=trainer)
        return cls(backend)

    @property
    def vocab_size(self) -> int:
        return int(self._backend.get_vocab_size())

    def encode(self, text: str) -> list[int]:
        return list(self._backend.encode(text).ids)

    def encode_array(self, text: str) -> np.ndarray:
        """``encode(text)`` as an array, encoding pieces of a long text in parallel."""
        pieces = self._backend.encode_batch(list(_pieces(text)))
        return np.fromiter((i for piece in pieces for i in piece.ids), dtype=np.int64)

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; ids outside the vocabulary are dropped."""
        n = self.vocab_size
        return self._backend.decode([i for i in _as_int_list(ids) if 0 <= i < n])

    def _save_files(self, directory: Path) -> None:
        with replacing(directory / _BPE_FILE) as tmp:       # never through a planted link
            self._backend.save(str(tmp))

    @classmethod
    def _load(cls, directory: Path, descriptor: dict) -> BPETokenizer:
        tk = import_tokenizers()
        path = directory / _BPE_FILE
        if not path.is_file():
            raise UserError(f"tokenizer in {directory} is BPE but {_BPE_FILE} is missing")
        try:
            return cls(tk.Tokenizer.from_file(str(path)))
        except Exception as exc:  # the backend raises its own exception types
            raise UserError(f"cannot read BPE tokenizer {path}: {exc}") from None


_KINDS: dict[str, type[Tokenizer]] = {cls.kind: cls for cls in (ByteTokenizer, BPETokenizer)}


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """The tokenizer :meth:`Tokenizer.save` wrote into ``directory``, whatever its kind."""
    directory = Path(directory)
    path = directory / DESCRIPTOR
    try:
        descriptor = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"no saved tokenizer in {directory}: {DESCRIPTOR} is missing") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read tokenizer descriptor {path}: {exc}") from None
    kind = descriptor.get("kind") if isinstance(descriptor, dict) else None
    if kind not in _KINDS:
        raise UserError(f"{path}: unknown tokenizer kind {kind!r}; known kinds: {', '.join(_KINDS)}")
    tokenizer = _KINDS[kind]._load(directory, descriptor)
    saved = descriptor.get("vocab_size")
    if saved is not None and saved != tokenizer.vocab_size:
        raise UserError(f"{path} says vocab_size={saved} but the saved {kind} tokenizer has "
                          f"{tokenizer.vocab_size}")
    return tokenizer
