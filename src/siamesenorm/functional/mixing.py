"""Per-token mixing of a few residual streams, ``A^T H`` with one small matrix per token
(hyper-connections' width connection, mHC's ``H^res x``), as one autograd function.

PyTorch's batched matmul runs one tiny GEMM per token on the CPU (with a select and a copy each);
a sum over the k streams of ``A[k, j] * H[k]`` runs as k broadcast multiply-adds over all tokens at
once, many times faster. Backward: ``dH[k] = sum_j A[k, j] dOut[j]`` and
``dA[k, j] = <H[k], dOut[j]>``, again k passes each.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd import Function


def _mix(a: Tensor, h: Tensor) -> Tensor:
    """``out[..., j, :] = sum_k a[..., k, j] * h[..., k, :]`` without autograd."""
    out = a[..., 0, :, None] * h[..., 0, None, :]
    for k in range(1, h.shape[-2]):
        out.addcmul_(a[..., k, :, None], h[..., k, None, :])
    return out


class _StreamMix(Function):
    @staticmethod
    def forward(ctx, a: Tensor, h: Tensor) -> Tensor:
        ctx.save_for_backward(a, h)
        return _mix(a, h)

    @staticmethod
    def backward(ctx, grad: Tensor):
        a, h = ctx.saved_tensors
        da = dh = None
        if ctx.needs_input_grad[0]:
            da = torch.stack([(h[..., k, None, :] * grad).sum(-1) for k in range(h.shape[-2])], -2)
        if ctx.needs_input_grad[1]:
            dh = _mix(a.transpose(-1, -2), grad)
        return da, dh


def stream_mix(a: Tensor, h: Tensor) -> Tensor:
    """``a^T h`` per token: ``a`` (..., k, c) and ``h`` (..., k, w) -> (..., c, w); equals
    ``a.transpose(-1, -2) @ h`` to rounding."""
    shape = torch.broadcast_shapes(a.shape[:-2], h.shape[:-2])
    return _StreamMix.apply(a.expand(*shape, *a.shape[-2:]), h.expand(*shape, *h.shape[-2:]))


class _MixAndWrite(Function):
    @staticmethod
    def forward(ctx, a: Tensor, h: Tensor, beta: Tensor, out: Tensor) -> Tensor:
        ctx.save_for_backward(a, h, beta, out)
        new = beta.unsqueeze(-1) * out.unsqueeze(-2)
        for k in range(h.shape[-2]):
            new.addcmul_(a[..., k, :, None], h[..., k, None, :])
        return new

    @staticmethod
    def backward(ctx, grad: Tensor):
        a, h, beta, out = ctx.saved_tensors
        need = ctx.needs_input_grad
        da = dh = dbeta = dout = None
        if need[0]:
            da = torch.stack([(h[..., k, None, :] * grad).sum(-1) for k in range(h.shape[-2])], -2)
        if need[1]:
            dh = _mix(a.transpose(-1, -2), grad)
        if need[2]:
            dbeta = (grad * out.unsqueeze(-2)).sum(-1)
        if need[3]:
            dout = (beta.unsqueeze(-1) * grad).sum(-2)
        return da, dh, dbeta, dout


def mix_and_write(a: Tensor, h: Tensor, beta: Tensor, out: Tensor) -> Tensor:
    """``a^T h + beta (x) out`` per token (mHC's ``H^res x + H^post^T F``): ``a`` (..., k, k),
    ``h`` (..., k, w), ``beta`` (..., k), ``out`` (..., w), as one autograd node."""
    return _MixAndWrite.apply(a, h, beta, out)
