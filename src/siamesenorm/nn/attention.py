"""Multi-head self-attention: causal or not, RoPE, grouped-query attention, per-head QK(V)-norm,
value residuals, Depth-Attention and a KV cache."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import UserError
from .depth_attention import DepthKeysValues, depth_mix
from .fused import _autocast_on, fused_enabled, norm_value, recomputed_inputs
from .legacy import LegacyStateNames
from .norms import build_norm
from .rope import RotaryEmbedding
from .value_residual import VALUE_RESIDUAL_MIXES, FirstValues, ValueMix


class KVCache:
    """Preallocated keys and values, ``(batch, n_kv_heads, max_len, head_dim)`` per layer, for
    incremental decoding; positions below ``length`` are valid (the model sets it)."""

    def __init__(self, n_layers: int, batch_size: int, n_kv_heads: int, max_len: int,
                 head_dim: int, *, device=None, dtype=None) -> None:
        shape = (batch_size, n_kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layers)]
        self.max_len = max_len
        self.length = 0

    def update(self, layer: int, k: Tensor, v: Tensor, pos: int) -> tuple[Tensor, Tensor]:
        """Write ``k``, ``v`` (``(B, H_kv, T, D)``) at ``pos``; return all keys/values up to it."""
        end = pos + k.shape[-2]
        if pos < 0 or pos > self.length or end > self.max_len:
            raise ValueError(f"KV cache write at positions {pos}..{end - 1} is invalid: the cache "
                             f"holds {self.length} of at most {self.max_len} positions")
        self.k[layer][:, :, pos:end] = k
        self.v[layer][:, :, pos:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]

    def reset(self) -> None:
        self.length = 0


def head_norm(kind: str, head_dim: int, eps: float = 1e-5, *, affine: bool = True, device=None,
              dtype=None) -> nn.Module:
    """A ``kind`` norm over ``head_dim`` whose weights the heads share (QK-norm, QKV-norm)."""
    return build_norm(kind, head_dim, eps, affine=affine, role="attention", device=device, dtype=dtype)


def norm_heads(norm: nn.Module | None, x: Tensor, head_dim: int, *, recompute: bool = False) -> Tensor:
    """``x`` (..., n * head_dim) split into heads (..., n, head_dim), each normalised by ``norm``
    (``None``: not); ``recompute``: the same value without autograd."""
    x = x.unflatten(-1, (-1, head_dim))
    if norm is None:
        return x
    return norm_value(norm, x) if recompute else norm(x)


HEAD_NORMED = ("q_proj", "k_proj", "v_proj")


def head_norm_name(projection: str) -> str:
    """The sibling norm of a projection under :class:`HeadNormedAttention` (``v_proj`` -> ``v_head_norm``)."""
    return projection.removesuffix("_proj") + "_head_norm"


class _NormedProjection:
    """``proj(x)`` normalised per head by ``norm``."""

    __slots__ = ("head_dim", "norm", "proj")

    def __init__(self, proj: nn.Module, norm: nn.Module, head_dim: int) -> None:
        self.proj, self.norm, self.head_dim = proj, norm, head_dim

    def __call__(self, x: Tensor) -> Tensor:
        return norm_heads(self.norm, self.proj(x), self.head_dim).flatten(-2)


class HeadNormedAttention(LegacyStateNames):
    """Mixed in before a model's attention class whose forward calls ``self.q_proj(x)`` etc. (a Hugging
    Face family's): QKV-norm without touching that code. While ``forward`` runs, ``self.v_proj``
    reads as its sibling norm ``v_head_norm`` after ``v_proj``. Needs ``head_dim``."""

    def forward(self, *args, **kwargs):
        self.__dict__["_normed_view"] = True
        try:
            return super().forward(*args, **kwargs)
        finally:
            self.__dict__["_normed_view"] = False

    def __getattr__(self, name: str):
        value = super().__getattr__(name)
        if name in HEAD_NORMED and self.__dict__.get("_normed_view"):
            norm = self._modules.get(head_norm_name(name))
            if norm is not None:
                return _NormedProjection(value, norm, self.head_dim)
        return value

    # the earlier layout's state names (a wrapper module per projection) -> these
    legacy_state_names = {**{f"{p}.proj.": f"{p}." for p in HEAD_NORMED},
                          **{f"{p}.norm.": f"{head_norm_name(p)}." for p in HEAD_NORMED}}


def causal_mask(t_query: int, t_key: int, pos: int, device=None) -> Tensor:
    """Boolean ``(t_query, t_key)`` mask: query ``i`` (position ``pos + i``) sees keys up to it."""
    return torch.ones(t_query, t_key, dtype=torch.bool, device=device).tril(diagonal=pos)


class Attention(nn.Module):
    """Self-attention with separate ``q_proj``, ``k_proj``, ``v_proj`` and ``out_proj``.

    ``n_kv_heads`` must divide ``n_heads`` (grouped-query attention); ``qkv_norm`` implies ``qk_norm``,
    which spans all heads with ``qk_norm_per_head=False``; ``layer_idx`` is this layer's
    :class:`KVCache` entry; ``value_weights`` are ``(own, first)``; with ``depth_attention``,
    ``forward`` needs ``depth_kv``."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int | None = None, *,
                 max_seq_len: int = 2048, rope_theta: float = 10000.0, qk_norm: bool = False,
                 qkv_norm: bool = False, norm: str = "rmsnorm", norm_eps: float = 1e-5,
                 bias: bool = False, dropout: float = 0.0, layer_idx: int = 0,
                 causal: bool = True, rope: bool = True, value_residual: str | None = None,
                 value_weights: tuple[float, float] = (0.5, 0.5), head_dim: int | None = None,
                 qk_norm_per_head: bool = True, depth_attention: bool = False, device=None,
                 dtype=None) -> None:
        super().__init__()
        n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        if head_dim is None and dim % n_heads:
            raise UserError(f"dim ({dim}) must be divisible by n_heads ({n_heads})")
        if n_kv_heads <= 0 or n_heads % n_kv_heads:
            raise UserError(f"n_heads ({n_heads}) must be divisible by n_kv_heads ({n_kv_heads})")
        if value_residual not in (None, *VALUE_RESIDUAL_MIXES):
            raise UserError(f"value_residual must be None or one of {', '.join(VALUE_RESIDUAL_MIXES)}, "
                              f"got {value_residual!r}")
        kw = {"device": device, "dtype": dtype}
        self.dim, self.n_heads, self.n_kv_heads = dim, n_heads, n_kv_heads
        self.head_dim = dim // n_heads if head_dim is None else head_dim
        self.dropout, self.layer_idx, self.causal = dropout, layer_idx, bool(causal)
        q_dim, kv_dim = n_heads * self.head_dim, n_kv_heads * self.head_dim
        self.q_proj = nn.Linear(dim, q_dim, bias=bias, **kw)
        self.k_proj = nn.Linear(dim, kv_dim, bias=bias, **kw)
        self.v_proj = nn.Linear(dim, kv_dim, bias=bias, **kw)
        self.out_proj = nn.Linear(q_dim, dim, bias=bias, **kw)
        # QKV-norm (HybridNorm) is per head; a QK-norm alone may span all heads (OLMo2)
        self.whole_width_qk_norm = qk_norm and not qkv_norm and not qk_norm_per_head

        def per_head(wanted: bool, width: int) -> nn.Module | None:
            size = width if self.whole_width_qk_norm else self.head_dim
            return head_norm(norm, size, norm_eps, **kw) if wanted else None

        self.q_norm = per_head(qk_norm or qkv_norm, q_dim)
        self.k_norm = per_head(qk_norm or qkv_norm, kv_dim)
        self.v_norm = per_head(qkv_norm, kv_dim)
        self.rope = RotaryEmbedding(self.head_dim, max_seq_len, rope_theta, **kw) if rope else None
        self.value_residual = value_residual
        self.value_mix = ValueMix(*value_weights, learned=value_residual == "learned", **kw) \
            if value_residual is not None and layer_idx > 0 else None
        self.depth_attention = bool(depth_attention)

    def reset_parameters(self) -> None:
        for module in (self.q_proj, self.k_proj, self.v_proj, self.out_proj,
                       self.q_norm, self.k_norm, self.v_norm, self.rope, self.value_mix):
            if module is not None:
                module.reset_parameters()

    def _heads(self, x: Tensor, norm: nn.Module | None, pos: int | Tensor, rotate: bool,
               recompute: bool = False) -> Tensor:
        """``(B, T, n * head_dim)`` -> ``(B, n, T, head_dim)``, normalised and rotated if asked."""
        if norm is not None and self.whole_width_qk_norm:      # over all heads, before the split
            x, norm = (norm_value(norm, x) if recompute else norm(x)), None
        x = norm_heads(norm, x, self.head_dim, recompute=recompute).transpose(1, 2)
        return self.rope(x, pos) if rotate and self.rope is not None else x

    def _recipes(self, inputs: dict) -> dict:
        """The lean path's recipes: the normalised q, k, v recomputed from their projections, not kept."""
        return {id(out): partial(self._heads, proj, norm, pos, rotate, recompute=True)
                for proj, norm, rotate, out, pos in inputs.values() if norm is not None}

    def forward(self, x: Tensor, *, cache: KVCache | None = None, pos: int = 0,
                positions: Tensor | None = None, key_mask: Tensor | None = None,
                first_values: FirstValues | None = None,
                depth_kv: DepthKeysValues | None = None) -> Tensor:
        """Attend over ``x`` (B, T, dim) and, with a cache, its earlier keys.

        ``positions`` (B, T) overrides the RoPE positions and ``key_mask`` (B, T_key; cached + new keys)
        marks real tokens, for left-padded batches; a query always sees its own key. ``first_values``
        (value residual) and ``depth_kv`` (Depth-Attention) are one per forward pass."""
        b, t, _ = x.shape
        rot = pos if positions is None else positions
        parts = {}
        for name, proj, norm, rotate in (("q", self.q_proj, self.q_norm, True),
                                         ("k", self.k_proj, self.k_norm, True),
                                         ("v", self.v_proj, self.v_norm, False)):
            p = proj(x)
            parts[name] = (p, norm, rotate, self._heads(p, norm, rot, rotate), rot)
        q, k, v = (parts[name][3] for name in "qkv")
        if self.value_residual is not None:
            v = self._value_residual(v, first_values)
        lean = (cache is None and fused_enabled() and torch.is_grad_enabled()
                and not _autocast_on(x))
        recipes = self._recipes(parts) if lean else {}
        if self.depth_attention:
            with recomputed_inputs(recipes):     # the depth mix keeps q and k as attention does
                v = self._depth_attention(q, k, v, depth_kv)
        if cache is not None:
            k, v = cache.update(self.layer_idx, k, v, pos)
        t_key = k.shape[-2]
        mask, is_causal = None, False  # non-causal: every query sees every key
        if self.causal and t_key == t:
            is_causal = t > 1  # keys and queries cover the same positions
        elif self.causal and t > 1:
            mask = causal_mask(t, t_key, t_key - t, device=x.device)
        if key_mask is not None:
            if key_mask.shape != (b, t_key):
                raise ValueError(f"key_mask of shape {tuple(key_mask.shape)} does not match "
                                 f"{b} sequences of {t_key} keys")
            seen = key_mask.bool()[:, None, None, :]                     # (B, 1, 1, T_key)
            if mask is None and is_causal:
                mask = causal_mask(t, t_key, t_key - t, device=x.device)
            self_key = causal_mask(t, t_key, t_key - t, device=x.device) \
                & ~causal_mask(t, t_key, t_key - t - 1, device=x.device)  # query i's own key
            mask = (seen if mask is None else seen & mask) | self_key
            is_causal = False
        with recomputed_inputs(recipes):
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=is_causal,
                dropout_p=self.dropout if self.training else 0.0,
                enable_gqa=self.n_kv_heads != self.n_heads)
        y = self.out_proj(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))
        return F.dropout(y, self.dropout, self.training)

    def _value_residual(self, v: Tensor, first_values: FirstValues | None) -> Tensor:
        if first_values is None:
            raise ValueError("attention with a value residual needs first_values=FirstValues(), "
                             "one per forward pass")
        if self.value_mix is None:
            first_values.keep(0, v)
            return v
        if first_values.values is None:
            raise ValueError(f"attention layer {self.layer_idx} mixes in the first layer's values, "
                             "but layer 0 has not run in this forward pass")
        return self.value_mix(v, first_values.values)

    def _depth_attention(self, q: Tensor, k: Tensor, v: Tensor,
                         depth_kv: DepthKeysValues | None) -> Tensor:
        if depth_kv is None:
            raise ValueError("attention with Depth-Attention needs depth_kv=DepthKeysValues(stride), "
                             "one per forward pass")
        v = depth_mix(q, k, v, *depth_kv.sources(self.layer_idx))
        depth_kv.keep(self.layer_idx, (k, v))
        return v

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, n_heads={self.n_heads}, n_kv_heads={self.n_kv_heads}, "
                f"head_dim={self.head_dim}, layer_idx={self.layer_idx}, causal={self.causal}, "
                f"rope={self.rope is not None}"
                + (", depth_attention=True" if self.depth_attention else ""))
