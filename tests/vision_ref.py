"""Float64 reference math for the ViT and DiT tests, written from the equations (papers.md 1.3)
without calling any module of the library: LayerNorm, attention, MLPs, patch embedding."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def layernorm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None,
              eps: float = 1e-6) -> Tensor:
    mean = x.mean(-1, keepdim=True)
    out = (x - mean) / torch.sqrt(((x - mean) ** 2).mean(-1, keepdim=True) + eps)
    return out if weight is None else out * weight + bias


def ln(x: Tensor, module, eps: float = 1e-6) -> Tensor:
    """Affine LayerNorm with ``module``'s weight and bias (only its parameters are read)."""
    return layernorm(x, module.weight, module.bias, eps)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    out = x @ weight.T
    return out if bias is None else out + bias


def softmax(s: Tensor) -> Tensor:
    e = torch.exp(s - s.amax(-1, keepdim=True))
    return e / e.sum(-1, keepdim=True)


def attention(x: Tensor, attn, n_heads: int) -> Tensor:
    """Full (non-causal) multi-head attention with ``attn``'s q/k/v/out weights and biases."""
    b, t, d = x.shape
    hd = d // n_heads

    def heads(y: Tensor) -> Tensor:
        return y.reshape(b, t, n_heads, hd).transpose(1, 2)

    q = heads(linear(x, attn.q_proj.weight, attn.q_proj.bias))
    k = heads(linear(x, attn.k_proj.weight, attn.k_proj.bias))
    v = heads(linear(x, attn.v_proj.weight, attn.v_proj.bias))
    weights = softmax(q @ k.transpose(-1, -2) / math.sqrt(hd))
    out = (weights @ v).transpose(1, 2).reshape(b, t, d)
    return linear(out, attn.out_proj.weight, attn.out_proj.bias)


def gelu(x: Tensor) -> Tensor:
    return 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))


def gelu_tanh(x: Tensor) -> Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def mlp(x: Tensor, mod, act) -> Tensor:
    return linear(act(linear(x, mod.up_proj.weight, mod.up_proj.bias)), mod.down_proj.weight,
                  mod.down_proj.bias)


def patch_embed(images: Tensor, conv) -> Tensor:
    """Conv with kernel = stride = p as a linear over row-major patches: ``(B, N, dim)``."""
    b, c, h, w = images.shape
    p = conv.weight.shape[-1]
    g = h // p
    patches = images.reshape(b, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(b, g * g, c * p * p)
    return linear(patches, conv.weight.reshape(conv.weight.shape[0], -1), conv.bias)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every parameter to a non-trivial value: vectors named weight ~ 1 +- 0.3, other vectors
    ~ 0.1 N(0, 1), token tensors (class token, position embedding) ~ 0.5 N(0, 1), other matrices
    ~ N(0, 1 / fan_in); zero-initialised ones included."""
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=g, dtype=p.dtype)
        if p.dim() == 1:
            p.copy_(1 + 0.3 * noise if name.endswith("weight") else 0.1 * noise)
        elif name in ("cls_token", "pos_embed"):
            p.copy_(0.5 * noise)
        else:
            p.copy_(noise / math.sqrt(p[0].numel()))
    return model
