"""ResiDual: a Post-Norm stream plus an un-normalised dual stream (arXiv 2304.14802)."""

from __future__ import annotations

from torch import Tensor

from .base import Branch, ResidualScheme, register_scheme


@register_scheme
class ResiDual(ResidualScheme):
    """ResiDual (Xie et al. 2023, arXiv 2304.14802), as in its official code.

    ``O = F_i(x_a); x_a = LN_i(x_a + O); x_d = x_d + O``; ``out = x_a + LN_dual(x_d)``."""

    name = "resi_dual"
    summary = "O = F(xa); xa = LN(xa + O); xd = xd + O; out = xa + LN(xd)"
    paper = "Xie et al. 2023, arXiv 2304.14802"

    def __init__(self, dim: int, n_layers: int, **kwargs) -> None:
        super().__init__(dim, n_layers, **kwargs)
        self.post_norm = self.make_norms(self.n_sublayers)
        self.dual_norm = self.make_norm()

    def enter(self, h: Tensor) -> tuple[Tensor, Tensor]:
        return h, h

    def step(self, state: tuple, i: int, branch: Branch) -> tuple[Tensor, Tensor]:
        xa, xd = state
        out = branch(xa)
        return self.post_norm[i](xa + out), xd + out

    def exit(self, state: tuple) -> Tensor:
        xa, xd = state
        return xa + self.dual_norm(xd)

    def streams(self, state: tuple) -> dict[str, Tensor]:
        return {"post": state[0], "dual": state[1]}
