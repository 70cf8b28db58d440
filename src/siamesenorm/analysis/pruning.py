"""Layer-pruning sensitivity: how much the loss rises when blocks are skipped."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..models.host import SchemeHost
from .adapters import LossFn, lm_loss
from .tap import StreamTap, sublayers_of_blocks

__all__ = ["effective_depth", "mean_loss", "pruning_sensitivity"]


@torch.no_grad()
def mean_loss(model: SchemeHost, batches: Sequence[Any], loss_fn: LossFn = lm_loss,
              skip_blocks: Iterable[int] = ()) -> float:
    """Mean of ``loss_fn`` over ``batches`` with ``skip_blocks`` skipped, in eval mode entered afresh, so
    evaluation draws that restart there (a DiT's noise) are the same in every call."""
    skip = sublayers_of_blocks(skip_blocks)
    total = torch.zeros((), dtype=torch.float64)
    was_training = model.training
    model.train(False)
    try:
        with StreamTap(model, skip=skip, record=False):
            for batch in batches:
                total = total + loss_fn(model, batch).detach().double().cpu()
    finally:
        model.train(was_training)
    return (total / len(batches)).item()


def effective_depth(deltas: Sequence[float]) -> float:
    """Participation ratio ``(sum d)^2 / sum d^2`` of the positive loss increases ``d`` (0 when none)."""
    pos = [max(0.0, d) for d in deltas if d == d]
    square = sum(d * d for d in pos)
    return sum(pos) ** 2 / square if square > 0 else 0.0


def pruning_sensitivity(model: SchemeHost, batches: Sequence[Any], loss_fn: LossFn = lm_loss,
                        ) -> dict[str, Any]:
    """``base_loss``; ``per_block[b]``, the loss increase with block ``b`` skipped; ``depth_curve[k]``, with
    only the first ``k`` blocks run (``k = 0..n``); ``effective_depth``. Eval mode, ``2n + 1`` passes."""
    if not batches:
        raise ValueError("pruning_sensitivity needs at least one batch")
    n = model.scheme.n_layers
    was_training = model.training
    model.eval()
    try:
        base = mean_loss(model, batches, loss_fn)
        per_block = [mean_loss(model, batches, loss_fn, [b]) - base for b in range(n)]
        curve = [mean_loss(model, batches, loss_fn, range(k, n)) - base for k in range(n)] + [0.0]
    finally:
        model.train(was_training)
    return {"base_loss": base, "per_block": per_block, "depth_curve": curve,
            "effective_depth": effective_depth(per_block)}
