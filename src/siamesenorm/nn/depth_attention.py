"""Depth-Attention (arXiv 2606.05014): each attention layer's values become a softmax mix, along
depth, of some earlier layers' values and its own (equations: docs/schemes.md)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor
from torch.autograd import Function

from ..errors import UserError
from .carrier import LayerCarrier
from .fused import fused_enabled

__all__ = ["DepthKeysValues", "check_depth_attention", "depth_mix", "depth_stride"]


def check_depth_attention(enabled: object, stride: object) -> None:
    """Refuse a ``model.depth_attention`` or ``model.depth_attention_stride`` that is not one."""
    if not isinstance(enabled, bool):
        raise UserError(f"model.depth_attention must be true or false, got {enabled!r}")
    if stride is not None and (not isinstance(stride, int) or isinstance(stride, bool) or stride < 1):
        raise UserError(f"model.depth_attention_stride must be a positive integer or null, got {stride!r}")
    if stride is not None and not enabled:
        raise UserError("model.depth_attention_stride is set but model.depth_attention is false; add "
                        "model.depth_attention=true")


def depth_stride(stride: int | None, n_layers: int) -> int:
    return max(1, n_layers // 2) if stride is None else stride


class DepthKeysValues(LayerCarrier):
    """The source layers' keys and mixed values, ``(B, n_kv_heads, T, head_dim)``; one per forward."""

    def __init__(self, stride: int) -> None:
        if stride < 1:
            raise ValueError(f"the depth-attention stride must be at least 1, got {stride}")
        super().__init__()
        self.stride = int(stride)

    def empty(self) -> DepthKeysValues:
        return DepthKeysValues(self.stride)

    def sources(self, layer: int) -> tuple[list[Tensor], list[Tensor]]:
        wanted = range(0, layer, self.stride)
        missing = [j for j in wanted if j not in self.held]
        if missing:
            raise ValueError(f"attention layer {layer} attends over the depth of layer {missing[0]}, "
                             "which has not run in this forward pass")
        return [self.held[j][0] for j in wanted], [self.held[j][1] for j in wanted]

    def keep(self, layer: int, item: tuple[Tensor, Tensor]) -> None:
        if layer % self.stride == 0:
            super().keep(layer, item)


def depth_mix(q: Tensor, k: Tensor, v: Tensor, source_keys: Sequence[Tensor],
              source_values: Sequence[Tensor]) -> Tensor:
    """``vmix``: ``q`` (B, n_heads, T, D); ``k``, ``v`` and each source (B, n_kv_heads, T, D). The
    softmax runs in float32 at least."""
    if not source_keys:
        return v
    if fused_enabled() and torch.is_grad_enabled():
        return _LeanDepthMix.apply(len(source_keys), q, k, v, *source_keys, *source_values)
    b, h, t, d = q.shape
    qbar = q.unflatten(1, (k.shape[1], h // k.shape[1])).mean(2)       # (B, Hkv, T, D)
    keys = torch.stack((*source_keys, k), dim=-2)                       # (B, Hkv, T, N+1, D)
    scores = torch.einsum("bgtd,bgtnd->bgtn", qbar, keys) / math.sqrt(d)
    weights = scores.softmax(-1, dtype=torch.promote_types(scores.dtype, torch.float32))
    values = torch.stack((*source_values, v), dim=-2)
    return torch.einsum("bgtn,bgtnd->bgtd", weights.to(v.dtype), values)


def _group_mean(q: Tensor, groups: int) -> Tensor:
    return q.unflatten(1, (groups, q.shape[1] // groups)).mean(2)


class _LeanDepthMix(Function):
    """:func:`depth_mix` source by source. Backward (``w`` the weights, ``g`` the gradient of ``vmix``):
    ``ds_j = w_j (<g, V_j> - sum_i w_i <g, V_i>) / sqrt(D)``, ``dK_j = ds_j qbar``, ``dV_j = w_j g``."""

    @staticmethod
    def forward(ctx, n: int, q: Tensor, k: Tensor, v: Tensor, *sources: Tensor) -> Tensor:
        keys, values = (*sources[:n], k), (*sources[n:], v)
        qbar = _group_mean(q, k.shape[1])
        scores = torch.stack([(qbar * key).sum(-1) for key in keys]) / math.sqrt(q.shape[-1])
        weights = scores.softmax(0, dtype=torch.promote_types(scores.dtype, torch.float32))
        w = weights.to(v.dtype)
        out = w[0, ..., None] * values[0]
        for j in range(1, n + 1):
            out.addcmul_(w[j, ..., None], values[j])
        ctx.n = n
        ctx.save_for_backward(q, weights, *keys, *values)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        n = ctx.n
        q, weights, *rest = ctx.saved_tensors
        keys, values = rest[:n + 1], rest[n + 1:]
        b, h, t, d = q.shape
        groups = keys[0].shape[1]
        qbar = _group_mean(q, groups)
        dots = torch.stack([(g * value).sum(-1).to(weights.dtype) for value in values])
        ds = (weights * (dots - (weights * dots).sum(0, keepdim=True)) / math.sqrt(d)).to(q.dtype)
        dqbar = ds[0, ..., None] * keys[0]
        for j in range(1, n + 1):
            dqbar.addcmul_(ds[j, ..., None], keys[j])
        per_head = (dqbar / (h // groups)).unsqueeze(2).expand(b, groups, h // groups, t, d)
        w = weights.to(g.dtype)
        dkeys = [ds[j, ..., None] * qbar for j in range(n + 1)]
        dvalues = [w[j, ..., None] * g for j in range(n + 1)]
        return (None, per_head.reshape(b, h, t, d), dkeys[n], dvalues[n], *dkeys[:n], *dvalues[:n])
