"""SpanNorm: a residual that spans the whole block, with Post-Norm-style outputs (arXiv 2601.22580)."""

from __future__ import annotations

from torch import Tensor, nn

from .base import Branch, ResidualScheme, register_scheme


@register_scheme
class SpanNorm(ResidualScheme):
    """SpanNorm (Wang et al., ICML 2026, arXiv 2601.22580).

    ``y_l = LN1_l(x_l + Attn(x_l)); x_{l+1} = LN2_l(x_l + FFN(y_l))``; the first attention reads
    ``LN_init(x_0)``. The paper's scaling strategy is not implemented (docs/schemes.md)."""

    name = "spannorm"
    summary = "y = LN(x + Attn(x)); x = LN(x + FFN(y))"
    paper = "Wang et al., ICML 2026, arXiv 2601.22580"

    def __init__(self, dim: int, n_layers: int, **kwargs) -> None:
        super().__init__(dim, n_layers, **kwargs)
        self.initial_norm = self.make_branch_norm("attention")   # feeds the first attention
        self.attn_norm = nn.ModuleList(self.make_branch_norm("attention") for _ in range(n_layers))
        self.ffn_norm = self.make_norms(n_layers)

    def enter(self, h: Tensor) -> tuple[Tensor, Tensor]:
        return h, h

    def step(self, state: tuple, i: int, branch: Branch) -> tuple[Tensor, Tensor]:
        x, y = state
        b = self.block_of(i)
        if self.is_attention(i):
            inp = self.initial_norm(x) if b == 0 else x
            return x, self.attn_norm[b](x + branch(inp))
        x = self.ffn_norm[b](x + branch(y))
        return x, x

    def exit(self, state: tuple) -> Tensor:
        return state[0]

    def streams(self, state: tuple) -> dict[str, Tensor]:
        return {"h": state[0]}
