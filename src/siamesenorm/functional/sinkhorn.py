"""Sinkhorn-Knopp over many small matrices at once (mHC's residual maps, arXiv 2512.24880).

``sinkhorn(logits, iters)`` is ``exp(logits)`` with rows then columns rescaled to sum 1, ``iters``
times, with the exact gradient of those iterations. One autograd function that keeps only
``exp(logits)``; backward runs the iterations again: ``y = m / s`` along an axis has
``dm = (dy - sum(dy * y)) / s`` and ``m = y * s``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd import Function


def _token_last(t: Tensor) -> Tensor:
    """``(..., n, n)`` -> ``(n, n, tokens)``, contiguous."""
    return t.reshape(-1, *t.shape[-2:]).permute(1, 2, 0).contiguous()


def _token_first(t: Tensor, shape: torch.Size) -> Tensor:
    """``(n, n, tokens)`` -> ``shape`` (``(..., n, n)``)."""
    return t.permute(2, 0, 1).reshape(shape)


def _iterate(m: Tensor, iters: int) -> tuple[Tensor, list[Tensor]]:
    """The iterations on ``m`` (n, n, T) without autograd: the result and the sums divided by."""
    sums = []
    for _ in range(iters):
        rows = m.sum(1, keepdim=True)               # (n, 1, T): each row's sum
        m = m / rows
        cols = m.sum(0, keepdim=True)               # (1, n, T): each column's sum
        m = m / cols
        sums += (rows, cols)
    return m, sums


class _Sinkhorn(Function):
    @staticmethod
    def forward(ctx, logits: Tensor, iters: int) -> Tensor:
        m = _token_last(logits)
        start = torch.exp(m - m.amax(dim=(0, 1), keepdim=True))
        ctx.save_for_backward(start)                # backward runs the iterations again
        ctx.shape, ctx.iters = logits.shape, iters
        return _token_first(_iterate(start, iters)[0], logits.shape)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (start,) = ctx.saved_tensors
        m, sums = _iterate(start, ctx.iters)
        g = _token_last(grad)
        for k, s in enumerate(reversed(sums)):      # the last iteration's columns first
            axis = 0 if k % 2 == 0 else 1           # columns were summed over axis 0, rows over 1
            g = (g - (g * m).sum(axis, keepdim=True)) / s
            m = m * s                               # the step's input
        return _token_first(g * m, ctx.shape), None  # m is now exp(logits - max)


def sinkhorn(logits: Tensor, iters: int) -> Tensor:
    """``exp(logits)`` (over the last two axes, ``(..., n, n)``) with rows then columns rescaled to
    sum 1, ``iters`` times; float64 agrees with the iterations written out to rounding."""
    return _Sinkhorn.apply(logits, iters)
