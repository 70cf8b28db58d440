"""Validation loss over a fixed list of batches."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch
from torch import Tensor, nn

from ..parallel import SINGLE, World


@torch.no_grad()
def validation_loss(model: nn.Module, batches: Sequence[tuple[Tensor, Tensor]], device: torch.device,
                    autocast: Callable[[], AbstractContextManager], world: World = SINGLE) -> float:
    """Mean cross-entropy per target token (``-100`` ignored) over ``batches``, in eval mode (restored
    after). Across ranks rank ``r`` evaluates batches ``r, r + W, ...``, every rank as many passes."""
    was_training = model.training
    model.eval()
    try:
        total = torch.zeros((), dtype=torch.float64, device=device)
        count = 0
        mine = list(batches)[world.rank::world.size]
        passes = -(-len(batches) // world.size)
        for k in range(passes):
            x, y = mine[k] if k < len(mine) else batches[0]
            x, y = x.to(device), y.to(device)
            with autocast():
                loss = model(x, y).loss
            n = int((y != -100).sum()) if k < len(mine) else 0
            total = total + loss.double() * n
            count += n
        if world.distributed:
            both = torch.stack([total, torch.tensor(float(count), dtype=torch.float64, device=device)])
            torch.distributed.all_reduce(both)
            total, count = both[0], int(both[1].item())
        return (total / max(count, 1)).item()
    finally:
        model.train(was_training)
