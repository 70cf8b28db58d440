"""Validation loss over a fixed list of batches."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager

import torch
from torch import Tensor, nn


@torch.no_grad()
def validation_loss(model: nn.Module, batches: Sequence[tuple[Tensor, Tensor]], device: torch.device,
                    autocast: Callable[[], AbstractContextManager]) -> float:
    """Mean cross-entropy per target token (``-100`` targets ignored) over ``batches``, in eval
    mode; the model's training mode is restored afterwards."""
    was_training = model.training
    model.eval()
    try:
        total = torch.zeros((), dtype=torch.float64, device=device)
        count = 0
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            with autocast():
                loss = model(x, y).loss
            n = int((y != -100).sum())
            total = total + loss.double() * n
            count += n
        return (total / max(count, 1)).item()
    finally:
        model.train(was_training)
