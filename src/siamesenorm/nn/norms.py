"""Normalisation layers: LayerNorm, RMSNorm, DyT and Derf, each keeping little for backward."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import UserError
from .fused import derf, dyt, rms_norm

NORM_KINDS = ("layernorm", "rmsnorm", "dyt", "derf")

# DyT's alpha0 (arXiv 2503.10622): 0.5 by default (Section 7, "Initialization of alpha"; Table 14);
# for LLMs the paper's LLaMA values (attention / other) by model width (Table 12, and Table 11 for
# width 5120), depth having negligible influence.
DYT_ALPHA0 = 0.5
DYT_LLM_ALPHA0 = {1024: (1.0, 1.0), 2048: (1.0, 0.5), 4096: (0.8, 0.2), 5120: (0.6, 0.15),
                  8192: (0.2, 0.05)}
# Derf's alpha0 and s0 (arXiv 2512.10938): the official code's defaults for its ViT, DiT, DNA and
# speech models (alpha 0.5, shift 0); its GPT-2 takes separate alpha0 for the attention, FFN and
# final norms from the command line, values we could not confirm, so every Derf starts at these.
DERF_ALPHA0 = 0.5
DERF_SHIFT0 = 0.0


def _positive(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise UserError(f"{name} must be a positive number, got {value!r}")
    return float(value)


class LayerNorm(nn.Module):
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
    kind = "rmsnorm"  # what the lean functions of siamesenorm.nn.fused compute

    def __init__(self, dim: int, eps: float = 1e-5, *, affine: bool = True, bias: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__()
        if bias:
            raise UserError("RMSNorm has no bias; use norm='layernorm' for a norm with a bias")
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


class DyT(nn.Module):
    """Dynamic Tanh (Zhu et al., arXiv 2503.10622): ``weight * tanh(alpha * x) + bias``, ``alpha`` one
    scalar. ``eps`` is unused; ``role`` (``"attention"`` or ``"other"``) picks the LLM ``alpha0``."""

    kind = "dyt"

    def __init__(self, dim: int, eps: float = 1e-5, *, alpha0: float = DYT_ALPHA0, affine: bool = True,
                 bias: bool = True, role: str = "other", device=None, dtype=None) -> None:
        super().__init__()
        self.dim, self.eps, self.alpha0, self.role = dim, eps, _positive("DyT alpha0", alpha0), role
        kw = {"device": device, "dtype": dtype}
        self.alpha = nn.Parameter(torch.empty(1, **kw))
        self.weight = nn.Parameter(torch.empty(dim, **kw)) if affine else None
        self.bias = nn.Parameter(torch.empty(dim, **kw)) if affine and bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.alpha, self.alpha0)
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        return dyt(x, self.alpha, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"{self.dim}, alpha0={self.alpha0}, affine={self.weight is not None}, role={self.role}"


class Derf(nn.Module):
    """Dynamic erf (Chen et al., arXiv 2512.10938): ``weight * erf(alpha * x + shift) + bias``, ``alpha``
    and ``shift`` one scalar each; init from the official code. ``eps`` is unused."""

    kind = "derf"

    def __init__(self, dim: int, eps: float = 1e-5, *, alpha0: float = DERF_ALPHA0,
                 shift0: float = DERF_SHIFT0, affine: bool = True, bias: bool = True,
                 role: str = "other", device=None, dtype=None) -> None:
        super().__init__()
        if isinstance(shift0, bool) or not isinstance(shift0, (int, float)):
            raise UserError(f"Derf shift0 must be a number, got {shift0!r}")
        self.dim, self.eps, self.role = dim, eps, role
        self.alpha0, self.shift0 = _positive("Derf alpha0", alpha0), float(shift0)
        kw = {"device": device, "dtype": dtype}
        self.alpha = nn.Parameter(torch.empty(1, **kw))
        self.shift = nn.Parameter(torch.empty(1, **kw))
        self.weight = nn.Parameter(torch.empty(dim, **kw)) if affine else None
        self.bias = nn.Parameter(torch.empty(dim, **kw)) if affine and bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.constant_(self.alpha, self.alpha0)
        nn.init.constant_(self.shift, self.shift0)
        if self.weight is not None:
            nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: Tensor) -> Tensor:
        return derf(x, self.alpha, self.shift, self.weight, self.bias)

    def extra_repr(self) -> str:
        return (f"{self.dim}, alpha0={self.alpha0}, shift0={self.shift0}, "
                f"affine={self.weight is not None}, role={self.role}")


def llm_dyt_alpha0(dim: int) -> tuple[float, float]:
    """The DyT paper's LLaMA ``alpha0`` ``(attention, other)`` for width ``dim``: the row of the largest
    listed width not above it (narrower models: the 1024 row)."""
    rows = [w for w in DYT_LLM_ALPHA0 if w <= dim]
    return DYT_LLM_ALPHA0[max(rows) if rows else min(DYT_LLM_ALPHA0)]


def set_llm_dyt_alpha0(model: nn.Module, dim: int) -> None:
    """Give every DyT in ``model`` the paper's LLM ``alpha0`` for its ``role`` and reset ``alpha``."""
    attention, other = llm_dyt_alpha0(dim)
    for module in model.modules():
        if isinstance(module, DyT):
            module.alpha0 = attention if module.role == "attention" else other
            nn.init.constant_(module.alpha, module.alpha0)


def build_norm(kind: str, dim: int, eps: float = 1e-5, *, affine: bool = True, role: str = "other",
               device=None, dtype=None) -> nn.Module:
    """A norm by name (:data:`NORM_KINDS`); ``role`` only tags a DyT or Derf."""
    if kind == "derf":
        return Derf(dim, eps, affine=affine, role=role, device=device, dtype=dtype)
    if kind == "dyt":
        return DyT(dim, eps, affine=affine, role=role, device=device, dtype=dtype)
    if kind == "layernorm":
        return LayerNorm(dim, eps, affine=affine, device=device, dtype=dtype)
    if kind == "rmsnorm":
        return RMSNorm(dim, eps, affine=affine, device=device, dtype=dtype)
    raise UserError(f"unknown norm {kind!r}; choose one of {', '.join(NORM_KINDS)}")


def normed_product(norm: nn.Module, x: Tensor, proj: Tensor) -> Tensor:
    """``norm(x) @ proj`` for a LayerNorm or RMSNorm without writing ``norm(x)``:
    ``rstd ((x - mu) (g proj)) + b proj``, which Inductor fuses better."""
    w = proj if norm.weight is None else norm.weight.unsqueeze(-1).to(proj.dtype) * proj
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    if norm.kind == "layernorm":            # centred before the product's cast: no cancellation
        xf = xf - xf.mean(-1, keepdim=True)
        x = xf.to(x.dtype)
    rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True) + norm.eps)
    z = x @ w
    z = (z * rstd).to(z.dtype)
    bias = getattr(norm, "bias", None)
    return z if bias is None else z + bias.to(proj.dtype) @ proj
