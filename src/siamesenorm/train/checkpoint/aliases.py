"""Tied weights (state entries that share storage), and the model inside its DDP or FSDP2 wrapper."""

from __future__ import annotations

import sys

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel


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


def upgrade_legacy_names(state: dict[str, Tensor], model: nn.Module) -> dict[str, Tensor]:
    """``state`` with an earlier layout's names renamed per module's ``legacy_state_names`` (old -> new)."""
    renames = [(f"{path}.{old}" if path else old, f"{path}.{new}" if path else new)
               for path, module in _bare(model).named_modules()
               for old, new in getattr(type(module), "legacy_state_names", {}).items()]
    if not renames:
        return state
    out = {}
    for key, value in state.items():
        old, new = next(((o, n) for o, n in renames if key.startswith(o)), ("", ""))
        out[new + key[len(old):]] = value
    return out


def _bare(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, DistributedDataParallel) else module


def _is_dtensor(t: object) -> bool:
    """Whether ``t`` is FSDP2's DTensor, without importing ``torch.distributed.tensor`` (half a second)."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(t, module.DTensor)


def _is_sharded(model: nn.Module) -> bool:
    return any(_is_dtensor(p) for p in model.parameters())
