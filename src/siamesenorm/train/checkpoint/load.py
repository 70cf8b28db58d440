"""Loading the three layouts: single file, DCP at any world size, single file into a spread model."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor, nn

from ...errors import UserError
from ...parallel.env import SINGLE, World, broadcast_object
from .aliases import _bare, _expected, _is_sharded, upgrade_legacy_names
from .atomic import _recover, verify_checksums
from .dcp import read_dcp
from .names import DCP_DIR, FORMAT, MODEL_FILE, SHARDED_FORMAT, STATE_FILE
from .safe import load_weights_only, problem


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


def read_model(file: Path, model: nn.Module) -> dict[str, Tensor]:
    """The full state_dict for ``model`` (bare or FSDP2) from ``file``, its names and shapes checked."""
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as error:
        raise UserError(f"cannot read checkpoint {file}: {problem(error)}") from None
    tensors = upgrade_legacy_names(tensors, model)
    unique, aliases = _expected(model)
    missing = sorted(set(unique) - set(tensors))
    unexpected = sorted(set(tensors) - set(unique))
    bad = [k for k in unique if k in tensors and tensors[k].shape != unique[k].shape]
    if missing or unexpected or bad:
        detail = (f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
                  if unexpected else f"{bad[0]} has shape {tuple(tensors[bad[0]].shape)}, "
                  f"the model has {tuple(unique[bad[0]].shape)}")
        raise UserError(f"checkpoint {file} does not fit this model ({detail}); "
                          "was it written by a model with another configuration?")
    tensors.update({alias: tensors[name] for alias, name in aliases.items()})
    return tensors


def read_state(file: Path, format: int = FORMAT) -> dict:
    """The training state file (format 1 holds the optimizer, 2 does not), read ``weights_only``: a file
    naming anything else is refused unexecuted (:class:`UnsafeCheckpoint`)."""
    state = load_weights_only(file, file)
    if not isinstance(state, dict) or state.get("format") != format \
            or not isinstance(state.get("extra"), dict) or (format == FORMAT and "optimizer" not in state):
        raise UserError(f"cannot read checkpoint {file}: not a siamesenorm training state "
                          f"(format {format})")
    return state


def checkpoint_extra(path: str | os.PathLike) -> dict:
    """The ``extra`` (step, counters, states) of the checkpoint at ``path``, of either layout."""
    path = Path(path)
    kind = layout(path)
    if kind is None:
        raise UserError(f"no checkpoint at {path}")
    verify_checksums(path)
    return read_state(path / STATE_FILE, FORMAT if kind == "single" else SHARDED_FORMAT)["extra"]


def load_checkpoint(path: str | os.PathLike, module: nn.Module,
                    optimizer: torch.optim.Optimizer | None, *, world: World = SINGLE) -> dict:
    """Load the checkpoint ``path`` (either layout, any world size) into ``module`` (plain, DDP or FSDP2)
    and ``optimizer`` (None: the weights only); returns ``extra``. A collective when distributed. A
    missing, damaged or mismatched checkpoint is a one-line :class:`UserError`."""
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
            raise UserError(f"checkpoint {path / STATE_FILE} does not fit this optimizer: "
                              f"{problem(error)}") from None
    bare.load_state_dict(tensors, strict=True)
    return state["extra"]


def _verified_layout(path: Path, world: World) -> str:
    """:func:`layout` after :func:`verify_checksums`, by rank 0 once for every rank."""
    kind, damaged = None, None
    if world.main:
        kind = layout(path)
        try:
            if kind is not None:
                verify_checksums(path)
        except UserError as error:
            damaged = str(error)
    kind, damaged = broadcast_object(world, (kind, damaged))
    if damaged is not None:
        raise UserError(damaged)
    if kind is None:
        raise UserError(f"no checkpoint at {path} (expected {MODEL_FILE} and {STATE_FILE} there, "
                          f"or {DCP_DIR}/ and {STATE_FILE})")
    return kind


def _names(model: nn.Module) -> dict[int, str]:
    """``id(parameter) -> its first name`` (a tied parameter answers to its first name)."""
    names: dict[int, str] = {}
    for name, p in model.named_parameters():
        names.setdefault(id(p), name)
    return names


def _optimizer_by_name(saved: dict, optimizer: torch.optim.Optimizer, model: nn.Module) -> dict:
    """A single-process ``optimizer.state_dict()`` keyed by parameter name (for ``set_state_dict``), numbered
    as ``optimizer``'s own groups: both come from :func:`~.optim.build_optimizer` over the same model."""
    names = _names(model)
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    groups = saved["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in optimizer.param_groups]:
        raise UserError("the checkpoint's optimizer has other parameter groups than this model's")
    by_name = {"state": {order[i]: s for i, s in saved["state"].items()},
               "param_groups": [{**{k: v for k, v in g.items() if k != "params"},
                                 "params": [order[i] for i in g["params"]]} for g in groups]}
    return by_name


def _load_single_into_spread(path: Path, module: nn.Module, bare: nn.Module,
                             optimizer: torch.optim.Optimizer | None) -> dict:
    """A single-process checkpoint (read whole by every rank) into a spread ``module``."""
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
    """Read ``path/dcp`` into ``module`` and ``optimizer``; DCP reshards as it reads, for any world size."""
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
    """``apply()``; what does not fit the model and optimizer is a :class:`UserError` naming ``path``."""
    try:
        apply()
    except (RuntimeError, ValueError, KeyError, TypeError, AssertionError) as error:
        raise UserError(f"checkpoint {path / DCP_DIR} does not fit this model and optimizer: "
                          f"{problem(error)}") from None


def _read_dcp(path: Path, state: dict) -> None:
    read_dcp(path / DCP_DIR, state)
