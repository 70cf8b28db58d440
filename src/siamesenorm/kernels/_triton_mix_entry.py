"""mHC's entry as Triton kernels (imported only where they run, as :mod:`._triton` is): the branch
input ``b = norm(sum_k pre_k H_k)`` of one token per program, its row of width ``D`` one block
(``D <= BLOCK``, the tail masked), the sum over the ``n`` streams in float32 and never stored.
Backward walks ``TOKENS`` tokens per program (a constexpr), sums the streams again from the saved
row statistics, and writes per-program partial sums of the norm's weight and bias gradients, as
:mod:`._triton`'s kernels do (whose pieces these use).
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


# ---- b = norm(sum_k pre_k H_k) -----------------------------------------------------------------------
@triton.jit
def _collapse(h_ptr, pre_ptr, tok, cols, mask, D, n: tl.constexpr):
    """``u = sum_k pre_k H_k`` of one token in float32 (zero in the masked tail)."""
    u = tl.zeros(cols.shape, tl.float32)
    for k in tl.static_range(n):
        u += tl.load(pre_ptr + tok * n + k).to(tl.float32) * _load_row(h_ptr, (tok * n + k) * D + cols, mask)
    return u


@triton.jit
def _mix_entry_fwd(h_ptr, pre_ptr, w_ptr, b_ptr, out_ptr, stats_ptr, T, D, eps, n: tl.constexpr,
                   IS_LN: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    u = _collapse(h_ptr, pre_ptr, tok, cols, mask, D, n)
    uhat, mean, rstd = _normalise(u, mask, D, eps, IS_LN)
    out = uhat * _param(w_ptr, cols, mask, HAS_W, 1.0) + _param(b_ptr, cols, mask, HAS_B, 0.0)
    tl.store(out_ptr + tok * D + cols, out.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(stats_ptr + tok, mean)
    tl.store(stats_ptr + T + tok, rstd)


@triton.jit
def _mix_entry_bwd(g_ptr, h_ptr, pre_ptr, w_ptr, stats_ptr, dh_ptr, dpre_ptr, dw_ptr, db_ptr, T, D,
                   n: tl.constexpr, IS_LN: tl.constexpr, HAS_W: tl.constexpr, NEED_W: tl.constexpr,
                   NEED_B: tl.constexpr, TOKENS: tl.constexpr, BLOCK: tl.constexpr):
    """``du = norm'(g)``, ``dH_k = pre_k du``, ``dpre_k = <H_k, du>``; weight and bias gradients as
    per-program partial sums."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    w = _param(w_ptr, cols, mask, HAS_W, 1.0)
    dw = tl.zeros((BLOCK,), tl.float32)
    db = tl.zeros((BLOCK,), tl.float32)
    start = pid.to(tl.int64) * TOKENS
    for i in range(TOKENS):
        tok = start + i
        if tok < T:
            u = _collapse(h_ptr, pre_ptr, tok, cols, mask, D, n)
            uhat, rstd = _recompute(u, mask, stats_ptr, 0, T, tok, IS_LN)
            g = _load_row(g_ptr, tok * D + cols, mask)
            du = _norm_grad(g, uhat, rstd, w, mask, D, IS_LN)
            for k in tl.static_range(n):
                off = (tok * n + k) * D + cols
                p = tl.load(pre_ptr + tok * n + k).to(tl.float32)
                tl.store(dh_ptr + off, (p * du).to(dh_ptr.dtype.element_ty), mask=mask)
                dp = tl.sum(_load_row(h_ptr, off, mask) * du, axis=0)
                tl.store(dpre_ptr + tok * n + k, dp.to(dpre_ptr.dtype.element_ty))
            if NEED_W:
                dw += g * uhat
            if NEED_B:
                db += g
    if NEED_W:
        tl.store(dw_ptr + pid.to(tl.int64) * D + cols, dw, mask=mask)
    if NEED_B:
        tl.store(db_ptr + pid.to(tl.int64) * D + cols, db, mask=mask)


def mix_entry_forward(h: Tensor, pre: Tensor, weight: Tensor | None, bias: Tensor | None, layernorm: bool,
                      eps: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``h`` (..., n, d) and ``pre`` (..., n) contiguous: ``(b, stats)``, ``stats`` (2, tokens)."""
    n, d = h.shape[-2], h.shape[-1]
    tokens = h.numel() // (n * d)
    out = torch.empty((*h.shape[:-2], d), dtype=dtype, device=h.device)
    stats = torch.zeros((2, tokens), dtype=torch.float32, device=h.device)
    if tokens:
        block, warps = _block(d)
        w, b = (weight if weight is not None else h), (bias if bias is not None else h)
        _mix_entry_fwd[(tokens,)](h, pre, w, b, out, stats, tokens, d, eps, n, IS_LN=layernorm,
                                  HAS_W=weight is not None, HAS_B=bias is not None, BLOCK=block,
                                  num_warps=warps)
    return out, stats


def mix_entry_backward(grad: Tensor, h: Tensor, pre: Tensor, weight: Tensor | None, bias: Tensor | None,
                       stats: Tensor, layernorm: bool, need_w: bool,
                       need_b: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    n, d = h.shape[-2], h.shape[-1]
    tokens = h.numel() // (n * d)
    dh, dpre = torch.empty_like(h), torch.empty_like(pre)
    need_w, need_b = need_w and weight is not None, need_b and bias is not None
    programs, per = _programs(h, max(tokens, 1))
    part = _partials(int(need_w) + int(need_b), programs, d, h)
    dw, db = (part[0] if need_w else None), (part[int(need_w)] if need_b else None)
    if tokens:
        block, warps = _block(d)
        _mix_entry_bwd[(programs,)](grad, h, pre, weight if weight is not None else h, stats, dh, dpre,
                                    dw if dw is not None else h, db if db is not None else h, tokens, d, n,
                                    IS_LN=layernorm, HAS_W=weight is not None, NEED_W=need_w,
                                    NEED_B=need_b, TOKENS=per, BLOCK=block, num_warps=warps)
    else:
        part.zero_()
    return dh, dpre, _reduce(dw, weight, h.device), _reduce(db, bias, h.device)
