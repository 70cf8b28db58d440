"""What every fused op checks at its entry, the same on the kernel and the PyTorch path: tensors of
floating point, shapes that agree, parameters of the row's width; a ``TypeError`` or ``ValueError``
naming the argument otherwise."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["KERNEL_DTYPES", "eps", "floating_dtype", "kernel_dtypes", "param", "tensor"]

KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)   # float64 keeps its precision in PyTorch


def tensor(op: str, name: str, t: object, min_dim: int = 1) -> Tensor:
    """``t`` itself, a floating-point tensor of at least ``min_dim`` dimensions."""
    if not isinstance(t, Tensor):
        raise TypeError(f"{op}: {name} must be a tensor, not {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{op}: {name} must be floating point, not {t.dtype}")
    if t.dim() < min_dim:
        raise ValueError(f"{op}: {name} must have at least {min_dim} dimension{'s' * (min_dim > 1)}, "
                         f"not shape {tuple(t.shape)}")
    return t


def param(op: str, name: str, p: Tensor | None, width: int) -> None:
    """A weight or bias: None, or a floating-point tensor of shape ``(width,)``."""
    if p is None:
        return
    tensor(op, name, p)
    if tuple(p.shape) != (width,):
        raise ValueError(f"{op}: {name} must have shape ({width},), not {tuple(p.shape)}")


def eps(op: str, name: str, value: object) -> None:
    """A norm's epsilon: a finite number >= 0 (a negative one makes rstd NaN where a row is flat)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
        raise ValueError(f"{op}: {name} must be a finite number >= 0, not {value!r}")


def floating_dtype(op: str, name: str, dtype: object) -> None:
    """An output dtype: None or a floating-point dtype."""
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise TypeError(f"{op}: {name} must be a floating-point dtype, not {dtype!r}")


def kernel_dtypes(*ts: Tensor | None) -> bool:
    """Whether every tensor given is of a dtype the kernels compute (float32, bf16, fp16)."""
    return all(t is None or t.dtype in KERNEL_DTYPES for t in ts)
