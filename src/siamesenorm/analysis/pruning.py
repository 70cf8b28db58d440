"""Layer-pruning sensitivity: how much the loss rises when blocks are skipped.

The SiameseNorm paper (arXiv 2602.08064, Fig. 2c) removes one layer at a time from trained
models: Pre-Norm barely notices, SiameseNorm loses noticeably, most in the middle layers, which the
paper reads as better use of depth. Skipping a block here means both of its sublayers' steps return
the state unchanged (:class:`~.tap.StreamTap`), so the block's branches and the scheme's norms of
that block are bypassed together, whatever the scheme.
"""

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
    """Mean of ``loss_fn`` over ``batches`` with the blocks ``skip_blocks`` skipped, in eval mode.

    Each call enters eval mode afresh (the model's mode is restored afterwards), so a model whose
    evaluation draws restart there (a DiT's :class:`~siamesenorm.diffusion.DiffusionObjective`
    reseeds its timesteps and noise) sees the same draws in every call: losses of different
    ``skip_blocks`` then differ by the skipped blocks only, not by the noise.
    """
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
    """Participation ratio ``(sum d)^2 / sum d^2`` of the positive loss increases ``d``.

    It counts how many blocks the loss depends on: ``n`` when skipping any of ``n`` blocks costs
    the same, 1 when only one block matters, 0 when none does. Negative increases count as 0.
    """
    pos = [max(0.0, d) for d in deltas if d == d]
    square = sum(d * d for d in pos)
    return sum(pos) ** 2 / square if square > 0 else 0.0


def pruning_sensitivity(model: SchemeHost, batches: Sequence[Any], loss_fn: LossFn = lm_loss,
                        ) -> dict[str, Any]:
    """Loss increase when each block is skipped, and when only the first ``k`` blocks run.

    Returns ``base_loss``; ``per_block[b]`` = loss with block ``b`` skipped minus ``base_loss``;
    ``depth_curve[k]`` = loss with blocks ``k..n-1`` skipped minus ``base_loss``, for ``k = 0..n``
    (the effective-depth curve: how much of the loss the first ``k`` blocks already achieve;
    ``depth_curve[n]`` is 0); ``effective_depth`` = :func:`effective_depth` of ``per_block``.
    The model runs in eval mode (restored afterwards); ``2 n + 1`` passes over ``batches``.
    """
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
