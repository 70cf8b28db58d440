"""The RMS-normalised projection ``z = rstd(x) (x @ w)`` as Triton kernels (imported only where
they run).

Backward: ``dx = rstd (dz w^T) - (rstd^2 / K) (dz . z) x`` per width tile, and ``dw = x^T (rstd
dz)`` as per-split partial sums added after. Trip counts are constexprs.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor

from ._triton import _reduce, _wanted


@triton.jit
def _dot(a, b, acc, TF32: tl.constexpr):
    """``acc + a @ b`` of float32 tiles: on tensor cores in TF32, or exact."""
    if TF32:
        return tl.dot(a, b, acc, input_precision="tf32")
    else:
        return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def _rms_project_fwd(x_ptr, w_ptr, z_ptr, r_ptr, T, K, M, eps, TF32: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, K_TILES: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    cols = tl.arange(0, BLOCK_M)
    cmask = cols < M
    acc = tl.zeros((BLOCK_T, BLOCK_M), tl.float32)
    sq = tl.zeros((BLOCK_T,), tl.float32)
    for kt in range(K_TILES):
        ks = kt * BLOCK_K + tl.arange(0, BLOCK_K)
        kmask = ks < K
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=rmask[:, None] & kmask[None, :],
                    other=0.0).to(tl.float32)
        w = tl.load(w_ptr + ks[:, None] * M + cols[None, :], mask=kmask[:, None] & cmask[None, :],
                    other=0.0).to(tl.float32)
        sq += tl.sum(x * x, axis=1)
        acc = _dot(x, w, acc, TF32)
    rstd = 1.0 / tl.sqrt(sq / K + eps)
    tl.store(z_ptr + rows[:, None] * M + cols[None, :], acc * rstd[:, None],
             mask=rmask[:, None] & cmask[None, :])
    tl.store(r_ptr + rows, rstd, mask=rmask)


@triton.jit
def _rms_project_bwd(dz_ptr, x_ptr, w_ptr, z_ptr, r_ptr, dx_ptr, dw_ptr, T, K, M,
                     NEED_X: tl.constexpr, NEED_W: tl.constexpr, TF32: tl.constexpr, BLOCK_T: tl.constexpr,
                     BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, STEPS: tl.constexpr):
    ks = tl.program_id(0) * BLOCK_K + tl.arange(0, BLOCK_K)
    kmask = ks < K
    split = tl.program_id(1).to(tl.int64)
    cols = tl.arange(0, BLOCK_M)
    cmask = cols < M
    w = tl.load(w_ptr + ks[:, None] * M + cols[None, :], mask=kmask[:, None] & cmask[None, :],
                other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK_K, BLOCK_M), tl.float32)
    start = split * (STEPS * BLOCK_T)
    for step in range(STEPS):                 # the rows past ``T`` (a last split's) are masked
        rows = start + step * BLOCK_T + tl.arange(0, BLOCK_T)
        rmask = rows < T
        zmask = rmask[:, None] & cmask[None, :]
        dz = tl.load(dz_ptr + rows[:, None] * M + cols[None, :], mask=zmask, other=0.0).to(tl.float32)
        rstd = tl.load(r_ptr + rows, mask=rmask, other=0.0)
        xmask = rmask[:, None] & kmask[None, :]
        x = tl.load(x_ptr + rows[:, None] * K + ks[None, :], mask=xmask, other=0.0).to(tl.float32)
        if NEED_X:
            z = tl.load(z_ptr + rows[:, None] * M + cols[None, :], mask=zmask, other=0.0)
            s = tl.sum(dz * z, axis=1) * rstd * rstd / K
            g = _dot(dz, tl.trans(w), tl.zeros((BLOCK_T, BLOCK_K), tl.float32), TF32)
            dx = rstd[:, None] * g - s[:, None] * x
            tl.store(dx_ptr + rows[:, None] * K + ks[None, :], dx.to(dx_ptr.dtype.element_ty), mask=xmask)
        if NEED_W:
            dw = _dot(tl.trans(x), dz * rstd[:, None], dw, TF32)
    if NEED_W:
        tl.store(dw_ptr + (split * K + ks[:, None]) * M + cols[None, :], dw,
                 mask=kmask[:, None] & cmask[None, :])


def _blocks(m: int) -> tuple[int, int, int]:
    """``BLOCK_T``, ``BLOCK_K`` and ``BLOCK_M`` (``tl.dot`` takes no side under 16)."""
    return 32, 64, max(16, triton.next_power_of_2(m))


def rms_project_forward(x: Tensor, w: Tensor, eps: float, tf32: bool) -> tuple[Tensor, Tensor]:
    """``x`` ``(T, K)`` and ``w`` ``(K, M)`` contiguous: ``(z, rstd)`` in float32."""
    (t, k), m = x.shape, w.shape[1]
    z = torch.empty((t, m), dtype=torch.float32, device=x.device)
    rstd = torch.empty((t,), dtype=torch.float32, device=x.device)
    if t:
        bt, bk, bm = _blocks(m)
        _rms_project_fwd[(triton.cdiv(t, bt),)](x, w, z, rstd, t, k, m, eps, tf32, BLOCK_T=bt, BLOCK_K=bk,
                                                 BLOCK_M=bm, K_TILES=triton.cdiv(k, bk), num_warps=4)
    return z, rstd


def rms_project_backward(dz: Tensor, x: Tensor, w: Tensor, z: Tensor, rstd: Tensor, tf32: bool,
                         need_x: bool, need_w: bool) -> tuple[Tensor, Tensor]:
    """``(dx, dw)`` in ``x``'s and ``w``'s dtypes (empty where not asked for)."""
    (t, k), m = x.shape, w.shape[1]
    dx = torch.empty_like(x) if need_x else x.new_empty(0)
    bt, bk, bm = _blocks(m)
    tiles = triton.cdiv(k, bk)
    blocks = max(1, triton.cdiv(t, bt))
    splits = max(1, min(blocks, triton.cdiv(_wanted(x), tiles)))
    steps = triton.next_power_of_2(triton.cdiv(blocks, splits))   # blocks of rows a split walks
    splits = triton.cdiv(blocks, steps)
    make = torch.empty if t else torch.zeros         # every program writes its whole tile
    part = make((splits, k, m) if need_w else (0,), dtype=torch.float32, device=x.device)
    if t and (need_x or need_w):
        _rms_project_bwd[(tiles, splits)](dz, x, w, z, rstd, dx, part if need_w else z, t, k, m,
                                          NEED_X=need_x, NEED_W=need_w, TF32=tf32, BLOCK_T=bt,
                                          BLOCK_K=bk, BLOCK_M=bm, STEPS=steps, num_warps=4)
    return dx, _reduce(part if need_w else None, w, w.device)
