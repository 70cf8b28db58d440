"""Cheap probes of a model's depth behaviour: stream RMS, gradient norms, learned norm gains."""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import Tensor, nn

from ..models.host import SchemeHost
from ..nn.norms import LayerNorm, RMSNorm
from ..schemes.base import SUBLAYERS_PER_BLOCK
from .adapters import LossFn, lm_loss
from .tap import StreamTap

__all__ = ["block_grad_norms", "grad_norms", "norm_gains", "stream_rms", "sublayer_rms"]

NORM_TYPES: tuple[type, ...] = (LayerNorm, RMSNorm, nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)


def _wide(t: Tensor) -> Tensor:
    return t.detach().to(torch.promote_types(t.dtype, torch.float32))


def _whole(t: Tensor) -> Tensor:
    """A sharded DTensor's value as a plain tensor (collective: every rank calls it); else ``t``."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _rms(t: Tensor) -> Tensor:
    return _wide(t).pow(2).mean().sqrt()


@torch.no_grad()
def sublayer_rms(model: SchemeHost, batch: Any, loss_fn: LossFn = lm_loss) -> dict[str, list[float]]:
    """RMS over every element of each stream after ``k`` sublayers, ``k = 0 .. n_sublayers`` (0: the entry
    state), of the state as the scheme carries it. One forward pass of ``loss_fn(model, batch)``."""
    with StreamTap(model) as tap:
        loss_fn(model, batch)
    values = {name: torch.stack([_rms(s[name]) for s in tap.states]) for name in tap.states[0]}
    return {name: v.tolist() for name, v in values.items()}


@torch.no_grad()
def stream_rms(model: SchemeHost, inputs: Tensor) -> dict[str, list[float]]:
    """RMS of every stream after each block (at the end of its last sublayer) for ``model(inputs)``."""
    with StreamTap(model) as tap:
        model(inputs)
    blocks = tap.block_states()[1:]
    return {name: [_rms(s[name]).item() for s in blocks] for name in tap.states[0]}


def _grad_norm(params, device: torch.device) -> Tensor:
    grads = [_wide(p.grad) for p in params if p.grad is not None]
    if not grads:
        return torch.zeros((), device=device)
    return torch.linalg.vector_norm(torch.stack([_whole(torch.linalg.vector_norm(g)) for g in grads]))


def grad_norms(model: SchemeHost) -> dict[str, Any]:
    """L2 norms of the gradients now held (call after backward): ``total``, ``scheme`` (the scheme's own
    parameters) and ``blocks`` (per block, its sublayers'). A missing gradient counts as zero."""
    per = SUBLAYERS_PER_BLOCK
    device = next(model.parameters()).device
    subs = list(model.sublayers)
    blocks = [_grad_norm((p for sub in subs[b:b + per] for p in sub.parameters()), device)
              for b in range(0, len(subs), per)]
    values = torch.stack([_grad_norm(model.parameters(), device),
                          _grad_norm(model.scheme.parameters(), device), *blocks]).tolist()
    return {"total": values[0], "scheme": values[1], "blocks": values[2:]}


def block_grad_norms(model: SchemeHost) -> list[float]:
    return grad_norms(model)["blocks"]


_INDEXED = re.compile(r"^(.*)\.(\d+)$")


@torch.no_grad()
def norm_gains(model: SchemeHost) -> dict[str, float | list[float]]:
    """Mean ``|weight|`` of the scheme's affine norms and 1-D ``gain`` parameters, by name and index:
    ``{"post_norm": [value per index], "merge_norm_x": value}``. Norms inside sublayers are not read."""
    scheme = model.scheme
    found: dict[str, Tensor] = {}
    for name, module in scheme.named_modules():
        weight = getattr(module, "weight", None)
        if name and isinstance(module, NORM_TYPES) and isinstance(weight, Tensor):
            found[name] = _whole(_wide(weight).abs().mean())
    for name, param in scheme.named_parameters():
        if "gain" in name and param.dim() == 1:
            found[name] = _whole(_wide(param).abs().mean())
    values = dict(zip(found, torch.stack(list(found.values())).tolist())) if found else {}
    out: dict[str, Any] = {}
    for name, value in values.items():
        match = _INDEXED.match(name)
        if match is None:
            out[name] = value
            continue
        group, index = match.group(1), int(match.group(2))
        slots = out.setdefault(group, [])
        slots.extend([None] * (index + 1 - len(slots)))
        slots[index] = value
    return out
