"""Softmax attention over depth with RMSNorm keys (Attention Residuals, arXiv 2603.15031), lean.

:func:`depth_mix` computes ``sum_j a_j v_j`` with ``a = softmax_j(w . RMSNorm(v_j))`` over sources
``v_j`` of shape ``(..., d)``. The reference path composes modules (stack, norm, product, softmax,
weighted sum). The lean path is one autograd function that keeps only the sources (alive anyway:
they are the scheme's state) and per-row numbers; it uses ``w . (g * v r) = r (v . (g * w))`` with
``r = 1 / sqrt(mean(v^2) + eps)``, so the normalised keys are never written, and its backward is
the analytic one. Half inputs are mixed with float32 logits and weights.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd import Function

from .fused import fused_enabled

__all__ = ["depth_mix"]

_LOW = (torch.float16, torch.bfloat16)


def _reference(sources: tuple[Tensor, ...], query: Tensor, key_gain: Tensor | None, eps: float) -> Tensor:
    values = torch.stack(sources)                                              # (n, ..., d)
    work = values.float() if values.dtype in _LOW else values
    keys = work * torch.rsqrt(work.pow(2).mean(-1, keepdim=True) + eps)
    if key_gain is not None:
        keys = keys * key_gain.to(work.dtype)
    weights = (keys @ query.to(work.dtype)).softmax(0).to(values.dtype)       # (n, ...)
    return torch.einsum("n...,n...d->...d", weights, values)


class _DepthMix(Function):
    @staticmethod
    def forward(ctx, u: Tensor, eps: float, *sources: Tensor) -> Tensor:
        d = u.shape[-1]
        work = [v.float() if v.dtype in _LOW else v for v in sources]
        uw = u.to(work[0].dtype)
        dots = torch.stack([v @ uw for v in work])                                    # (n, ...)
        rstd = torch.stack([torch.linalg.vector_norm(v, 2, -1).square_().div_(d).add_(eps).rsqrt_()
                            for v in work])
        weights = (dots * rstd).softmax(0)
        out = work[0] * weights[0].unsqueeze(-1)
        for j in range(1, len(work)):
            out = out.addcmul_(work[j], weights[j].unsqueeze(-1))
        ctx.save_for_backward(u, dots, rstd, weights, *sources)
        return out.to(sources[0].dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        u, dots, rstd, weights, *sources = ctx.saved_tensors
        d = u.shape[-1]
        work = [v.float() if v.dtype in _LOW else v for v in sources]
        g = grad.to(work[0].dtype)
        dw = torch.stack([torch.linalg.vecdot(v, g) for v in work])               # d out / d a_j
        ds = weights * (dw - (weights * dw).sum(0, keepdim=True))                 # softmax
        coef = ds * rstd                                                          # d logit_j / d dot_j
        uw = u.to(g.dtype)
        grads, du = [], torch.zeros_like(uw)
        for j, v in enumerate(work):
            # logit_j = dot_j r_j: d/dv = r_j u - dot_j r_j^3 v / d; plus a_j g from the sum
            c = coef[j].unsqueeze(-1)
            gv = g * weights[j].unsqueeze(-1) + c * uw
            gv = gv.addcmul_(v, (-(coef[j] * dots[j] * rstd[j].square()) / d).unsqueeze(-1))
            grads.append(gv.to(sources[j].dtype))
            du = du + torch.mv(v.reshape(-1, d).t(), coef[j].reshape(-1))
        return (du.to(u.dtype), None, *grads)


def depth_mix(sources: tuple[Tensor, ...], query: Tensor, key_gain: Tensor | None, eps: float) -> Tensor:
    """``sum_j softmax_j(query . RMSNorm(v_j)) v_j`` (RMSNorm with gain ``key_gain`` and ``eps``)."""
    wants = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key_gain, *sources)
                                            if t is not None)
    if not (fused_enabled() and wants) or torch.compiler.is_compiling():
        return _reference(sources, query, key_gain, eps)
    u = query if key_gain is None else key_gain * query
    return _DepthMix.apply(u, eps, *sources)
