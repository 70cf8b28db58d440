"""Writing a checkpoint: the model, the training state or DCP's shards, then the atomic swap."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from ...parallel.env import SINGLE, World, barrier, broadcast_object
from ...rundir import as_created, library_os_error
from .aliases import _bare, _split_aliases
from .atomic import _fsync, install, new_temporary
from .dcp import _on_dcp
from .names import DCP_DIR, FORMAT, MODEL_FILE, SHARDED_FORMAT, STATE_FILE

_PLAIN = (str, int, float, bool, type(None), Tensor)


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


def _write_model(path: Path, model: nn.Module) -> None:
    unique, _ = _split_aliases(model.state_dict())
    save_file({k: v.detach().cpu().contiguous() for k, v in unique.items()}, str(path),
              metadata={"format": "pt"})
    as_created(path)        # safetensors writes it owner-only (0600)
    _fsync(path)


def _write_state(path: Path, optimizer: torch.optim.Optimizer | None, extra: dict) -> None:
    """``state.pt`` (format 1 with the optimizer, 2 without) via a Python file: a full disk raises OSError."""
    state = {"format": SHARDED_FORMAT, "extra": extra} if optimizer is None else \
        {"format": FORMAT, "optimizer": optimizer.state_dict(), "extra": extra}
    with open(path, "xb") as f:
        torch.save(state, f)
    _fsync(path)


class _DcpWriter:                   # over DCP's FileSystemWriter, by _on_dcp
    """DCP's file writer whose failure on a full or read-only disk is the OSError itself on every rank
    (DCP pickles a rank's failure, dropping the ``__context__`` that holds it)."""

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


def save_checkpoint(path: str | os.PathLike, module: nn.Module, optimizer: torch.optim.Optimizer,
                    extra: dict, *, world: World = SINGLE, keep_as: Path | None = None) -> None:
    """Write ``module`` (plain, DDP or FSDP2), ``optimizer`` and ``extra`` into the checkpoint ``path``,
    replacing one there atomically (moved to ``keep_as`` if given). A collective when distributed;
    ``extra`` is rank 0's, of plain containers, numbers, strings, None and tensors (else a TypeError)."""
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
