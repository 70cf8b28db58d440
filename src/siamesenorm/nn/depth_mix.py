"""Softmax attention over depth with RMSNorm keys (Attention Residuals, arXiv 2603.15031), lean.

:func:`depth_mix` computes ``sum_j a_j v_j`` with ``a = softmax_j(w . RMSNorm(v_j))``, then
optionally a norm. The lean path is one autograd function that keeps only the sources, the query
and the norm's row statistics, using ``w . (g * v r) = r (v . (g * w))`` so the normalised keys
are never written. Where the kernels run, the mix and its norm are one Triton kernel each way, in
eager mode and under ``torch.compile`` (there it moves fewer bytes than Inductor's fusion;
docs/performance.md).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.autograd import Function

from .fused import (
    POINTWISE_KINDS,
    _autocast_fp32,
    _autocast_on,
    _Norm,
    _norm_kind,
    _params,
    fused_enabled,
    lean_region,
)

try:
    from ..kernels.depth_mix import depth_mix_kernel_runs, fused_depth_mix
except ImportError:     # the exported modelling code (siamesenorm.hf.export) carries no kernels
    def depth_mix_kernel_runs(sources: tuple[Tensor, ...], u: Tensor, kind: str) -> bool:
        return False

    fused_depth_mix = None

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


def _numbers(sources: tuple[Tensor, ...], u: Tensor,
             eps: float) -> tuple[list[Tensor], Tensor, Tensor, Tensor]:
    """The sources in the dtype the mix computes in, and ``(n, ...)`` per-row numbers: ``dots_j =
    v_j . u``, ``rstd_j`` and the weights ``softmax_j(dots_j rstd_j)``."""
    d = u.shape[-1]
    work = [v.float() if v.dtype in _LOW else v for v in sources]
    uw = u.to(work[0].dtype)
    dots = torch.stack([v @ uw for v in work])
    rstd = torch.stack([torch.linalg.vector_norm(v, 2, -1) for v in work])
    rstd = rstd.square_().div_(d).add_(eps).rsqrt_()
    return work, dots, rstd, (dots * rstd).softmax(0)


def _weighted_sum(work: list[Tensor], weights: Tensor) -> Tensor:
    out = work[0] * weights[0].unsqueeze(-1)
    for j in range(1, len(work)):
        out = out.addcmul_(work[j], weights[j].unsqueeze(-1))
    return out


def _mix_backward(g: Tensor, work: list[Tensor], u: Tensor, dots: Tensor, rstd: Tensor,
                  weights: Tensor) -> tuple[Tensor, list[Tensor]]:
    """Gradients of ``u`` and of each source from the gradient ``g`` of the mix. With ``logit_j =
    dot_j r_j``: ``d logit_j / d v_j = r_j u - dot_j r_j^3 v_j / d``."""
    d = u.shape[-1]
    dw = torch.stack([torch.linalg.vecdot(v, g) for v in work])              # d out / d a_j
    coef = weights * (dw - (weights * dw).sum(0, keepdim=True)) * rstd       # d out / d dot_j
    k = (coef * dots * rstd.square()).div_(-d).unsqueeze(-1)
    w, c = weights.unsqueeze(-1), coef.unsqueeze(-1)
    grads, du = [], torch.zeros_like(u)
    for j, v in enumerate(work):
        grads.append((v * k[j]).addcmul_(g, w[j]).addcmul_(c[j], u))
        du = du.addmv_(v.reshape(-1, d).t(), coef[j].reshape(-1))
    return du, grads


def _grads(du: Tensor, u: Tensor, grads: list[Tensor], sources: list[Tensor]) -> tuple:
    return (du.to(u.dtype), *(gv.to(v.dtype) for gv, v in zip(grads, sources)))


class _DepthMix(Function):
    @staticmethod
    def forward(ctx, u: Tensor, eps: float, *sources: Tensor) -> Tensor:
        work, *numbers = _numbers(sources, u, eps)
        ctx.eps = eps
        ctx.save_for_backward(u, *sources)
        return _weighted_sum(work, numbers[2]).to(sources[0].dtype)

    @staticmethod
    def backward(ctx, grad: Tensor):
        u, *sources = ctx.saved_tensors
        work, *numbers = _numbers(sources, u, ctx.eps)
        du, grads = _mix_backward(grad.to(work[0].dtype), work, u.to(work[0].dtype), *numbers)
        du, *grads = _grads(du, u, grads, sources)
        return (du, None, *grads)


class _DepthMixNorm(Function):
    """``norm(mix)``: keeps the sources, ``u`` and the norm's row statistics; backward recomputes
    the mix (and its weights) once, for the norm's backward and the mix's."""

    @staticmethod
    def forward(ctx, norm: _Norm, u: Tensor, eps: float, nw: Tensor | None, nb: Tensor | None,
                *sources: Tensor) -> Tensor:
        work, *numbers = _numbers(sources, u, eps)
        out, stats = norm.forward(_weighted_sum(work, numbers[2]).to(sources[0].dtype), nw, nb)
        ctx.norm, ctx.eps, ctx.n_stats = norm, eps, len(stats)
        ctx.save_for_backward(u, nw, nb, *stats, *sources)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        u, nw, nb, *rest = ctx.saved_tensors
        stats, sources = tuple(rest[:ctx.n_stats]), rest[ctx.n_stats:]
        work, *numbers = _numbers(sources, u, ctx.eps)
        x = _weighted_sum(work, numbers[2]).to(sources[0].dtype)
        need = ctx.needs_input_grad
        gx, dnw, dnb, _ = ctx.norm.backward(grad, x, stats, nw, nb, (True, need[3], need[4]))
        du, grads = _mix_backward(gx.to(work[0].dtype), work, u.to(work[0].dtype), *numbers)
        du, *grads = _grads(du, u, grads, sources)
        return (None, du, None, dnw, dnb, *grads)


def _mix_then_norm(norm: nn.Module, u: Tensor, eps: float, *sources: Tensor) -> Tensor:
    return norm(_DepthMix.apply(u, eps, *sources))


def _kernel_mix(sources: tuple[Tensor, ...], u: Tensor, eps: float, norm: nn.Module | None,
                kind: str) -> Tensor:
    """The mix (and norm) as ``siamesenorm::depth_mix``, written in the dtype of the ops it stands
    for: the lean path's (the first source's), or the reference path's (its product's: autocast's
    dtype under autocast, else the sources'); a norm's in float32 where CUDA's autocast runs norms
    in float32."""
    first = sources[0]
    if fused_enabled():
        dtype = first.dtype
    elif _autocast_on(first):
        dtype = torch.get_autocast_dtype(first.device.type)
    else:
        dtype = first.dtype
        for v in sources[1:]:
            dtype = torch.promote_types(dtype, v.dtype)
    if norm is not None and _autocast_fp32(first):
        dtype = torch.float32
    weight, bias = _params(norm)
    with torch.autocast(first.device.type, enabled=False):
        return fused_depth_mix(sources, u, weight, bias, kind=kind, eps=eps,
                               norm_eps=1e-6 if norm is None else norm.eps, dtype=dtype)


def depth_mix(sources: tuple[Tensor, ...], query: Tensor, key_gain: Tensor | None, eps: float,
              norm: nn.Module | None = None) -> Tensor:
    """``sum_j softmax_j(query . RMSNorm(v_j)) v_j`` (RMSNorm with gain ``key_gain`` and ``eps``),
    then ``norm`` of it if given (a siamesenorm norm)."""
    kind = "none" if norm is None else getattr(norm, "kind", None)
    if depth_mix_kernel_runs(sources, query, kind):
        return _kernel_mix(sources, query if key_gain is None else key_gain * query, eps, norm, kind)
    params = () if norm is None else tuple(norm.parameters())
    wants = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key_gain, *params, *sources)
                                            if t is not None)
    if not (fused_enabled() and wants) or torch.compiler.is_compiling():
        out = _reference(sources, query, key_gain, eps)
        return out if norm is None else norm(out)
    u = query if key_gain is None else key_gain * query
    if norm is None:
        return _DepthMix.apply(u, eps, *sources)
    kind = _norm_kind(norm)
    if kind in POINTWISE_KINDS or _autocast_on(sources[0]):
        return lean_region(_mix_then_norm, norm, u, eps, *sources)
    return _DepthMixNorm.apply(_Norm(kind, norm.eps), u, eps, *_params(norm), *sources)
