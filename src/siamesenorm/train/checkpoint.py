"""Checkpoints: a directory written beside its target and renamed into place; one contract for one
process and for many.

:func:`save_checkpoint` and :func:`load_checkpoint` take what the engine trains (a plain module, a
DDP-wrapped one, or one sharded by FSDP2's ``fully_shard``) and the world of the run; under several
processes both are collectives (every rank calls them). The world size decides the layout written.

One process (e.g. ``run_dir/checkpoints/last/``)::

    model.safetensors   the model's state_dict; a tensor that shares storage with another entry
                        (tied weights) is stored once, under the first name that holds it
    state.pt            {"format": 1, "optimizer": optimizer.state_dict(), "extra": {...}};
                        plain containers, numbers, strings and tensors only, so that it loads
                        with ``torch.load(weights_only=True)``

Several processes::

    dcp/        torch.distributed.checkpoint: {"model": ..., "optim": ...} keyed by parameter name,
                each rank writing its own shards (one file a rank) and rank 0 the metadata
    state.pt    {"format": 2, "extra": {...}} from rank 0 (no optimizer: it is in dcp/)

Both layouts::

    checksums.json      the SHA-256 and size of every other file of the checkpoint, written last;
                        loading verifies them first (under several processes rank 0 verifies once
                        for every rank) and refuses a damaged checkpoint (flipped or missing bytes)
                        with one line instead of training a corrupted model (a checkpoint without
                        the file, from an older version, is not verified)

Atomicity: the files are written and fsynced in a fresh temporary directory ``.<name>.tmp-*`` next
to the target (under several processes rank 0 names it and every rank writes into it). Rank 0 then
swaps it in: it renames the old checkpoint to ``.<name>.old-*``, renames the new one to ``<name>``
and deletes the old one. A crash at any point leaves either ``<name>`` complete (old or new) or, in
the instant between the two renames, no ``<name>`` but a complete ``.<name>.old-*``, which
:func:`load_checkpoint`, :func:`has_checkpoint` and the next :func:`save_checkpoint` move back into
place. Hidden ``.tmp-`` directories are never read; the next save deletes them. One writer per
checkpoint directory at a time.

Loading never runs code from the checkpoint (a run folder is something people download):
``state.pt`` and every tensor load with ``torch.load(weights_only=True)``, ``dcp/.metadata`` (a
pickle) through :func:`read_dcp_metadata`, an unpickler that resolves only the metadata's own
classes, and DCP's non-tensor values with ``weights_only`` too (:func:`read_dcp`). A file that names
anything else is refused as :class:`UnsafeCheckpoint` (one line, never fallen back from); see
``docs/security.md``.

Either layout loads at any world size: the names are the model's own (FSDP2 keeps them; DDP's
``module.`` is removed), ``torch.distributed.checkpoint`` reshards what N ranks saved into M (or into
one process without a process group), and a single-process checkpoint is read whole by every rank
of a spread model.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import io
import json
import os
import pathlib
import pickle
import re
import shutil
import sys
import tempfile
import time
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel

from ..errors import ConfigError
from ..parallel.env import SINGLE, World, barrier, broadcast_object, gather_objects
from ..rundir import library_os_error

if TYPE_CHECKING:
    from torch.distributed.checkpoint import metadata as dcp_metadata

# torch.distributed.checkpoint (DCP) and torch.distributed.tensor are imported where they are used:
# together they take about 0.6 s to import, which a command that never touches a sharded checkpoint
# (generate, export, a refused configuration) would otherwise pay at start.

MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
DCP_DIR = "dcp"
CHECKSUM_FILE = "checksums.json"
FORMAT = 1              # model.safetensors + state.pt with the optimizer
SHARDED_FORMAT = 2      # dcp/ (model and optimizer) + state.pt without it
_PLAIN = (str, int, float, bool, type(None), Tensor)


# ---- tied weights ------------------------------------------------------------------------------
def _split_aliases(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """``(unique, aliases)``: entries with their own storage, and ``alias -> name it shares with``."""
    unique: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in state.items():
        ptr = t.untyped_storage().data_ptr() if t.device.type != "meta" else 0
        key = (t.device, ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if ptr and t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        unique[name] = t
    return unique, aliases


def unique_tensors(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` without the entries that share storage with an earlier one (tied weights)."""
    return _split_aliases(state)[0]


