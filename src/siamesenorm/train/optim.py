"""AdamW with decoupled weight decay on matrices only, and the warm-up + cosine learning rate."""

from __future__ import annotations

import math

import torch
from torch import nn

from ..models.host import SchemeHost


def decay_groups(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """``(decayed, not_decayed)`` trainable parameters of ``model``: those of two or more dimensions are
    decayed, except in a scheme host's scheme (decay would pull the residual topology toward zero).
    Tied weights appear once."""
    # Any module trains (the loop's contract is only ``model(x, y).loss``); a host's scheme is kept
    # out of the decay.
    scheme = model.scheme if isinstance(model, SchemeHost) else None
    in_scheme = {id(p) for p in scheme.parameters()} if scheme is not None else set()
    decayed, plain = [], []
    for p in model.parameters():  # parameters() yields a shared parameter once
        if not p.requires_grad:
            continue
        (decayed if p.dim() >= 2 and id(p) not in in_scheme else plain).append(p)
    return decayed, plain


def build_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.1,
                    betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8) -> torch.optim.AdamW:
    """AdamW: :func:`decay_groups`'s decayed as group 0 with ``weight_decay``, the rest as group 1."""
    decayed, plain = decay_groups(model)
    groups = [{"params": decayed, "weight_decay": weight_decay},
              {"params": plain, "weight_decay": 0.0}]
    on_cuda = all(p.is_cuda for p in decayed + plain) and bool(decayed + plain)
    return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps,
                             fused=True if on_cuda else None)


def lr_at(step: int, base_lr: float, warmup: int, total: int, min_lr_ratio: float = 0.1) -> float:
    """Learning rate of update ``step`` (the first is 1): linear warm-up from 0 to ``base_lr`` at ``warmup``,
    then a half cosine down to ``min_lr_ratio * base_lr`` at ``total``, constant after."""
    if step < warmup:
        return base_lr * step / warmup
    min_lr = min_lr_ratio * base_lr
    span = total - warmup
    progress = min(1.0, (step - warmup) / span) if span > 0 else float(step > warmup)
    return min_lr + (base_lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def clip_gradients(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """Scale the gradients to a total 2-norm of at most ``max_norm``; returns the norm before, made whole
    over FSDP2's shards so every rank clips alike."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    if hasattr(norm, "full_tensor"):    # a DTensor: the norm of this rank's shards, to reduce
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm
