"""The :class:`Corpus` record every corpus loader returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import UserError

__all__ = ["Corpus"]


@dataclass
class Corpus:
    """Training data as text (to be tokenized) or as tokens (already tokenized), never both.

    Attributes:
        name: what was loaded (``pystdlib``, ``arithmetic``, ``hf:NAME``, or the path).
        text: the training text, for text corpora.
        tokens: the training tokens (1-D integer array, possibly a memmap), for token corpora.
        meta: the options used and a ``fingerprint`` that tells two corpora apart.
        val_text / val_tokens: a separate validation set where the source has one (arithmetic's
            held-out problems, a ``val=`` file, a dataset's ``val_split``); otherwise ``None`` and
            validation is cut off the end of the training data.
        heldout: arithmetic only: the held-out problems, for exact-match accuracy.
    """

    name: str
    text: str | None = None
    tokens: np.ndarray | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    val_text: str | None = None
    val_tokens: np.ndarray | None = None
    heldout: list[Any] = field(default_factory=list)   # held-out problems (arithmetic: ArithmeticProblem)

    def __post_init__(self) -> None:
        if (self.text is None) == (self.tokens is None):
            raise UserError(f"corpus {self.name!r} must hold either text or tokens, not "
                              f"{'both' if self.text is not None else 'neither'}")

    @property
    def is_tokenized(self) -> bool:
        """True when the corpus is already tokens (a ``.bin`` file): it takes no tokenizer."""
        return self.tokens is not None
