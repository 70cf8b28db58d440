"""AttnRes's depth mix as Triton kernels (imported only where they run, as :mod:`._triton` is).

The ``n`` sources come as a tuple of pointers (one per source, each its own dtype; Triton
specialises on the tuple), indexed in ``tl.static_range``: no stacked copy. A token's row of
width ``D`` is one block (the tail masked). Forward reads each source once, with an online
softmax (a running maximum rescales the sum), then applies the norm. Backward recomputes the
logits and the mix in a first pass over the sources, then writes each source's gradient in a
second, from ``d a_j = v_j . gx`` and ``sum_k a_k d a_k = x . gx``; ``du`` and the norm's weight
and bias gradients are per-program partial sums over ``TOKENS`` tokens (a constexpr), as
:mod:`._triton`'s kernels write them.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._triton import (
    _block,
    _load_row,
    _norm_grad,
    _normalise,
    _param,
    _partials,
    _programs,
    _recompute,
    _reduce,
)


@triton.jit
def _logit(v, u, D, eps):
    """``u . v / rms(v)`` of one row and the two numbers it comes from, ``u . v`` and ``rstd``."""
    dot = tl.sum(u * v, axis=0)
    rstd = 1.0 / tl.sqrt(tl.sum(v * v, axis=0) / D + eps)
    return dot * rstd, dot, rstd


@triton.jit
def _mix(srcs, u, tok, cols, mask, D, eps, n: tl.constexpr, NP: tl.constexpr):
    """The mix ``x = sum_j a_j v_j`` of one token in float32, and its ``(NP,)`` logits."""
    idx = tl.arange(0, NP)
    acc = _load_row(srcs[0], tok * D + cols, mask)
    top, _, _ = _logit(acc, u, D, eps)
    logits = tl.where(idx == 0, top, float("-inf"))
    den = top * 0.0 + 1.0
    for j in tl.static_range(1, n):
        v = _load_row(srcs[j], tok * D + cols, mask)
        logit, _, _ = _logit(v, u, D, eps)
        logits = tl.where(idx == j, logit, logits)
        new = tl.maximum(top, logit)
        scale = tl.exp(top - new)
        p = tl.exp(logit - new)
        acc = acc * scale + p * v
        den = den * scale + p
        top = new
    return acc / den, logits


@triton.jit
def _depth_mix_fwd(srcs, u_ptr, w_ptr, b_ptr, out_ptr, stats_ptr, T, D, eps, norm_eps, n: tl.constexpr,
                   NP: tl.constexpr, NORM: tl.constexpr, IS_LN: tl.constexpr, HAS_W: tl.constexpr,
                   HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    u = _load_row(u_ptr, cols, mask)
    x, _ = _mix(srcs, u, tok, cols, mask, D, eps, n, NP)
    if NORM:
        xhat, mean, rstd = _normalise(x, mask, D, norm_eps, IS_LN)
        x = xhat * _param(w_ptr, cols, mask, HAS_W, 1.0) + _param(b_ptr, cols, mask, HAS_B, 0.0)
        tl.store(stats_ptr + tok, mean)
        tl.store(stats_ptr + T + tok, rstd)
    tl.store(out_ptr + tok * D + cols, x.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _depth_mix_bwd(g_ptr, srcs, u_ptr, w_ptr, stats_ptr, dsrcs, du_ptr, dw_ptr, db_ptr, T, D, eps,
                   n: tl.constexpr, NP: tl.constexpr, NORM: tl.constexpr, IS_LN: tl.constexpr,
                   HAS_W: tl.constexpr, NEED_W: tl.constexpr, NEED_B: tl.constexpr, TOKENS: tl.constexpr,
                   BLOCK: tl.constexpr):
    """``gx = norm'(g)``; with ``c_j = a_j (v_j . gx - x . gx) rstd_j``: ``dv_j = a_j gx + c_j u -
    c_j dot_j rstd_j^2 v_j / D`` and ``du = sum_j c_j v_j``."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    idx = tl.arange(0, NP)
    u = _load_row(u_ptr, cols, mask)
    w = _param(w_ptr, cols, mask, HAS_W, 1.0)
    du = tl.zeros((BLOCK,), tl.float32)
    dw = tl.zeros((BLOCK,), tl.float32)
    db = tl.zeros((BLOCK,), tl.float32)
    start = pid.to(tl.int64) * TOKENS
    for i in range(TOKENS):
        tok = start + i
        if tok < T:
            off = tok * D + cols
            x, logits = _mix(srcs, u, tok, cols, mask, D, eps, n, NP)
            weights = tl.exp(logits - tl.max(logits, axis=0))
            weights = weights / tl.sum(weights, axis=0)
            g = _load_row(g_ptr, off, mask)
            if NORM:
                xhat, rstd = _recompute(x, mask, stats_ptr, 0, T, tok, IS_LN)
                if NEED_W:
                    dw += g * xhat
                if NEED_B:
                    db += g
                g = _norm_grad(g, xhat, rstd, w, mask, D, IS_LN)
            xg = tl.sum(x * g, axis=0)
            for j in tl.static_range(n):
                v = _load_row(srcs[j], off, mask)
                _, dot, r = _logit(v, u, D, eps)
                a = tl.sum(tl.where(idx == j, weights, 0.0), axis=0)
                c = a * (tl.sum(v * g, axis=0) - xg) * r
                dv = a * g + c * u - (c * dot * r * r / D) * v
                tl.store(dsrcs[j] + off, dv.to(dsrcs[j].dtype.element_ty), mask=mask)
                du += c * v
    part = pid.to(tl.int64) * D + cols
    tl.store(du_ptr + part, du, mask=mask)
    if NEED_W:
        tl.store(dw_ptr + part, dw, mask=mask)
    if NEED_B:
        tl.store(db_ptr + part, db, mask=mask)


