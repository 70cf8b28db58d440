"""The :class:`Corpus` record every corpus loader returns."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ...errors import UserError

__all__ = ["Corpus"]


@dataclass
class Corpus:
    """Training data as ``text`` or as ``tokens`` (1-D integers, possibly a memmap), never both.
    ``val_text`` / ``val_tokens``: the source's own validation data, else ``None`` (validation is then
    cut off the end); ``meta`` holds the options and a ``fingerprint``."""

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
        return self.tokens is not None
