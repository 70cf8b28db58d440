"""torch.distributed.checkpoint on first use: our classes over its own, and reading without running code."""

from __future__ import annotations

import functools
import io
import os
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...errors import UserError
from .safe import UnsafeCheckpoint, load_weights_only, problem, read_dcp_metadata

if TYPE_CHECKING:
    from torch.distributed.checkpoint import metadata as dcp_metadata

# torch.distributed.checkpoint (DCP) and torch.distributed.tensor are imported where they are used:
# together they take about 0.6 s to import, which a command that never touches a sharded checkpoint
# (generate, export, a refused configuration) would otherwise pay at start.


@functools.cache
def _on_dcp(own: type, base: str) -> type:
    """The class ``own`` over DCP's class ``base`` (``own``'s methods first), made on first use."""
    from torch.distributed import checkpoint as dcp

    return type(own.__name__, (own, getattr(dcp, base)), {"__module__": own.__module__,
                                                          "__doc__": own.__doc__})


class _VerifiedReader:              # over DCP's FileSystemReader, by _on_dcp
    """torch's reader of a checkpoint folder, given the metadata :func:`read_dcp_metadata` read."""

    def __init__(self, folder: Path, metadata: dcp_metadata.Metadata) -> None:
        super().__init__(str(folder))
        self.verified = metadata

    def read_metadata(self, *args, **kwargs) -> dcp_metadata.Metadata:
        if kwargs.get("rank") is not None:      # the per-rank fallback: we never wrote such files
            raise FileNotFoundError("no per-rank metadata")
        metadata = self.verified
        if getattr(metadata, "storage_meta", None) is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = getattr(self, "load_id", None)
        return metadata


class _PlainValuesPlanner:          # over DCP's DefaultLoadPlanner, by _on_dcp
    """torch's load planner, but a non-tensor value is read with ``torch.load(weights_only=True)``; one that
    names anything else is refused (:class:`UnsafeCheckpoint`)."""

    def __init__(self, reader: _VerifiedReader) -> None:
        super().__init__()
        self.reader = reader

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        info = self.reader.verified.storage_data.get(read_item.storage_index)
        where = Path(self.reader.path) / getattr(info, "relative_path", "?")
        obj = load_weights_only(value, where)
        plain = io.BytesIO()        # handed on as torch's planner takes it: as bytes it unpickles
        torch.save(obj, plain)
        plain.seek(0)
        super().load_bytes(read_item, plain)


def read_dcp(folder: str | os.PathLike, state: dict) -> None:
    """``dcp.load(state)`` from ``folder`` without running code; damaged: :class:`UserError`, altered:
    :class:`UnsafeCheckpoint`, one line on every rank alike. A collective under a process group."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    folder = Path(folder)
    metadata = read_dcp_metadata(folder)
    reader = _on_dcp(_VerifiedReader, "FileSystemReader")(folder, metadata)
    try:
        with warnings.catch_warnings():     # a single process reading a sharded checkpoint is meant
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, storage_reader=reader,
                     planner=_on_dcp(_PlainValuesPlanner, "DefaultLoadPlanner")(reader))
    except (Exception, CheckpointException) as error:
        cause = _first_failure(error)
        if isinstance(cause, UserError):
            raise type(cause)(str(cause)) from None
        raise UserError(f"cannot read checkpoint {folder}: {problem(cause)}") from None


def _first_failure(error: BaseException) -> BaseException:
    """The exception behind a ``CheckpointException``: any rank's refusal of an altered file, else
    the lowest rank's failure; ``error`` itself when it is none."""
    failures = getattr(error, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return error
    found = [f[0] if isinstance(f, tuple) else f for _, f in sorted(failures.items())]
    return next((f for f in found if isinstance(f, UnsafeCheckpoint)), found[0])