# ---- writing -------------------------------------------------------------------------------------
def _check_plain(obj, where: str) -> None:
    if isinstance(obj, dict):
        for key, value in obj.items():
            _check_plain(key, where)
            _check_plain(value, f"{where}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _check_plain(value, f"{where}[{i}]")
    elif not isinstance(obj, _PLAIN):
        raise TypeError(f"checkpoint {where} is a {type(obj).__name__}; only dicts, lists, tuples, "
                        "numbers, strings, None and tensors load with weights_only=True")


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file, or a directory's entries) to disk; a no-op where the OS refuses."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_model(path: Path, model: nn.Module) -> None:
    unique, _ = _split_aliases(model.state_dict())
    save_file({k: v.detach().cpu().contiguous() for k, v in unique.items()}, str(path),
              metadata={"format": "pt"})
    _fsync(path)


def _write_state(path: Path, optimizer: torch.optim.Optimizer | None, extra: dict) -> None:
    """``state.pt``: format 1 with ``optimizer``'s state, or format 2 (sharded: it is in dcp/).
    Written through a file object of ours: torch's own file writer reports a full disk as an
    iostream error without the cause, a Python file raises the OSError itself."""
    state = {"format": SHARDED_FORMAT, "extra": extra} if optimizer is None else \
        {"format": FORMAT, "optimizer": optimizer.state_dict(), "extra": extra}
    with open(path, "xb") as f:
        torch.save(state, f)
    _fsync(path)


@functools.cache
def _on_dcp(own: type, base: str) -> type:
    """The class ``own`` over ``torch.distributed.checkpoint``'s class ``base`` (``own``'s methods
    first, reaching ``base``'s through ``super()``), made on first use (see the imports above)."""
    from torch.distributed import checkpoint as dcp

    return type(own.__name__, (own, getattr(dcp, base)), {"__module__": own.__module__,
                                                          "__doc__": own.__doc__})


class _DcpWriter:                   # over DCP's FileSystemWriter, by _on_dcp
    """DCP's file writer whose failure on a full or read-only disk is the OSError itself.

    DCP sends each rank's failure to the others pickled, and pickling drops an exception's
    ``__context__``: torch.save into a stream that hits ENOSPC raises a RuntimeError ("unexpected
    pos") whose context alone holds the OSError. Which rank fills the disk, and whether it fails
    in that way or with the OSError, depends on timing; this makes every rank see the errno."""

    def write_data(self, plan, planner):
        try:
            return super().write_data(plan, planner)
        except Exception as error:
            self._raise_os_error(error)

    def finish(self, metadata, results) -> None:
        try:
            super().finish(metadata, results)
        except Exception as error:
            self._raise_os_error(error)

    def _raise_os_error(self, error: Exception) -> None:
        found = library_os_error(error, self.path)
        if found is None:
            raise error
        raise found from error


def _write_dcp(folder: Path, module: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank's share of the model and optimizer state into ``folder`` (a collective)."""
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(module, optimizer)
    writer = _on_dcp(_DcpWriter, "FileSystemWriter")(folder)
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=writer)


def _hidden(path: Path, kind: str) -> list[Path]:
    return sorted(path.parent.glob(f".{path.name}.{kind}-*"))


def _recover(path: Path, clean: bool) -> None:
    """Put a checkpoint whose swap was cut short back at ``path``; with ``clean``, delete leftovers."""
    olds = _hidden(path, "old")
    if not path.exists() and olds:
        os.replace(olds.pop(), path)
        _fsync(path.parent)
    if clean:
        for leftover in olds + _hidden(path, "tmp"):
            shutil.rmtree(leftover, ignore_errors=True)


def save_checkpoint(path: str | os.PathLike, module: nn.Module, optimizer: torch.optim.Optimizer,
                    extra: dict, *, world: World = SINGLE, keep_as: Path | None = None) -> None:
    """Write ``module`` (plain, DDP-wrapped or sharded by FSDP2), ``optimizer`` and ``extra`` into
    the checkpoint directory ``path``: one process writes ``model.safetensors`` and ``state.pt``
    (format 1), several write ``dcp/`` and rank 0's ``state.pt`` (format 2). A collective when
    ``world`` is distributed: every rank calls it; ``extra`` is rank 0's.

    ``extra`` (step, RNG and sampler states, ...) must hold only dicts, lists, tuples, numbers,
    strings, None and tensors; anything else is a TypeError before a byte is written. An existing
    checkpoint at ``path`` is replaced atomically (see the module docstring), and moved to
    ``keep_as`` when that is given.
    """
    path = Path(path)
    if world.main:
        _check_plain(extra, "extra")
    tmp = Path(broadcast_object(world, str(new_temporary(path)) if world.main else None))
    try:
        if world.distributed:
            _write_dcp(tmp / DCP_DIR, module, optimizer)
        else:
            _write_model(tmp / MODEL_FILE, _bare(module))
        if world.main:
            _write_state(tmp / STATE_FILE, None if world.distributed else optimizer, extra)
            _fsync(tmp)
        barrier(world)
    except BaseException as error:
        if world.main:
            shutil.rmtree(tmp, ignore_errors=True)
        # a library's writer (safetensors, torch.save, torch.distributed.checkpoint) that hit a full
        # or read-only disk: the OSError behind it, naming the checkpoint (one line for the user)
        found = library_os_error(error, path)
        if found is not None:
            raise found from None
        raise
    if world.main:
        try:
            install(tmp, path, keep_as)
        except BaseException as error:
            found = library_os_error(error, path)
            if found is not None:
                raise found from None
            raise
    barrier(world)


def new_temporary(path: Path) -> Path:
    """A fresh hidden directory beside ``path`` to write its next version into (after moving back
    a version that a cut-short swap left hidden, and deleting older leftovers)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _recover(path, clean=True)
    return Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))


def _digest(file: Path) -> str:
    with open(file, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_checksums(folder: Path) -> None:
    """Record the SHA-256 and size of every file under ``folder`` in its ``checksums.json``."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != CHECKSUM_FILE)
    sums = {p.relative_to(folder).as_posix(): {"sha256": _digest(p), "bytes": p.stat().st_size}
            for p in files}
    target = folder / CHECKSUM_FILE
    target.write_text(json.dumps(sums, indent=1) + "\n", encoding="utf-8")
    _fsync(target)


def verify_checksums(path: str | os.PathLike) -> None:
    """Refuse (:class:`ConfigError`, one line) a checkpoint whose files do not match the checksums
    written with it; a checkpoint without ``checksums.json`` (an older version's) passes."""
    path = Path(path)
    file = path / CHECKSUM_FILE
    if not file.exists():
        return
    damaged = f"checkpoint {path} is damaged"
    try:
        sums = json.loads(file.read_text(encoding="utf-8"))
        entries = [(rel, want["sha256"], want["bytes"]) for rel, want in sums.items()]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        raise ConfigError(f"{damaged}: its {CHECKSUM_FILE} is unreadable") from None
    for rel, sha, size in entries:
        part = path / rel
        if not part.is_file():
            raise ConfigError(f"{damaged}: {rel} is missing")
        if part.stat().st_size != size or _digest(part) != sha:
            raise ConfigError(f"{damaged}: {rel} does not match the checksum written with it "
                              "(changed, flipped or cut-short bytes); restore it from a copy")


def install(tmp: Path, path: Path, keep_as: Path | None = None) -> None:
    """Swap the complete directory ``tmp`` in at ``path``, after recording its checksums (see the
    module docstring). With ``keep_as``, the checkpoint it replaces is kept there (renamed) rather
    than deleted."""
    write_checksums(tmp)
    _fsync(tmp)
    old = None
    if path.exists():
        if keep_as is not None and not keep_as.exists():
            os.replace(path, keep_as)
        else:
            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:12]}"
            os.replace(path, old)
    os.replace(tmp, path)
    _fsync(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---- older checkpoints beside the last -----------------------------------------------------------
def kept_name(path: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` goes when a newer one replaces it at ``path``."""
    return path.parent / f"step_{step}"


def older_checkpoints(path: str | os.PathLike) -> list[Path]:
    """The kept checkpoints beside ``path`` (``step_<N>`` folders), newest first."""
    path = Path(path)
    found = [p for p in path.parent.glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]), reverse=True)


def prune_checkpoints(path: str | os.PathLike, keep: int) -> None:
    """Delete the kept checkpoints beside ``path`` beyond the newest ``keep - 1`` (``path`` itself
    is the last of ``keep``)."""
    for stale in older_checkpoints(path)[max(keep - 1, 0):]:
        shutil.rmtree(stale, ignore_errors=True)


# ---- reading -------------------------------------------------------------------------------------
def has_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a checkpoint (after finishing a swap that a crash cut short)."""
    return layout(path) is not None


def layout(path: str | os.PathLike) -> str | None:
    """``"single"`` (model.safetensors), ``"sharded"`` (dcp/) or None: which checkpoint ``path``
    holds, after finishing a swap that a crash cut short."""
    path = Path(path)
    _recover(path, clean=False)
    if not (path / STATE_FILE).is_file():
        return None
    if (path / MODEL_FILE).is_file():
        return "single"
    if (path / DCP_DIR / ".metadata").is_file():
        return "sharded"
    return None


def problem(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    line = text[0] if text else type(error).__name__
    if isinstance(error, pickle.UnpicklingError):     # torch's weights-only refusal: the reason line
        line = next((x.strip() for x in text if "WeightsUnpickler error" in x or "Unsupported" in x
                     or "truncated" in x), line).removeprefix("WeightsUnpickler error: ")
    return line if len(line) <= 200 else line[:197] + "..."


# ---- loading never runs code ---------------------------------------------------------------------
class UnsafeCheckpoint(ConfigError):
    """A checkpoint file that names a Python object a checkpoint never holds (a function or class to
    call while unpickling): altered, possibly to run code. Refused unread, never fallen back from."""


def _unsafe(file: Path | str, what: str) -> UnsafeCheckpoint:
    return UnsafeCheckpoint(f"refusing checkpoint file {file}: it names {what}, which a checkpoint "
                            "never holds (the file was altered, possibly to run code when loaded); "
                            "restore it from a copy you trust")


_GLOBAL = re.compile(r"GLOBAL ([\w.]+)|unsupported class ([\w.]+)|reduce for unrecognized function "
                     r"\W*([\w.]+)", re.IGNORECASE)


def _refuse_unsafe(error: BaseException, file: Path | str) -> None:
    """Raise :class:`UnsafeCheckpoint` when ``error`` is ``torch.load(weights_only=True)``
    refusing a pickled global (or a call of one) in ``file``."""
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
    """The allow-list above, ``(module, name) -> object``, built on first use (it names DCP's
    classes, and DCP is imported on first use)."""
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
    """An unpickler that resolves only :func:`_dcp_globals` and torch's dtypes and layouts, so no
    other function or class can be called while reading; anything else is refused by name."""

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
    """The metadata of the ``torch.distributed.checkpoint`` folder ``path`` (or its ``.metadata``
    file), read without running code: the pickle may name only the checkpoint's metadata classes,
    ``torch.Size``, dtypes and layouts (:class:`UnsafeCheckpoint` otherwise), and what it holds is
    checked to be DCP metadata whose data files lie in the folder (:class:`ConfigError`, one line).
    Written by PyTorch's writer or OLMo-core's; the result is what ``dcp.load`` expects."""
    file = Path(path)
    if file.is_dir():
        file = file / ".metadata"
    try:
        with open(file, "rb") as f:
            metadata = _MetadataUnpickler(f, file).load()
    except UnsafeCheckpoint:
        raise
    except OSError as error:
        raise ConfigError(f"cannot read checkpoint {file}: {error.strerror or error}") from None
    except Exception as error:      # cut short, flipped bytes: whatever the unpickler says
        raise ConfigError(f"cannot read checkpoint {file}: {problem(error) or 'damaged'}") from None
    reason = _metadata_problem(metadata)
    if reason is not None:
        raise ConfigError(f"cannot read checkpoint {file}: not torch.distributed.checkpoint metadata "
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
            if not isinstance(size, torch.Size) or not isinstance(chunks, list) \
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
    """torch's load planner, but a non-tensor value (a ``param_groups`` entry) is read with
    ``torch.load(weights_only=True)`` rather than as any pickle; a value that names anything
    else is refused (:class:`UnsafeCheckpoint`)."""

    def __init__(self, reader: _VerifiedReader) -> None:
        super().__init__()
        self.reader = reader

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        info = self.reader.verified.storage_data.get(read_item.storage_index)
        where = Path(self.reader.path) / getattr(info, "relative_path", "?")
        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as error:
            _refuse_unsafe(error, where)
            raise ConfigError(f"cannot read checkpoint {where}: {problem(error)}") from None
        plain = io.BytesIO()        # handed on as torch's planner takes it: as bytes it unpickles
        torch.save(obj, plain)
        plain.seek(0)
        super().load_bytes(read_item, plain)


def read_model(file: Path, model: nn.Module) -> dict[str, Tensor]:
    """The full state_dict for ``model`` (bare or sharded by FSDP2) from ``file``, checked against
    the model's own names and full shapes (a sharded model's state is not gathered for it)."""
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as error:
        raise ConfigError(f"cannot read checkpoint {file}: {problem(error)}") from None
    unique, aliases = _expected(model)
    missing = sorted(set(unique) - set(tensors))
    unexpected = sorted(set(tensors) - set(unique))
    bad = [k for k in unique if k in tensors and tensors[k].shape != unique[k].shape]
    if missing or unexpected or bad:
        detail = (f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
                  if unexpected else f"{bad[0]} has shape {tuple(tensors[bad[0]].shape)}, "
                  f"the model has {tuple(unique[bad[0]].shape)}")
        raise ConfigError(f"checkpoint {file} does not fit this model ({detail}); "
                          "was it written by a model with another configuration?")
    tensors.update({alias: tensors[name] for alias, name in aliases.items()})
    return tensors


def _expected(model: nn.Module) -> tuple[dict[str, Tensor], dict[str, str]]:
    """``(unique, aliases)`` of ``model``'s state as :func:`_split_aliases` gives them; for a model
    sharded by FSDP2, the full shapes on the meta device and the aliases by parameter identity."""
    state = model.state_dict()
    if not any(_is_dtensor(t) for t in state.values()):
        return _split_aliases(state)
    ids = {name: id(t) for name, t in model.named_parameters(remove_duplicate=False)}
    ids.update({name: id(t) for name, t in model.named_buffers(remove_duplicate=False)})
    unique: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    first: dict[int, str] = {}
    for name, t in state.items():
        key = ids.get(name)
        if key is not None and key in first:
            aliases[name] = first[key]
            continue
        if key is not None:
            first[key] = name
        unique[name] = torch.empty(tuple(t.shape), dtype=t.dtype, device="meta")   # global shape
    return unique, aliases


def read_state(file: Path, format: int = FORMAT) -> dict:
    """The training state file of a checkpoint of ``format`` (1 holds the optimizer, 2 does not),
    read with ``torch.load(weights_only=True)``: tensors and plain values only; a file that names
    anything else (a planted ``__reduce__``) is refused (:class:`UnsafeCheckpoint`) unexecuted."""
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:
        _refuse_unsafe(error, file)
        raise ConfigError(f"cannot read checkpoint {file}: {problem(error)}") from None
    if not isinstance(state, dict) or state.get("format") != format \
            or not isinstance(state.get("extra"), dict) or (format == FORMAT and "optimizer" not in state):
        raise ConfigError(f"cannot read checkpoint {file}: not a siamesenorm training state "
                          f"(format {format})")
    return state


def checkpoint_extra(path: str | os.PathLike) -> dict:
    """The ``extra`` (step, counters, states) of the checkpoint at ``path``, of either layout."""
    path = Path(path)
    kind = layout(path)
    if kind is None:
        raise ConfigError(f"no checkpoint at {path}")
    verify_checksums(path)
    return read_state(path / STATE_FILE, FORMAT if kind == "single" else SHARDED_FORMAT)["extra"]


def load_checkpoint(path: str | os.PathLike, module: nn.Module,
                    optimizer: torch.optim.Optimizer | None, *, world: World = SINGLE) -> dict:
    """Load the checkpoint directory ``path`` (either layout, saved at any world size) into
    ``module`` (plain, DDP-wrapped or sharded by FSDP2) and ``optimizer`` (None: the weights only);
    return ``extra``. A collective when ``world`` is distributed: every rank calls it.

    A missing, damaged or unreadable checkpoint, or one written by a model of another shape, raises
    :class:`ConfigError` with the path and the problem on one line. One process reading a
    single-process checkpoint checks both files before anything is changed, leaving ``module`` and
    ``optimizer`` as they were.
    """
    path = Path(path)
    kind = _verified_layout(path, world)
    if kind == "sharded":
        extra = read_state(path / STATE_FILE, SHARDED_FORMAT)["extra"]
        load_dcp_into(path, module, optimizer)
        return extra
    bare = _bare(module)
    if world.distributed or _is_sharded(bare):
        return _load_single_into_spread(path, module, bare, optimizer)
    tensors = read_model(path / MODEL_FILE, bare)
    state = read_state(path / STATE_FILE)
    if optimizer is not None:
        try:
            optimizer.load_state_dict(state["optimizer"])
        except Exception as error:
            raise ConfigError(f"checkpoint {path / STATE_FILE} does not fit this optimizer: "
                              f"{problem(error)}") from None
    bare.load_state_dict(tensors, strict=True)
    return state["extra"]


def _verified_layout(path: Path, world: World) -> str:
    """:func:`layout` of ``path`` after :func:`verify_checksums`, both by rank 0 once for every
    rank; a missing or damaged checkpoint raises :class:`ConfigError` on every rank alike."""
    kind, damaged = None, None
    if world.main:
        kind = layout(path)
        try:
            if kind is not None:
                verify_checksums(path)
        except ConfigError as error:
            damaged = str(error)
    kind, damaged = broadcast_object(world, (kind, damaged))
    if damaged is not None:
        raise ConfigError(damaged)
    if kind is None:
        raise ConfigError(f"no checkpoint at {path} (expected {MODEL_FILE} and {STATE_FILE} there, "
                          f"or {DCP_DIR}/ and {STATE_FILE})")
    return kind


def _bare(module: nn.Module) -> nn.Module:
    """The model inside a DDP wrapper (the names of its state are the model's own)."""
    return module.module if isinstance(module, DistributedDataParallel) else module


def _is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor (FSDP2's shard), without importing ``torch.distributed.tensor``
    (half a second): where nothing has imported it, its class does not exist and no tensor is one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _is_sharded(model: nn.Module) -> bool:
    return any(_is_dtensor(p) for p in model.parameters())


def _names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> its first name`` (a tied parameter answers to its first name)."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    return names


def _optimizer_by_name(saved: dict, optimizer: torch.optim.Optimizer, model: nn.Module) -> dict:
    """A single-process ``optimizer.state_dict()`` (parameters numbered in group order) keyed by
    parameter name instead, for ``set_state_dict``. The numbering is that of ``optimizer``'s own
    groups: both were built by the same :func:`~.optim.build_optimizer` over the same model."""
    names = _names(model)
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    groups = saved["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in optimizer.param_groups]:
        raise ConfigError("the checkpoint's optimizer has other parameter groups than this model's")
    by_name = {"state": {order[i]: s for i, s in saved["state"].items()},
               "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                                 "params": [order[i] for i in g["params"]]} for g in groups]}
    return by_name


def _load_single_into_spread(path: Path, module: nn.Module, bare: nn.Module,
                             optimizer: torch.optim.Optimizer | None) -> dict:
    """A single-process checkpoint (every rank reads the whole file) into a spread ``module``
    (``bare`` is the model inside it)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

    tensors = read_model(path / MODEL_FILE, bare)
    state = read_state(path / STATE_FILE)
    options = StateDictOptions(full_state_dict=True)
    if optimizer is None:
        set_model_state_dict(module, tensors, options=options)
    else:
        osd = _optimizer_by_name(state["optimizer"], optimizer, bare)
        set_state_dict(module, optimizer, model_state_dict=tensors, optim_state_dict=osd,
                       options=options)
    return state["extra"]


def load_dcp_into(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Read ``path/dcp`` into ``module`` (plain, DDP-wrapped or sharded by FSDP2) and ``optimizer``.

    ``torch.distributed.checkpoint`` reshards as it reads, so the world size of the reader need not
    be that of the writer; a single process without a process group reads it too.
    """
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    if optimizer is None:
        state = {"model": get_model_state_dict(module)}
        _read_dcp(path, state)
        _fits(path, lambda: set_model_state_dict(module, state["model"]))
        return
    model_sd, optim_sd = get_state_dict(module, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    _read_dcp(path, state)
    _fits(path, lambda: set_state_dict(module, optimizer, model_state_dict=state["model"],
                                       optim_state_dict=state["optim"]))


def _fits(path: Path, apply) -> None:
    """``apply()`` (putting what was read into the model and optimizer); what does not fit them is
    a :class:`ConfigError` naming the checkpoint."""
    try:
        apply()
    except (RuntimeError, ValueError, KeyError, TypeError, AssertionError) as error:
        raise ConfigError(f"checkpoint {path / DCP_DIR} does not fit this model and optimizer: "
                          f"{problem(error)}") from None


def read_dcp(folder: str | os.PathLike, state: dict) -> None:
    """``dcp.load(state)`` from the ``torch.distributed.checkpoint`` folder ``folder`` without
    running code: its metadata through :func:`read_dcp_metadata`, its non-tensor values with
    ``weights_only``. A damaged folder is a :class:`ConfigError`, an altered one an
    :class:`UnsafeCheckpoint` (one line each, on every rank alike). A collective under a process
    group, as ``dcp.load`` is; a single process without one reads it too."""
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
        if isinstance(cause, ConfigError):
            raise type(cause)(str(cause)) from None
        raise ConfigError(f"cannot read checkpoint {folder}: {problem(cause)}") from None


def _first_failure(error: BaseException) -> BaseException:
    """The exception behind a ``CheckpointException``: any rank's refusal of an altered file, else
    the lowest rank's failure; ``error`` itself when it is none."""
    failures = getattr(error, "failures", None)
    if not isinstance(failures, dict) or not failures:
        return error
    found = [f[0] if isinstance(f, tuple) else f for _, f in sorted(failures.items())]
    return next((f for f in found if isinstance(f, UnsafeCheckpoint)), found[0])


def _read_dcp(path: Path, state: dict) -> None:
    read_dcp(path / DCP_DIR, state)


# ---- the checkpoints of a run --------------------------------------------------------------------
@dataclass(frozen=True)
class Saved:
    """The named stateful parts of a training run besides the model and optimizer, as a checkpoint
    holds them: the run's counters, the batch source's state, the generators (rank 0's, and every
    rank's in a run across processes)."""

    run: dict
    source: dict
    rng: dict
    rng_ranks: list | None
    world_size: int

    def micro_batches_per_rank(self, micro_batches: int) -> int:
        """Micro-batches per rank that keep a resumed run's global batch of ``micro_batches``."""
        if micro_batches % self.world_size:
            raise ConfigError(f"the checkpoint's global batch is {micro_batches} micro-batches, which "
                              f"{self.world_size} processes cannot split evenly; resume with a "
                              "number of processes that divides it")
        return micro_batches // self.world_size


class Checkpoints:
    """A run's checkpoints: the last at ``path`` (``checkpoints/last``), the ``keep - 1`` before it
    kept beside it as ``step_<N>``; saved and loaded through one path at any world size."""

    def __init__(self, path: Path, keep: int, world: World = SINGLE) -> None:
        self.path, self.keep, self.world = Path(path), keep, world

    def save(self, module: nn.Module, optimizer: torch.optim.Optimizer, *, step: int,
             previous: int | None, run: dict, source: dict, rng: dict) -> None:
        """Write the checkpoint of ``step`` (a collective across processes); the one of step
        ``previous`` it replaces is kept as ``step_<previous>`` while ``keep`` allows."""
        extra = {"run": run, "source": source, "rng": rng}
        if self.world.distributed:
            extra["rng_ranks"] = gather_objects(self.world, rng)
        keep_as = kept_name(self.path, previous) if self.keep > 1 and previous and previous != step else None
        save_checkpoint(self.path, module, optimizer, extra, world=self.world, keep_as=keep_as)
        if self.world.main:
            prune_checkpoints(self.path, self.keep)

    def load_newest_good(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> Saved:
        """Load the newest checkpoint that loads (the last, else the kept ones, newest first). A
        fallback says so on stderr and moves the last one aside (to ``checkpoints/damaged-<time>``)."""
        first = None
        for path in [self.path, *older_checkpoints(self.path)]:
            try:
                extra = load_checkpoint(path, module, optimizer, world=self.world)
                saved = Saved(extra["run"], extra["source"], extra["rng"], extra.get("rng_ranks"),
                              self.world.size)
            except KeyError as error:
                raise ConfigError(f"checkpoint {path} lacks the training state {error}; it was not "
                                  "written by siamesenorm.train") from None
            except UnsafeCheckpoint:        # altered, not damaged: no fallback, nothing moved
                raise
            except ConfigError as error:
                first = first or error
                continue
            if first is not None and self.world.main:
                print(f"warning: {first}; resuming from {path} instead{self._move_aside()}",
                      file=sys.stderr, flush=True)
            barrier(self.world)
            return saved
        assert first is not None
        raise first

    def _move_aside(self) -> str:
        if not self.path.exists():
            return ""
        damaged = self.path.with_name(f"damaged-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        os.replace(self.path, damaged)
        return f" ({self.path.name} moved to {damaged.name})"
