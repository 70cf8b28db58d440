"""HybridNorm: QKV-norm attention with a Post-Norm FFN (arXiv 2503.04598)."""

from __future__ import annotations

from torch import Tensor, nn

from .base import Branch, Flag, Option, ResidualScheme, SchemeRequirements, register_scheme


@register_scheme
class HybridNorm(ResidualScheme):
    """HybridNorm (Zhuo et al. 2025, arXiv 2503.04598), as in its official OLMo code.

    ``h = h + Attn_qkvnorm(h); hn = LN_b(h); h = hn + FFN(hn)``; ``out = LN_final(h)``.
    ``first_layer_pre=True`` (HybridNorm*) makes block 0 a Pre-Norm block."""

    name = "hybridnorm"
    role_norm_names = ("attn_norm", "final_norm")  # block 0"s attention norm (pre0)
    summary = "h = h + Attn_qkvnorm(h); hn = LN(h); h = hn + FFN(hn); out = LN(h)"
    paper = "Zhuo et al. 2025, arXiv 2503.04598"
    options = {"first_layer_pre": Option(False, Flag())}

    def __init__(self, dim: int, n_layers: int, **kwargs) -> None:
        super().__init__(dim, n_layers, **kwargs)
        pre0 = self.first_layer_pre  # block 0's FFN norm is then a pre-norm, feeding the branch only
        self.ffn_norm = nn.ModuleList(self.make_branch_norm() if pre0 and b == 0 else self.make_norm()
                                      for b in range(n_layers))
        self.attn_norm = self.make_branch_norm("attention") if pre0 else None
        self.final_norm = self.make_final_norm()
        self.requires = SchemeRequirements(qkv_norm_blocks=frozenset(range(n_layers)))

    def step(self, state: Tensor, i: int, branch: Branch) -> Tensor:
        b = self.block_of(i)
        pre_block = self.first_layer_pre and b == 0
        if self.is_attention(i):
            return state + branch(self.attn_norm(state) if pre_block else state)
        if pre_block:
            return state + branch(self.ffn_norm[b](state))
        normed = self.ffn_norm[b](state)
        return normed + branch(normed)

    def exit(self, state: Tensor) -> Tensor:
        return state if self.final_norm is None else self.final_norm(state)
