"""Loading never runs code: weights-only refusals named, DCP metadata read through an allow-list."""

from __future__ import annotations

import collections
import functools
import os
import pathlib
import pickle
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from ...errors import UserError

if TYPE_CHECKING:
    from torch.distributed.checkpoint import metadata as dcp_metadata


_WEIGHTS_ONLY_REASON = "WeightsUnpickler error:"


def problem(error: BaseException) -> str:
    """``error`` in one line of at most 200 characters (for torch's weights-only refusal, its reason)."""
    whole = str(error)
    text = whole.strip().splitlines()
    line = text[0] if text else type(error).__name__
    if isinstance(error, pickle.UnpicklingError) and _WEIGHTS_ONLY_REASON in whole:
        reason = whole.split(_WEIGHTS_ONLY_REASON, 1)[1].split("Check the documentation", 1)[0]
        reason = " ".join(reason.split()) or "refused by torch.load(weights_only=True)"
        line = f"not a file of tensors and plain values that torch.save wrote ({reason})"
    return line if len(line) <= 200 else line[:197] + "..."


def load_weights_only(source, where: Path | str):
    """``torch.load(source, weights_only=True)`` on the CPU: a file naming a Python object is an
    :class:`UnsafeCheckpoint`, any other failure a one-line :class:`UserError` naming ``where``."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Detected pickle protocol", UserWarning)
            return torch.load(source, map_location="cpu", weights_only=True)
    except Exception as error:
        _refuse_unsafe(error, where)
        raise UserError(f"cannot read checkpoint {where}: {problem(error)}") from None


class UnsafeCheckpoint(UserError):
    """A checkpoint file that names a Python object a checkpoint never holds (a function or class to
    call while unpickling): altered, possibly to run code. Refused unread, never fallen back from."""


def _unsafe(file: Path | str, what: str) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(f"refusing checkpoint file {file}: it names {what}, which a checkpoint "
                            "never holds (the file was altered, possibly to run code when loaded); "
                            "restore it from a copy you trust")


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)|unsupported class ([\w.]+)|reduce for unrecognized function "
                     r"\W*([\w.]+)", re.IGNORECASE)


def _refuse_unsafe(error: BaseException, file: Path | str) -> None:
    """Raise :class:`UnsafeCheckpoint` when ``error`` is a weights-only refusal of a global in ``file``."""
    if isinstance(error, pickle.UnpicklingError):
        found = _GLOBAL.search(str(error))
        if found is not None:
            raise _unsafe(file, next(g for g in found.groups() if g)) from None


def _plain_tensor_types() -> dict[str, object]:
    """``torch.<name>`` of every dtype and layout (metadata names them by attribute)."""
    return {name: value for name, value in vars(torch).items()
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format))}


# What the metadata of a torch.distributed.checkpoint may name: its own dataclasses, torch.Size,
# dtypes and layouts, the path it was saved to, and the storage record of torch's writer or of
# OLMo-core's (relative_path, offset, length: read as torch's, which has the same fields).
_DCP_METADATA = "torch.distributed.checkpoint.metadata"


@functools.cache
def _dcp_globals() -> dict[tuple[str, str], object]:
    """The allow-list above, ``(module, name) -> object``, built on first use (DCP is imported late)."""
    from torch.distributed.checkpoint import metadata as dcp_metadata
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    return {
        **{(_DCP_METADATA, name): getattr(dcp_metadata, name)
           for name in ("Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
                        "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING")
           if hasattr(dcp_metadata, name)},
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
        ("olmo_core.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        ("collections", "OrderedDict"): collections.OrderedDict,
        **{("pathlib", name): pathlib.PurePosixPath for name in ("PosixPath", "PurePosixPath", "Path")},
        **{("pathlib", name): pathlib.PureWindowsPath for name in ("WindowsPath", "PureWindowsPath")},
    }


class _MetadataUnpickler(pickle.Unpickler):
    """An unpickler resolving only :func:`_dcp_globals` and torch's dtypes and layouts, by name."""

    def __init__(self, stream, file: Path) -> None:
        super().__init__(stream)
        self.file = file

    def find_class(self, module: str, name: str):
        found = _dcp_globals().get((module, name))
        if found is None and module == "torch":
            found = _plain_tensor_types().get(name)
        if found is None:
            raise _unsafe(self.file, f"{module}.{name}")
        return found

    def persistent_load(self, pid):
        raise _unsafe(self.file, f"a persistent object ({str(pid)[:40]!r})")


