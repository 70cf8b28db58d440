"""mHC's per-token stream work as Triton kernels (imported only where they run).

A program takes one token's ``n`` stream rows as an ``(N, BLOCK)`` tile and walks the width in
``CHUNKS`` chunks; sums over the width accumulate in float32.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _token(n: tl.constexpr, N: tl.constexpr):
    """This program's token, the stream index ``0..N`` and which of them exist."""
    tok = tl.program_id(0).to(tl.int64)
    idx = tl.arange(0, N)
    return tok, idx, idx < n


@triton.jit
def _matrix(ptr, tok, idx, live, n: tl.constexpr):
    """The token's ``(N, N)`` matrix in float32, zero in the padding."""
    off = tok * (n * n) + idx[:, None] * n + idx[None, :]
    return tl.load(ptr + off, mask=live[:, None] & live[None, :], other=0.0).to(tl.float32)


@triton.jit
def _rows(ptr, tok, idx, live, cols, cmask, D, n: tl.constexpr):
    """The token's ``(N, BLOCK)`` stream rows at ``cols``: offsets, mask and float32 values."""
    off = tok * n * D + idx[:, None] * D + cols[None, :]
    mask = live[:, None] & cmask[None, :]
    return off, mask, tl.load(ptr + off, mask=mask, other=0.0).to(tl.float32)


# ---- new = res h + post (x) out ----------------------------------------------------------------------
@triton.jit
def _mix_write_fwd(res_ptr, h_ptr, post_ptr, out_ptr, new_ptr, D, n: tl.constexpr, N: tl.constexpr,
                   BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    tok, idx, live = _token(n, N)
    res = _matrix(res_ptr, tok, idx, live, n)                                  # [j, k]
    post = tl.load(post_ptr + tok * n + idx, mask=live, other=0.0).to(tl.float32)
    for c in range(CHUNKS):
        cols = c * BLOCK + tl.arange(0, BLOCK)
        cmask = cols < D
        off, mask, h = _rows(h_ptr, tok, idx, live, cols, cmask, D, n)         # [k, c]
        o = tl.load(out_ptr + tok * D + cols, mask=cmask, other=0.0).to(tl.float32)
        new = tl.sum(res[:, :, None] * h[None, :, :], axis=1) + post[:, None] * o[None, :]
        tl.store(new_ptr + off, new.to(new_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mix_write_bwd(g_ptr, res_ptr, h_ptr, post_ptr, out_ptr, dres_ptr, dh_ptr, dpost_ptr, dout_ptr, D,
                   n: tl.constexpr, N: tl.constexpr, BLOCK: tl.constexpr, CHUNKS: tl.constexpr):
    """``dh = res^T g``, ``dout = post^T g``, ``dres = g h^T``, ``dpost = g out`` (per token)."""
    tok, idx, live = _token(n, N)
    res = _matrix(res_ptr, tok, idx, live, n)
    post = tl.load(post_ptr + tok * n + idx, mask=live, other=0.0).to(tl.float32)
    dres = tl.zeros((N, N), tl.float32)
    dpost = tl.zeros((N,), tl.float32)
    for c in range(CHUNKS):
        cols = c * BLOCK + tl.arange(0, BLOCK)
        cmask = cols < D
        off, mask, g = _rows(g_ptr, tok, idx, live, cols, cmask, D, n)         # [j, c]
        h = tl.load(h_ptr + off, mask=mask, other=0.0).to(tl.float32)         # [k, c]
        o = tl.load(out_ptr + tok * D + cols, mask=cmask, other=0.0).to(tl.float32)
        dh = tl.sum(res[:, :, None] * g[:, None, :], axis=0)
        tl.store(dh_ptr + off, dh.to(dh_ptr.dtype.element_ty), mask=mask)
        dout = tl.sum(post[:, None] * g, axis=0)
        tl.store(dout_ptr + tok * D + cols, dout.to(dout_ptr.dtype.element_ty), mask=cmask)
        dres += tl.sum(g[:, None, :] * h[None, :, :], axis=2)
        dpost += tl.sum(g * o[None, :], axis=1)
    off = tok * (n * n) + idx[:, None] * n + idx[None, :]
    tl.store(dres_ptr + off, dres.to(dres_ptr.dtype.element_ty), mask=live[:, None] & live[None, :])
    tl.store(dpost_ptr + tok * n + idx, dpost.to(dpost_ptr.dtype.element_ty), mask=live)


def _config(n: int, d: int) -> tuple[int, int, int]:
    """``(N, BLOCK, CHUNKS)``: the padded stream count, the columns of a chunk (the ``N x N x BLOCK``
    products of a chunk about 8192 entries) and the chunks of a row."""
    width = triton.next_power_of_2(n)
    block = max(16, min(triton.next_power_of_2(max(d, 1)), 8192 // (width * width)))
    return width, block, triton.cdiv(d, block)


def mix_write_forward(res: Tensor, h: Tensor, post: Tensor, out: Tensor, dtype: torch.dtype) -> Tensor:
    """``res``, ``h``, ``post``, ``out`` contiguous, of one token count."""
    new = torch.empty(h.shape, dtype=dtype, device=h.device)
    n, d = h.shape[-2], h.shape[-1]
    tokens = h.numel() // (n * d) if n * d else 0
    if tokens:
        width, block, chunks = _config(n, d)
        _mix_write_fwd[(tokens,)](res, h, post, out, new, d, n, width, block, chunks, num_warps=4)
    return new


def mix_write_backward(grad: Tensor, res: Tensor, h: Tensor, post: Tensor,
                       out: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    dres, dh, dpost, dout = (torch.empty_like(t) for t in (res, h, post, out))
    n, d = h.shape[-2], h.shape[-1]
    tokens = h.numel() // (n * d) if n * d else 0
    if tokens:
        width, block, chunks = _config(n, d)
        _mix_write_bwd[(tokens,)](grad, res, h, post, out, dres, dh, dpost, dout, d, n, width, block,
                                  chunks, num_warps=4)
    elif d == 0:                        # no columns: the sums over them are zero
        dres.zero_()
        dpost.zero_()
    return dres, dh, dpost, dout
