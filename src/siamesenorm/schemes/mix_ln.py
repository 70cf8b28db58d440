"""Mix-LN: Post-Norm in the first layers, Pre-Norm in the rest (arXiv 2412.13795)."""

from __future__ import annotations

import math

from torch import Tensor, nn

from .base import Branch, Number, Option, ResidualScheme, register_scheme


@register_scheme
class MixLN(ResidualScheme):
    """Mix-LN (Li, Yin, Liu, ICLR 2025, arXiv 2412.13795).

    The first ``floor(post_fraction * n_layers)`` blocks are Post-Norm, ``h <- LN_i(h + F_i(h))``,
    the rest Pre-Norm, ``h <- h + F_i(LN_i(h))``, with a final norm if any block is Pre-Norm."""

    name = "mix_ln"
    role_norm_names = ("norm", "final_norm")  # its Pre-LN blocks only (role_norms)
    summary = "first floor(a*L) blocks h = LN(h + F(h)); rest h = h + F(LN(h))"
    paper = "Li, Yin, Liu, ICLR 2025, arXiv 2412.13795"
    options = {"post_fraction": Option(0.25, Number(low=0, high=1))}

    def __init__(self, dim: int, n_layers: int, **kwargs) -> None:
        super().__init__(dim, n_layers, **kwargs)
        self.n_post = math.floor(self.post_fraction * n_layers + 1e-9)
        self.norm = nn.ModuleList(
            self.make_norm(role=self.role(i)) if self.block_of(i) < self.n_post
            else self.make_branch_norm(self.role(i))
            for i in range(self.n_sublayers))
        self.final_norm = self.make_final_norm() if self.n_post < n_layers else None

    def step(self, state: Tensor, i: int, branch: Branch) -> Tensor:
        if self.block_of(i) < self.n_post:
            return self.norm[i](state + branch(state))
        return state + branch(self.norm[i](state))

    def exit(self, state: Tensor) -> Tensor:
        return state if self.final_norm is None else self.final_norm(state)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, n_post={self.n_post}"

    def role_norms(self) -> tuple[dict[int, nn.Module], nn.Module | None]:
        norms, head = super().role_norms()      # the first n_post blocks are Post-LN: no such role
        return {i: m for i, m in norms.items() if self.block_of(i) >= self.n_post}, head
