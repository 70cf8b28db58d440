"""Train/validation splits: the source's own validation set, or the last fraction of the data. A text
corpus is split as text, before any tokenizer sees it, so BPE trains on the training part only."""

from __future__ import annotations

import numpy as np

from ...errors import UserError
from .corpus import Corpus
from .tokenizers import Tokenizer

__all__ = ["split_text", "split_tokens", "train_text", "train_val_tokens"]


def split_tokens(tokens: np.ndarray, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)`` views: the last ``round(len * val_fraction)`` tokens (at least one) are validation."""
    n = len(tokens)
    n_val = _val_count(n, val_fraction, "token(s)")
    return tokens[:n - n_val], tokens[n - n_val:]


def _val_count(n: int, val_fraction: float, what: str) -> int:
    if not 0 < val_fraction < 1:
        raise UserError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if n < 2:
        raise UserError(f"cannot split {n} {what} into train and validation")
    return min(max(1, round(n * val_fraction)), n - 1)


def split_text(text: str, val_fraction: float = 0.1) -> tuple[str, str]:
    """``(train, val)`` text: the last ``val_fraction`` of the UTF-8 bytes, cut at a character boundary."""
    data = text.encode("utf-8")
    cut = len(data) - _val_count(len(data), val_fraction, "byte(s) of text")
    while cut > 0 and data[cut] & 0xC0 == 0x80:  # a UTF-8 continuation byte: inside a character
        cut -= 1
    if cut == 0:
        raise UserError(f"cannot split {len(text)} character(s) of text into train and validation")
    return data[:cut].decode("utf-8"), data[cut:].decode("utf-8")


def train_text(corpus: Corpus, val_fraction: float = 0.1) -> str:
    """The training text of a text corpus: all of ``corpus.text`` when it has its own validation
    text, else the part :func:`split_text` keeps for training (what a tokenizer may learn from)."""
    if corpus.is_tokenized:
        raise UserError(f"corpus {corpus.name} is already tokens (.bin); it has no text")
    return corpus.text if corpus.val_text is not None else split_text(corpus.text, val_fraction)[0]


def train_val_tokens(corpus: Corpus, tokenizer: Tokenizer | None = None,
                     val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)`` token arrays of ``corpus`` (text encoded with ``tokenizer``): its own validation
    data when it has some, else the last ``val_fraction`` of its text or tokens."""
    if corpus.is_tokenized:
        train = corpus.tokens
        val = corpus.val_tokens
        if val is None:
            return split_tokens(train, val_fraction)
    else:
        if tokenizer is None:
            raise UserError(f"corpus {corpus.name} is text and needs a tokenizer")
        texts = (corpus.text, corpus.val_text) if corpus.val_text is not None else \
            split_text(corpus.text, val_fraction)
        train, val = (tokenizer.encode_array(t) for t in texts)
        if len(train) == 0:
            raise UserError(f"corpus {corpus.name}: its training text encodes to no tokens")
    if len(val) == 0:
        raise UserError(f"corpus {corpus.name}: its validation data is empty")
    return train, val
