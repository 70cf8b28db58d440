"""Sinkhorn-Knopp's Triton kernels (imported only where they run).

A program takes ``BLOCK_T`` tokens' ``n x n`` matrices as one padded ``(BLOCK_T, N, N)`` tile.
Backward runs the ``ITERS`` iterations again and walks them in reverse: ``y = m / s`` along an
axis has ``dm = (dy - sum(dy * y)) / s`` and ``m = y * s``.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _tile(T, n: tl.constexpr, N: tl.constexpr, BLOCK_T: tl.constexpr):
    """Offsets and mask of this program's tile, which tokens exist, and which (token, row) exist."""
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    idx = tl.arange(0, N)
    live = tok < T
    lines = live[:, None] & (idx[None, :] < n)
    off = tok[:, None, None] * (n * n) + idx[None, :, None] * n + idx[None, None, :]
    mask = lines[:, :, None] & (idx[None, None, :] < n)
    return off, mask, live, lines


@triton.jit
def _start(x_ptr, off, mask, live):
    """``exp(logits - max)`` per token in float32, zero in the padding."""
    x = tl.load(x_ptr + off, mask=mask, other=float("-inf")).to(tl.float32)
    top = tl.where(live, tl.max(tl.max(x, axis=2), axis=1), 0.0)
    return tl.exp(x - top[:, None, None])


@triton.jit
def _rescale(m, lines, AXIS: tl.constexpr):
    """``m`` divided by its sums along ``AXIS`` (2: rows, 1: columns), and those sums (1 in padding)."""
    s = tl.where(lines, tl.sum(m, axis=AXIS), 1.0)
    return m / tl.expand_dims(s, AXIS), s


@triton.jit
def _unscale(g, y, s, AXIS: tl.constexpr):
    """The gradient and the input of the step ``y = m / s`` along ``AXIS``."""
    s = tl.expand_dims(s, AXIS)
    return (g - tl.expand_dims(tl.sum(g * y, axis=AXIS), AXIS)) / s, y * s


@triton.jit
def _sinkhorn_fwd(x_ptr, y_ptr, T, n: tl.constexpr, N: tl.constexpr, BLOCK_T: tl.constexpr,
                  ITERS: tl.constexpr):
    off, mask, live, lines = _tile(T, n, N, BLOCK_T)
    m = _start(x_ptr, off, mask, live)
    for _ in range(ITERS):
        m = _rescale(m, lines, 2)[0]
        m = _rescale(m, lines, 1)[0]
    tl.store(y_ptr + off, m.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _sinkhorn_bwd(x_ptr, g_ptr, dx_ptr, T, n: tl.constexpr, N: tl.constexpr, BLOCK_T: tl.constexpr,
                  ITERS: tl.constexpr):
    off, mask, live, lines = _tile(T, n, N, BLOCK_T)
    m = _start(x_ptr, off, mask, live)
    sums = ()
    for _ in tl.static_range(ITERS):
        m, rows = _rescale(m, lines, 2)
        m, cols = _rescale(m, lines, 1)
        sums = sums + (rows, cols)
    g = tl.load(g_ptr + off, mask=mask, other=0.0).to(tl.float32)
    for k in tl.static_range(ITERS - 1, -1, -1):       # the last iteration's columns first
        g, m = _unscale(g, m, sums[2 * k + 1], 1)
        g, m = _unscale(g, m, sums[2 * k], 2)
    tl.store(dx_ptr + off, (g * m).to(dx_ptr.dtype.element_ty), mask=mask)   # m: exp(logits - max)


def _config(n: int) -> tuple[int, int]:
    """``(N, BLOCK_T)``: the padded width and tokens per program (about 512 entries a tile)."""
    width = triton.next_power_of_2(n)
    return width, max(1, 512 // (width * width))


def sinkhorn_forward(logits: Tensor, iters: int) -> Tensor:
    x = logits.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = x.shape[-1]
    tokens = x.numel() // (n * n) if n else 0
    if tokens:
        width, block = _config(n)
        _sinkhorn_fwd[(triton.cdiv(tokens, block),)](x, y, tokens, n, width, block, iters, num_warps=4)
    return y


def sinkhorn_backward(grad: Tensor, logits: Tensor, iters: int) -> Tensor:
    x, g = logits.contiguous(), grad.contiguous()
    dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n = x.shape[-1]
    tokens = x.numel() // (n * n) if n else 0
    if tokens:
        width, block = _config(n)
        _sinkhorn_bwd[(triton.cdiv(tokens, block),)](x, g, dx, tokens, n, width, block, iters, num_warps=4)
    return dx
