"""Feed-forward sublayers: SwiGLU and GELU MLPs, with dropout on their output while training."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import UserError

MLP_KINDS = ("swiglu", "gelu")


def default_mlp_hidden(kind: str, dim: int) -> int:
    """Default hidden size: SwiGLU 8/3 * dim rounded up to a multiple of 64; GELU 4 * dim."""
    if kind == "swiglu":
        return -(-8 * dim // (3 * 64)) * 64
    if kind == "gelu":
        return 4 * dim
    raise UserError(f"unknown mlp {kind!r}; choose one of {', '.join(MLP_KINDS)}")


class SwiGLUMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``."""

    def __init__(self, dim: int, hidden: int, *, bias: bool = False, dropout: float = 0.0,
                 device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.dim, self.hidden, self.dropout = dim, hidden, dropout
        self.gate_proj = nn.Linear(dim, hidden, bias=bias, **kw)
        self.up_proj = nn.Linear(dim, hidden, bias=bias, **kw)
        self.down_proj = nn.Linear(hidden, dim, bias=bias, **kw)

    def reset_parameters(self) -> None:
        for proj in (self.gate_proj, self.up_proj, self.down_proj):
            proj.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        y = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return F.dropout(y, self.dropout, self.training)


GELU_APPROXIMATIONS = ("none", "tanh")


class GELUMLP(nn.Module):
    """``down_proj(gelu(up_proj(x)))``; ``approximate="tanh"`` (as DiT) or ``"none"``, the exact erf
    (ViT/DeiT, GPT)."""

    def __init__(self, dim: int, hidden: int, *, bias: bool = False, dropout: float = 0.0,
                 approximate: str = "none", device=None, dtype=None) -> None:
        super().__init__()
        if approximate not in GELU_APPROXIMATIONS:
            raise UserError(f"unknown GELU approximation {approximate!r}; choose one of "
                              f"{', '.join(GELU_APPROXIMATIONS)}")
        kw = {"device": device, "dtype": dtype}
        self.dim, self.hidden, self.dropout = dim, hidden, dropout
        self.approximate = approximate
        self.up_proj = nn.Linear(dim, hidden, bias=bias, **kw)
        self.down_proj = nn.Linear(hidden, dim, bias=bias, **kw)

    def reset_parameters(self) -> None:
        for proj in (self.up_proj, self.down_proj):
            proj.reset_parameters()

    def forward(self, x: Tensor) -> Tensor:
        y = self.down_proj(F.gelu(self.up_proj(x), approximate=self.approximate))
        return F.dropout(y, self.dropout, self.training)


def build_mlp(kind: str, dim: int, hidden: int | None = None, *, bias: bool = False,
              dropout: float = 0.0, device=None, dtype=None) -> nn.Module:
    if kind not in MLP_KINDS:
        raise UserError(f"unknown mlp {kind!r}; choose one of {', '.join(MLP_KINDS)}")
    hidden = default_mlp_hidden(kind, dim) if hidden is None else hidden
    cls = SwiGLUMLP if kind == "swiglu" else GELUMLP
    return cls(dim, hidden, bias=bias, dropout=dropout, device=device, dtype=dtype)
