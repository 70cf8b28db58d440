"""Angular distance between the representations of consecutive blocks, per stream (arXiv 2403.17887)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from ..models.host import SchemeHost
from .adapters import LossFn, lm_loss
from .tap import StreamTap

__all__ = ["angular_distances"]


def _angle(a: Tensor, b: Tensor) -> Tensor:
    """The angle between ``a`` and ``b`` over the last dimension, over pi; accurate near 0 and pi."""
    wide = torch.promote_types(a.dtype, torch.float32)
    u = F.normalize(a.to(wide), dim=-1, eps=1e-30)
    v = F.normalize(b.to(wide), dim=-1, eps=1e-30)
    return 2 * torch.atan2((u - v).norm(dim=-1), (u + v).norm(dim=-1)) / torch.pi


@torch.no_grad()
def angular_distances(model: SchemeHost, batches: Sequence[Any], loss_fn: LossFn = lm_loss,
                      ) -> dict[str, list[float]]:
    """Per stream, the mean over positions of ``angle(h_b, h_{b+1}) / pi`` at consecutive block boundaries
    (``h_0``: the entry state): ``n_layers`` values in [0, 1]. Eval mode."""
    was_training = model.training
    model.eval()
    sums: dict[str, Tensor] = {}
    count = 0
    try:
        for batch in batches:
            with StreamTap(model) as tap:
                loss_fn(model, batch)
            blocks = tap.block_states()
            for s in blocks[0]:
                d = torch.stack([_angle(u[s], v[s]).sum() for u, v in zip(blocks, blocks[1:])]).cpu()
                sums[s] = d if s not in sums else sums[s] + d
            count += blocks[0][next(iter(blocks[0]))].shape[:-1].numel()
    finally:
        model.train(was_training)
    return {s: (v.double() / count).tolist() for s, v in sums.items()}
