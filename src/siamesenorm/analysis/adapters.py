"""How a model plugs into the diagnostics: two small callables, given here for the language model.

Every diagnostic observes the residual streams through :class:`~.tap.StreamTap`, so it only needs
a way to *run* the model and, for the logit lens, a way to turn a hidden state into logits:

``loss_fn(model, batch) -> Tensor``
    Runs the model once on ``batch`` (through ``scheme.enter/step/exit``) and returns the mean
    loss, a scalar. Pruning compares its values; the other diagnostics call it only to run the
    model. It must be deterministic (a DiT's loss should fix its noise and timesteps from the batch).
``head_fn(model, hidden) -> logits``
    Maps a tensor shaped like ``scheme.exit``'s output to the logits whose argmax is the model's
    prediction (the language model's unembedding; a ViT's pooling and classifier). It is applied
    to ``scheme.exit``'s output for the model's own prediction and to each normalised stream for
    the lens.

A ViT or DiT provides its own pair; nothing else in :mod:`siamesenorm.analysis` knows the model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn

LossFn = Callable[[nn.Module, Any], Tensor]
HeadFn = Callable[[nn.Module, Tensor], Tensor]


def lm_loss(model: nn.Module, batch: tuple[Tensor, Tensor]) -> Tensor:
    """Language model: mean next-token cross-entropy of ``batch = (x, y)``."""
    x, y = batch
    return model(x, y).loss


def lm_head(model: nn.Module, hidden: Tensor) -> Tensor:
    """Language model: the unembedding (the tied embedding or ``lm_head``) applied to ``hidden``."""
    weight = model.embed.weight if model.lm_head is None else model.lm_head.weight
    return F.linear(hidden, weight)


def vit_head(model: nn.Module, hidden: Tensor) -> Tensor:
    """Vision transformer: the classifier applied to the class token (position 0) of ``hidden``."""
    return model.head(hidden[:, 0])
