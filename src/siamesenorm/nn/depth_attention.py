"""Depth-Attention (arXiv 2606.05014): each attention layer's values become a softmax mix, along
depth, of some earlier layers' values and its own (equations: docs/schemes.md)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor
from torch.autograd import Function

from ..errors import UserError
from .carrier import LayerCarrier
from .fused import fused_enabled

__all__ = ["DepthKeysValues", "DepthMixedValues", "check_depth_attention", "depth_mix", "depth_stride"]


def check_depth_attention(enabled: object, stride: object, *, owner: str = "model.",
                          true: str = "true") -> None:
    """Refuse a ``depth_attention`` or ``depth_attention_stride`` that is not one (``owner``, ``true``:
    how the caller spells the key and true)."""
    false, null = ("false", "null") if true == "true" else ("False", "None")
    if not isinstance(enabled, bool):
        raise UserError(f"{owner}depth_attention must be {true} or {false}, got {enabled!r}")
    if stride is not None and (not isinstance(stride, int) or isinstance(stride, bool) or stride < 1):
        raise UserError(f"{owner}depth_attention_stride must be a positive integer or {null}, got "
                        f"{stride!r}")
    if stride is not None and not enabled:
        raise UserError(f"{owner}depth_attention_stride is set but {owner}depth_attention is {false}; "
                        f"add {owner}depth_attention={true}")


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

    def mix(self, layer: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        """Attention layer ``layer``'s values mixed along depth (``q``, ``k``, ``v`` as :func:`depth_mix`
        takes them, as the attention reads them), kept for the later layers."""
        v = depth_mix(q, k, v, *self.sources(layer))
        self.keep(layer, (k, v))
        return v


_PROJECTIONS = ("q_proj", "k_proj", "v_proj")


class DepthMixedValues:
    """Mixed in before an attention class whose forward calls ``self.q_proj(x)``, ``self.k_proj(x)``,
    then ``self.v_proj(x)`` (a Hugging Face family's): in ``forward(..., depth_kv=...)`` ``v_proj``
    returns the values mixed along depth, scored with q and k as the attention reads them (its
    ``q_norm``, ``k_norm``, then ``depth_rotation(q, k, *position_embeddings)``). Needs ``head_dim``,
    ``layer_idx``."""

    depth_rotation: Callable[..., tuple[Tensor, Tensor]] | None = None

    def forward(self, *args: Any, depth_kv: DepthKeysValues | None = None, **kwargs: Any) -> Any:
        if depth_kv is None:
            raise ValueError(f"{type(self).__name__} runs Depth-Attention: its forward needs "
                             "depth_kv=DepthKeysValues(stride), one per forward pass")
        rope = kwargs.get("position_embeddings", args[1] if len(args) > 1 else None)
        self.__dict__["_depth_call"] = {"kv": depth_kv, "rope": rope}
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.__dict__.pop("_depth_call", None)

    def __getattr__(self, name: str) -> Any:
        value = super().__getattr__(name)
        call = self.__dict__.get("_depth_call")
        if call is not None and name in _PROJECTIONS:
            return partial(self._depth_projection, name, value, call)
        return value

    def _depth_projection(self, name: str, proj: Callable[[Tensor], Tensor], call: dict,
                          x: Tensor) -> Tensor:
        out = proj(x)
        if name != "v_proj":
            call[name] = out
            return out
        if "q_proj" not in call or "k_proj" not in call:
            raise RuntimeError(f"{type(self).__name__}: v_proj ran before q_proj and k_proj, so "
                               "Depth-Attention has no query and key to score with")
        q = self._depth_heads(call.pop("q_proj"), "q_norm")
        k = self._depth_heads(call.pop("k_proj"), "k_norm")
        if self.depth_rotation is not None and call["rope"] is not None:
            q, k = self.depth_rotation(q, k, *call["rope"])
        v = out.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)
        return call["kv"].mix(self.layer_idx, q, k, v).transpose(1, 2).flatten(-2)

    def _depth_heads(self, x: Tensor, norm_name: str) -> Tensor:
        """``(B, T, n * head_dim)`` -> ``(B, n, T, head_dim)``, through the attention's norm (per head
        or over the whole width, as its size says)."""
        norm = getattr(self, norm_name, None)
        if isinstance(norm, torch.nn.Module):
            weight = getattr(norm, "weight", None)
            width = weight.shape[-1] if isinstance(weight, Tensor) else getattr(norm, "dim", None)
            x = norm(x) if width == x.shape[-1] else norm(x.unflatten(-1, (-1, self.head_dim))).flatten(-2)
        return x.unflatten(-1, (-1, self.head_dim)).transpose(1, 2)


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
