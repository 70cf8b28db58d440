"""Checkpoints of a run spread over several processes, through ``torch.distributed.checkpoint``.

Layout of ``checkpoints/last/`` (see :mod:`.checkpoint` for the single-process one)::

    dcp/        torch.distributed.checkpoint: {"model": ..., "optim": ...} keyed by parameter name,
                each rank writing its own shards (one file a rank) and rank 0 the metadata
    state.pt    {"format": 2, "extra": {...}} from rank 0: counters, the batch source, the RNGs

Every rank writes into one hidden temporary directory that rank 0 names; once all have written,
rank 0 swaps it in exactly as a single-process save does, so a save killed part-way leaves the
previous checkpoint in place. The names are the model's own (FSDP2 keeps them; DDP's ``module.``
is removed), so a checkpoint resumes at any world size: ``torch.distributed.checkpoint`` reshards
what was saved by N ranks into M, a single process reads it with :func:`~.checkpoint.load_checkpoint`,
and :func:`load_sharded` also reads a single-process checkpoint into a spread model.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ..errors import ConfigError
from ..parallel import Parallel, World, barrier, broadcast_object
from .checkpoint import (
    DCP_DIR,
    MODEL_FILE,
    SHARDED_FORMAT,
    STATE_FILE,
    _check_plain,
    _fsync,
    install,
    layout,
    load_dcp_into,
    new_temporary,
    read_model,
    read_state,
    verify_checksums,
)

__all__ = ["gather_objects", "load_sharded", "save_sharded"]


def save_sharded(path: str | Path, par: Parallel, optimizer: torch.optim.Optimizer, extra: dict,
                 world: World, keep_as: Path | None = None) -> None:
    """Write the spread model, its optimizer and rank 0's ``extra`` as one checkpoint at ``path``;
    a collective: every rank calls it."""
    path = Path(path)
    if world.main:
        _check_plain(extra, "extra")
    tmp = Path(broadcast_object(world, str(new_temporary(path)) if world.main else None))
    try:
        model_sd, optim_sd = get_state_dict(par.module, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / DCP_DIR))
        if world.main:
            torch.save({"format": SHARDED_FORMAT, "extra": extra}, tmp / STATE_FILE)
            _fsync(tmp / STATE_FILE)
            _fsync(tmp)
        barrier(world)
    except BaseException:
        if world.main:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    if world.main:
        install(tmp, path, keep_as)
    barrier(world)


def load_sharded(path: str | Path, par: Parallel, optimizer: torch.optim.Optimizer | None,
                 world: World) -> dict:
    """Load the checkpoint at ``path`` (either layout, saved at any world size) into the spread
    model and ``optimizer``; returns ``extra``. A collective: every rank calls it."""
    path = Path(path)
    kind, damaged = None, None
    if world.main:
        kind = layout(path)
        try:
            if kind is not None:
                verify_checksums(path)     # once, by rank 0, for every rank
        except ConfigError as error:
            damaged = str(error)
    kind, damaged = broadcast_object(world, (kind, damaged))
    if damaged is not None:
        raise ConfigError(damaged)
    if kind is None:
        raise ConfigError(f"no checkpoint at {path}")
    if kind == "single":
        return _load_single_into_spread(path, par, optimizer)
    extra = read_state(path / STATE_FILE, SHARDED_FORMAT)["extra"]
    load_dcp_into(path, par.module, optimizer)
    return extra


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


def _load_single_into_spread(path: Path, par: Parallel, optimizer) -> dict:
    """A single-process checkpoint (every rank reads the whole file) into a spread model."""
    tensors: dict[str, Tensor] = read_model(path / MODEL_FILE, _Unsharded(par.model))
    state = read_state(path / STATE_FILE)
    options = StateDictOptions(full_state_dict=True)
    if optimizer is None:
        set_model_state_dict(par.module, tensors, options=options)
    else:
        osd = _optimizer_by_name(state["optimizer"], optimizer, par.model)
        set_state_dict(par.module, optimizer, model_state_dict=tensors, optim_state_dict=osd,
                       options=options)
    return state["extra"]


class _Unsharded(nn.Module):
    """What :func:`~.checkpoint.read_model` checks a file against: the names and full shapes of a
    (possibly sharded) model's state, without gathering it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._model = model

    def state_dict(self, *args, **kwargs):  # noqa: D102 - the full shapes, on the meta device
        out = {}
        for name, t in self._model.state_dict().items():
            shape = tuple(t.shape)      # a DTensor's shape is the global one
            out[name] = torch.empty(shape, dtype=t.dtype, device="meta")
        return out


def gather_objects(world: World, obj) -> list:
    """Every rank's ``obj``, on rank 0 (None elsewhere)."""
    if not world.distributed:
        return [obj]
    out = [None] * world.size if world.main else None
    dist.gather_object(obj, out, dst=0)
    return out
