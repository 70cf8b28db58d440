"""Normalisation layers: LayerNorm and RMSNorm with factory kwargs and ``reset_parameters``.

Both keep only their input and per-row statistics for backward: LayerNorm through
``F.layer_norm``, RMSNorm through :func:`siamesenorm.nn.fused.rms_norm` (``F.rms_norm`` itself on
the reference path, see :func:`siamesenorm.nn.fused.reference_path`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import ConfigError
from .fused import rms_norm

NORM_KINDS = ("layernorm", "rmsnorm")


class LayerNorm(nn.Module):
    """LayerNorm over the last dimension: ``(x - mean) / sqrt(var + eps) * weight + bias``."""

    kind = "layernorm"  # what the lean functions of siamesenorm.nn.fused compute

    def __init__(self, dim: int, eps: float = 1e-5, *, affine: bool = True, bias: bool = True,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.dim, self.eps = dim, eps
        kw = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(dim, **kw)) if affine else None
        self.bias = nn.Parameter(torch.empty(dim, **kw)) if affine and bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        return F.layer_norm(x, (self.dim,), self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, affine={self.weight is not None}"


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension: ``x / sqrt(mean(x^2) + eps) * weight``."""

    kind = "rmsnorm"  # what the lean functions of siamesenorm.nn.fused compute

    def __init__(self, dim: int, eps: float = 1e-5, *, affine: bool = True, bias: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__()
        if bias:
            raise ConfigError("RMSNorm has no bias; use norm='layernorm' for a norm with a bias")
        self.dim, self.eps = dim, eps
        self.weight = nn.Parameter(torch.empty(dim, device=device, dtype=dtype)) if affine else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.weight is not None:
            nn.init.ones_(self.weight)

    def forward(self, x: Tensor) -> Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.dim}, eps={self.eps}, affine={self.weight is not None}"


def build_norm(kind: str, dim: int, eps: float = 1e-5, *, affine: bool = True,
               device=None, dtype=None) -> nn.Module:
    """Build a norm by name (``"layernorm"`` or ``"rmsnorm"``)."""
    if kind == "layernorm":
        return LayerNorm(dim, eps, affine=affine, device=device, dtype=dtype)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps, affine=affine, device=device, dtype=dtype)
    raise ConfigError(f"unknown norm {kind!r}; choose one of {', '.join(NORM_KINDS)}")
