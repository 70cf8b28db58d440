"""The entry's token files, checked before OLMo-core reads them."""

from __future__ import annotations

import os

import numpy as np

from ..data.text.tokenfiles import SHARD_MAGIC
from ..errors import UserError

__all__ = ["check_token_files"]

_NPY_MAGIC = b"\x93NUMPY"
_CHUNK = 1 << 24        # tokens scanned at once


def check_token_files(paths: list[str], dtype: str, vocab: int, seq_len: int, global_batch: int) -> None:
    """Refuse (one line) token files OLMo-core would misread or fail on: a header, partial tokens, ids
    beyond the vocabulary, less than one global batch of whole sequences."""
    kind = np.dtype(dtype)
    sequences = 0
    for path in paths:
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as f:
                head = f.read(8)
        except OSError as error:
            raise UserError(f"cannot read --data {path}: {error.strerror or error}") from None
        if size == 0:
            raise UserError(f"--data {path} is empty")
        if head.startswith(_NPY_MAGIC):
            raise UserError(f"--data {path} is a NumPy .npy file with a header, which OLMo-core would read "
                            "as tokens; it reads raw ids: write them with np.load(PATH).tofile(NEW)")
        if int.from_bytes(head[:4], "little") == SHARD_MAGIC:
            raise UserError(f"--data {path} starts with a modded-nanogpt shard header, which OLMo-core "
                            "would read as tokens; write the ids alone (ids.tofile(NEW))")
        if size % kind.itemsize:
            raise UserError(f"--data {path} has {size} bytes, not whole {dtype} tokens of {kind.itemsize} "
                            "bytes: is --data-dtype right?")
        _check_ids(path, np.memmap(path, dtype=kind, mode="r"), dtype, vocab)
        sequences += size // (kind.itemsize * seq_len)
    if sequences < global_batch:
        raise UserError(f"--data holds {sequences} whole sequences of {seq_len} tokens (a file's tail "
                        f"shorter than one is dropped), fewer than one step's {global_batch}: give more "
                        "data, or a smaller --global-batch")


def _check_ids(path: str, tokens: np.ndarray, dtype: str, vocab: int) -> None:
    for start in range(0, len(tokens), _CHUNK):
        chunk = tokens[start:start + _CHUNK]
        top = int(chunk.max())
        if top >= vocab:
            where = start + int(np.argmax(chunk >= vocab))
            hint = f"; is it uint16 data read as {dtype}? set --data-dtype" if chunk.itemsize > 2 else ""
            raise UserError(f"--data {path} holds token id {int(tokens[where])} (token {where:,}), beyond "
                            f"the model's vocabulary of {vocab}: give data tokenized for it{hint}")
