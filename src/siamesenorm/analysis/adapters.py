"""How a model plugs into the diagnostics: a ``loss_fn`` and a ``head_fn`` (docs/analysis.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

LossFn = Callable[[nn.Module, Any], Tensor]
HeadFn = Callable[[nn.Module, Tensor], Tensor]


def lm_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    x, y = batch
    return model(x, y).loss


def lm_head(model: nn.Module, hidden: Tensor) -> Tensor:
    """Language model: the unembedding (the tied embedding or ``lm_head``) applied to ``hidden``."""
    weight = model.embed.weight if model.lm_head is None else model.lm_head.weight
    return F.linear(hidden, weight)


def vit_head(model: nn.Module, hidden: Tensor) -> Tensor:
    """Vision transformer: the classifier applied to the class token (position 0) of ``hidden``."""
    return model.head(hidden[:, 0])
