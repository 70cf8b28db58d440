"""Batches of next-token windows: a seeded, resumable random sampler and a fixed validation set."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ...errors import UserError

__all__ = ["BatchSampler", "validation_batches"]


def _as_array(tokens: np.ndarray | Tensor) -> np.ndarray:
    array = tokens.detach().cpu().numpy() if isinstance(tokens, Tensor) else np.asarray(tokens)
    if array.ndim != 1 or not np.issubdtype(array.dtype, np.integer):
        raise UserError(f"tokens must be a 1-D integer array, got shape {array.shape} of {array.dtype}")
    return array


def _check_sizes(batch_size: int, seq_len: int) -> None:
    if batch_size < 1 or seq_len < 1:
        raise UserError(f"batch_size and seq_len must be positive, got {batch_size} and {seq_len}")


def _windows(tokens: np.ndarray, offsets: np.ndarray, seq_len: int) -> tuple[Tensor, Tensor]:
    chunk = tokens[offsets[:, None] + np.arange(seq_len + 1)].astype(np.int64)
    chunk = torch.from_numpy(chunk)
    return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()


class BatchSampler:
    """Random windows drawn by the sampler's own generator seeded with ``seed``, so the data order depends
    only on seed and data; :meth:`load_state_dict` resumes exactly."""

    def __init__(self, tokens: np.ndarray | Tensor, batch_size: int, seq_len: int, seed: int = 0) -> None:
        _check_sizes(batch_size, seq_len)
        self.tokens = _as_array(tokens)
        if len(self.tokens) < seq_len + 1:
            raise UserError(f"training data has {len(self.tokens)} tokens; seq_len={seq_len} needs at "
                              f"least {seq_len + 1}; use a shorter seq_len or more data")
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.generator = torch.Generator().manual_seed(seed)
        self.batches_drawn = 0

    def next_batch(self) -> tuple[Tensor, Tensor]:
        """The next ``(x, y)``, int64 ``(batch_size, seq_len)``; ``y`` is ``x`` shifted by one token."""
        high = len(self.tokens) - self.seq_len
        offsets = torch.randint(0, high, (self.batch_size,), generator=self.generator).numpy()
        self.batches_drawn += 1
        return _windows(self.tokens, offsets, self.seq_len)

    def __iter__(self) -> BatchSampler:
        return self

    def __next__(self) -> tuple[Tensor, Tensor]:
        return self.next_batch()

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "batches_drawn": self.batches_drawn,
                "seed": self.seed, "batch_size": self.batch_size, "seq_len": self.seq_len,
                "n_tokens": len(self.tokens)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; refuses a state drawn for other data or another batch shape."""
        for key in ("batch_size", "seq_len", "n_tokens"):
            mine = len(self.tokens) if key == "n_tokens" else getattr(self, key)
            if key in state and int(state[key]) != mine:
                raise UserError(f"sampler state was saved with {key}={int(state[key])}, this run has "
                                  f"{mine}; resume with the same data, batch_size and seq_len")
        try:
            self.generator.set_state(state["generator"])
        except (KeyError, RuntimeError, TypeError) as exc:
            raise UserError(f"sampler state has no valid generator state: {exc}") from None
        self.batches_drawn = int(state.get("batches_drawn", 0))
        self.seed = int(state.get("seed", self.seed))


def validation_batches(tokens: np.ndarray | Tensor, batch_size: int, seq_len: int,
                       n_batches: int) -> list[tuple[Tensor, Tensor]]:
    """``n_batches`` batches of non-overlapping windows spread evenly over the data (as many as fit)."""
    _check_sizes(batch_size, seq_len)
    if n_batches < 1:
        raise UserError(f"n_batches must be positive, got {n_batches}")
    array = _as_array(tokens)
    available = (len(array) - 1) // seq_len
    if available < batch_size:
        raise UserError(f"validation data has {len(array)} tokens: fewer than batch_size={batch_size} "
                          f"windows of seq_len={seq_len}; it needs at least {batch_size * seq_len + 1}")
    n_batches = min(n_batches, available // batch_size)
    wanted = n_batches * batch_size
    offsets = (np.arange(wanted, dtype=np.int64) * available // wanted) * seq_len
    return [_windows(array, offsets[b * batch_size:(b + 1) * batch_size], seq_len)
            for b in range(n_batches)]