def read_dcp_metadata(path: str | os.PathLike) -> dcp_metadata.Metadata:
    """The metadata of the DCP folder ``path`` (or its ``.metadata``), read without running code: only its
    classes, ``torch.Size``, dtypes and layouts may be named, and its data files must lie in the folder."""
    file = Path(path)
    if file.is_dir():
        file = file / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f, file).load()
    except UnsafeCheckpoint:
        raise
    except OSError as error:
        raise UserError(f"cannot read checkpoint {file}: {error.strerror or error}") from None
    except Exception as error:      # cut short, flipped bytes: whatever the unpickler says
        raise UserError(f"cannot read checkpoint {file}: {problem(error) or 'damaged'}") from None
    reason = _metadata_problem(metadata)
    if reason is not None:
        raise UserError(f"cannot read checkpoint {file}: not torch.distributed.checkpoint metadata "
                          f"({reason}); the file is damaged")
    return metadata


def _metadata_problem(md) -> str | None:
    """What makes ``md`` other than the metadata of a checkpoint of plain files (``None``: nothing)."""
    from torch.distributed.checkpoint import metadata as m
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    if not isinstance(md, m.Metadata):
        return f"a {type(md).__name__}"
    entries = getattr(md, "state_dict_metadata", None)
    if not isinstance(entries, dict):
        return "no state_dict_metadata"
    for key, entry in entries.items():
        if not isinstance(key, str):
            return f"a key {key!r}"
        if isinstance(entry, m.TensorStorageMetadata):
            props, size, chunks = (getattr(entry, k, None) for k in ("properties", "size", "chunks"))
            if not isinstance(props, m.TensorProperties) or not isinstance(getattr(props, "dtype", None),
                                                                           torch.dtype):
                return f"{key}: no dtype"
            if not isinstance(size, torch.Size) or not isinstance(chunks, list) or any(d < 0 for d in size) \
                    or not all(_chunk_fits(c, len(size)) for c in chunks):
                return f"{key}: a malformed tensor entry"
        elif not isinstance(entry, m.BytesStorageMetadata):
            return f"{key}: a {type(entry).__name__}"
    storage = getattr(md, "storage_data", None)
    if not isinstance(storage, dict):
        return "no storage_data"
    for index, info in storage.items():
        if not isinstance(index, m.MetadataIndex) or not isinstance(info, _StorageInfo):
            return f"a storage entry {type(index).__name__} -> {type(info).__name__}"
        rel = getattr(info, "relative_path", None)
        if not isinstance(rel, str) or rel in ("", ".", "..") or "/" in rel or "\\" in rel or "\0" in rel:
            return f"a data file {rel!r} outside the checkpoint's folder"
        if not all(isinstance(getattr(info, k, None), int) and getattr(info, k) >= 0
                   for k in ("offset", "length")):
            return f"{rel}: a malformed offset or length"
        transforms = getattr(info, "transform_descriptors", None)
        if transforms is not None and not (isinstance(transforms, (list, tuple))
                                           and all(isinstance(t, str) for t in transforms)):
            return f"{rel}: malformed transforms"
    if not isinstance(getattr(md, "planner_data", None), (dict, type(None))):
        return "malformed planner_data"
    return None


def _chunk_fits(chunk, dims: int) -> bool:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
    return isinstance(chunk, ChunkStorageMetadata) and isinstance(offsets, torch.Size) \
        and isinstance(sizes, torch.Size) and len(offsets) == len(sizes) == dims
