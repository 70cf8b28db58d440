"""LayerNorm Scaling: Pre-Norm with each norm output scaled by 1/sqrt(layer) (arXiv 2502.05795)."""

from __future__ import annotations

import math

from torch import Tensor

from .base import Branch, register_scheme
from .pre import PreNorm


@register_scheme
class LayerNormScaling(PreNorm):
    """LayerNorm Scaling (Sun et al. 2025, "The Curse of Depth", arXiv 2502.05795).

    ``h <- h + F_i(LN_i(h) / sqrt(b + 1))`` for sublayer ``i`` of block ``b``; ``out = LN_final(h)``."""

    name = "lns"
    summary = "h = h + F(LN(h) / sqrt(l)); out = LN(h)"
    paper = "Sun et al. 2025, arXiv 2502.05795"

    def step(self, state: Tensor, i: int, branch: Branch) -> Tensor:
        return state + branch(self.pre_norm[i](state) / math.sqrt(self.block_of(i) + 1))
