"""Train/validation token arrays: the source's own validation set, or the last fraction of the data."""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from .corpus import Corpus
from .tokenizers import Tokenizer

__all__ = ["split_tokens", "train_val_tokens"]


def split_tokens(tokens: np.ndarray, val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)``: the last ``round(len * val_fraction)`` tokens (at least one) are validation.

    Deterministic and contiguous (views, no copy), so validation text never leaks into training.
    """
    if not 0 < val_fraction < 1:
        raise ConfigError(f"val_fraction must be in (0, 1), got {val_fraction}")
    n = len(tokens)
    if n < 2:
        raise ConfigError(f"cannot split {n} token(s) into train and validation")
    n_val = min(max(1, round(n * val_fraction)), n - 1)
    return tokens[:n - n_val], tokens[n - n_val:]


def train_val_tokens(corpus: Corpus, tokenizer: Tokenizer | None = None,
                     val_fraction: float = 0.1) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)`` token arrays of ``corpus``.

    Text corpora are encoded with ``tokenizer``; token corpora need none. A corpus with its own
    validation data (arithmetic's held-out problems, a ``val=`` file) uses it and ignores
    ``val_fraction``; otherwise the last ``val_fraction`` of the tokens is validation.
    """
    if corpus.is_tokenized:
        train = corpus.tokens
        val = corpus.val_tokens
    else:
        if tokenizer is None:
            raise ConfigError(f"corpus {corpus.name} is text and needs a tokenizer")
        train = tokenizer.encode_array(corpus.text)
        val = tokenizer.encode_array(corpus.val_text) if corpus.val_text is not None else None
    if val is None:
        return split_tokens(train, val_fraction)
    if len(val) == 0:
        raise ConfigError(f"corpus {corpus.name}: its validation data is empty")
    return train, val
