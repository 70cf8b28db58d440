"""The gradient of one training step, and its clipped norm and loss averaged over the ranks."""

from __future__ import annotations

import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor, nn

from ..models.host import SchemeHost
from ..parallel import Parallel, World, all_mean
from .forward import ForwardBackward
from .hooks import BatchSource
from .optim import clip_gradients
from .state import RunState


class StepGradient:
    """Accumulates ``micro_batches`` micro-batches (per rank) of ``source`` into ``model``'s gradients."""

    def __init__(self, model: nn.Module, parallel: Parallel, source: BatchSource, cfg: Any, world: World,
                 device: torch.device, autocast: Callable[[], AbstractContextManager]) -> None:
        self.model, self.parallel, self.source, self.world = model, parallel, source, world
        self.device, self.autocast = device, autocast
        self.forward = ForwardBackward(parallel.module, cfg.compile)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.clip = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        self.micro_batches = cfg.grad_accum      # per rank and step
        # a scheme host counts its own tokens (patches, a class token); any other module, every id
        self.tokens_in = model.tokens_in if isinstance(model, SchemeHost) else Tensor.numel
        self.loss_parts: dict[str, float] = {}   # the last step's loss by part (MoE models)

    def backward(self, state: RunState) -> tuple[Tensor, int]:
        """Forward and backward of the step's micro-batches; their summed loss and this rank's tokens."""
        n, total, tokens, parts = self.micro_batches, None, 0, {}
        for i in range(n):
            x, y = self.source.next_batch()
            if state.seq_len is None:
                state.seq_len = int(x.shape[-1])
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            with self.parallel.sync_gradients(i == n - 1):
                loss = self.forward(x, y, n, self.autocast)
            total = loss if total is None else total + loss
            tokens += int(self.tokens_in(x))
            for key, value in getattr(self.model, "loss_parts", {}).items():
                parts[key] = value.float() if key not in parts else parts[key] + value.float()
        if parts:   # a loss made of several (an MoE's), averaged over micro-batches and ranks
            means = all_mean(self.world, torch.stack(list(parts.values())) / n)
            self.loss_parts = dict(zip(parts, means.tolist()))
        return total, tokens

    def reduce(self, total: Tensor, tokens: int) -> tuple[float, float, int]:
        """Clip the gradient; returns ``(loss, pre-clip grad norm, tokens)`` over every rank."""
        n = self.micro_batches
        norm = clip_gradients(self.params, self.clip)
        loss_value, norm_value = all_mean(self.world, torch.stack([total.float() / n, norm.float()])).tolist()
        if self.world.distributed:
            norm_value = float(norm.float())     # the same on every rank: of the reduced gradient
            tokens *= self.world.size
        return loss_value, norm_value, tokens
