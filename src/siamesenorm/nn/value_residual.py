"""Value residuals (ResFormer, arXiv 2410.17897): attention layer ``n > 1`` reads
``own * V_n + first * V_1``, and its KV cache holds that."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .carrier import LayerCarrier

__all__ = ["VALUE_RESIDUAL_MIXES", "FirstValues", "ValueMix"]

VALUE_RESIDUAL_MIXES = ("fixed", "learned")


class FirstValues(LayerCarrier):
    """Carries the first attention layer's values ``V_1`` to the later ones; one per forward pass."""

    @property
    def values(self) -> Tensor | None:
        return self.held.get(0)

    @values.setter
    def values(self, values: Tensor) -> None:
        self.keep(0, values)


class ValueMix(nn.Module):
    """``own * V_n + first * V_1``: fixed numbers (Identity-ResFormer, the paper's default 0.5 each) or,
    ``learned``, trained scalars initialised at them."""

    def __init__(self, own: float = 0.5, first: float = 0.5, *, learned: bool = False,
                 device=None, dtype=None) -> None:
        super().__init__()
        self.own, self.first, self.learned = float(own), float(first), bool(learned)
        self.own_weight: nn.Parameter | float = self.own
        self.first_weight: nn.Parameter | float = self.first
        if self.learned:
            self.own_weight = nn.Parameter(torch.empty(1, device=device, dtype=dtype))
            self.first_weight = nn.Parameter(torch.empty(1, device=device, dtype=dtype))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        if self.learned:
            self.own_weight.fill_(self.own)
            self.first_weight.fill_(self.first)

    def forward(self, values: Tensor, first_values: Tensor) -> Tensor:
        return self.own_weight * values + self.first_weight * first_values

    def extra_repr(self) -> str:
        return f"own={self.own}, first={self.first}, learned={self.learned}"
