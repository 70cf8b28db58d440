"""Value residuals (ResFormer, Zhou et al., "Value Residual Learning", arXiv 2410.17897).

Every attention layer after the first mixes its values with the first layer's before attending::

    V_n <- own * V_n + first * V_1          (n > 1; V_1 = the first layer's values)

``V_n`` are the values as the layer's attention reads them, ``(B, n_kv_heads, T, head_dim)``
(after a per-head value norm where the layer has one; values get no RoPE). The paper's default
(Identity-ResFormer, the authors' code) fixes ``own = first = 0.5``; Learnable-ResFormer trains
one scalar pair per layer, initialised at those values. The mixed values are what a KV cache
holds, so cached decoding needs ``V_1`` of the new tokens only.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from .carrier import LayerCarrier

__all__ = ["VALUE_RESIDUAL_MIXES", "FirstValues", "ValueMix"]

VALUE_RESIDUAL_MIXES = ("fixed", "learned")


class FirstValues(LayerCarrier):
    """Carries the first attention layer's values ``V_1`` to the later ones during one forward
    pass: a model makes a fresh one per forward and passes it to every attention sublayer. The
    first write wins (a checkpoint's recompute of the first layer leaves it unchanged)."""

    @property
    def values(self) -> Tensor | None:
        """``V_1``, or ``None`` before the first layer has run."""
        return self.held.get(0)

    @values.setter
    def values(self, values: Tensor) -> None:
        self.keep(0, values)


class ValueMix(nn.Module):
    """``own * V_n + first * V_1``; ``learned``: ``own_weight`` and ``first_weight`` are trained
    scalars of this layer (initialised at ``own``, ``first``), else fixed numbers."""

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