def _shape(sources: list[Tensor]) -> tuple[int, int, int]:
    d = sources[0].shape[-1]
    return len(sources), d, sources[0].numel() // d


def depth_mix_forward(sources: list[Tensor], u: Tensor, weight: Tensor | None, bias: Tensor | None, kind: str,
                      eps: float, norm_eps: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Sources contiguous, of one shape ``(..., d)``: ``(out, stats)``, ``stats`` ``(2, tokens)``
    float32 with a norm (``kind`` ``"rmsnorm"`` or ``"layernorm"``), else empty."""
    n, d, tokens = _shape(sources)
    out = torch.empty(sources[0].shape, dtype=dtype, device=u.device)
    normed = kind != "none"
    stats = torch.zeros((2, tokens) if normed else (0,), dtype=torch.float32, device=u.device)
    if tokens:
        block, warps = _block(d)
        _depth_mix_fwd[(tokens,)](tuple(sources), u, weight if weight is not None else u,
                                  bias if bias is not None else u, out, stats, tokens, d, eps, norm_eps, n,
                                  triton.next_power_of_2(n), NORM=normed, IS_LN=kind == "layernorm",
                                  HAS_W=weight is not None, HAS_B=bias is not None, BLOCK=block,
                                  num_warps=warps)
    return out, stats


def depth_mix_backward(grad: Tensor, sources: list[Tensor], u: Tensor, weight: Tensor | None,
                       bias: Tensor | None, stats: Tensor, kind: str, eps: float, need_w: bool,
                       need_b: bool) -> list[Tensor]:
    """``[dv_0, ..., dv_{n-1}, du, dw, db]``, each in its input's dtype (``dw``, ``db`` empty where
    not computed)."""
    n, d, tokens = _shape(sources)
    dsrcs = [torch.empty_like(v) for v in sources]
    need_w, need_b = need_w and weight is not None, need_b and bias is not None
    programs, per = _programs(u, max(tokens, 1))
    part = _partials(1 + int(need_w) + int(need_b), programs, d, u)
    du, dw, db = part[0], (part[1] if need_w else None), (part[1 + int(need_w)] if need_b else None)
    if tokens:
        block, warps = _block(d)
        _depth_mix_bwd[(programs,)](grad, tuple(sources), u, weight if weight is not None else u, stats,
                                    tuple(dsrcs), du, dw if dw is not None else u,
                                    db if db is not None else u,
                                    tokens, d, eps, n, triton.next_power_of_2(n), NORM=kind != "none",
                                    IS_LN=kind == "layernorm", HAS_W=weight is not None, NEED_W=need_w,
                                    NEED_B=need_b, TOKENS=per, BLOCK=block, num_warps=warps)
    else:
        part.zero_()
    return [*dsrcs, _reduce(du, u, u.device), _reduce(dw, weight, u.device), _reduce(db, bias, u.device)]
