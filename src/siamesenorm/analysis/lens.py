"""Logit lens per stream: which stream's reading of the vocabulary the model's prediction follows."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..models.host import SchemeHost
from ..schemes.base import ResidualScheme
from .adapters import HeadFn, LossFn, lm_head, lm_loss
from .tap import StreamTap

__all__ = ["logit_lens", "plain_norm"]


def plain_norm(scheme: ResidualScheme, x: Tensor) -> Tensor:
    """``x`` normalised by the parameter-free norm of the scheme's kind (RMSNorm for DyT)."""
    x = x.to(torch.promote_types(x.dtype, torch.float32))
    if scheme.norm_kind == "layernorm":
        return F.layer_norm(x, x.shape[-1:], eps=scheme.eps)
    return F.rms_norm(x, x.shape[-1:], eps=scheme.eps)


def _prediction(model: nn.Module, head_fn: HeadFn, hidden: Tensor, like: Tensor) -> Tensor:
    return head_fn(model, hidden.to(like.dtype)).argmax(dim=-1)


@torch.no_grad()
def logit_lens(model: SchemeHost, batches: Sequence[Any], loss_fn: LossFn = lm_loss,
               head_fn: HeadFn = lm_head) -> dict[str, Any]:
    """The per-stream logit lens over ``batches`` as docs/analysis.md defines it, in eval mode: ``positions``,
    ``agreement``, ``disagree_fraction``, ``follows`` and ``by_depth``."""
    was_training = model.training
    model.eval()
    agree: dict[str, Tensor] = {}
    follows: dict[str, Tensor] = {}
    depth: dict[str, list[Tensor]] = {}
    positions, disagree = 0, torch.zeros((), dtype=torch.int64)
    try:
        for batch in batches:
            with StreamTap(model) as tap:
                loss_fn(model, batch)
            final = _prediction(model, head_fn, tap.output, tap.output)
            last = tap.states[-1]
            out = tap.output
            lens = {s: _prediction(model, head_fn, plain_norm(tap.scheme, t), out) for s, t in last.items()}
            preds = torch.stack(list(lens.values()))
            split = (preds != preds[0]).any(dim=0)
            positions += final.numel()
            disagree = disagree + split.sum().cpu()
            for s, p in lens.items():
                hit = p == final
                agree[s] = agree.get(s, 0) + hit.sum().cpu()
                follows[s] = follows.get(s, 0) + (hit & split).sum().cpu()
                counts = [(_prediction(model, head_fn, plain_norm(tap.scheme, b[s]), out) == final)
                          .sum().cpu() for b in tap.block_states()]
                depth[s] = counts if s not in depth else [a + c for a, c in zip(depth[s], counts)]
    finally:
        model.train(was_training)
    n_split = int(disagree)
    return {
        "positions": positions,
        "agreement": {s: int(v) / positions for s, v in agree.items()},
        "disagree_fraction": n_split / positions,
        "follows": {s: (int(v) / n_split if n_split else None) for s, v in follows.items()},
        "by_depth": {s: [int(c) / positions for c in v] for s, v in depth.items()},
    }
