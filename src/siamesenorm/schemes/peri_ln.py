"""Peri-LN: a norm on both sides of every sublayer, inside the residual branch (arXiv 2502.02732)."""

from __future__ import annotations

from torch import Tensor

from .base import Branch, Flag, Option, ResidualScheme, register_scheme


@register_scheme
class PeriLN(ResidualScheme):
    """Peri-LN (Kim et al., ICML 2025, arXiv 2502.02732).

    ``h <- h + LN^out_i(F_i(LN^in_i(h)))``, then ``LN_final(h)``. ``input_norm=False`` drops
    ``LN^in`` (OLMo2's block); ``embed_norm=True`` normalises the embedding on entry."""

    name = "peri_ln"
    role_norm_names = ("input_norm", "final_norm")
    role_output_norm_name = "output_norm"
    summary = "h = h + LN(F(LN(h))); out = LN(h)"
    paper = "Kim et al., ICML 2025, arXiv 2502.02732"
    options = {"embed_norm": Option(False, Flag(), attr="use_embed_norm"),
               "input_norm": Option(True, Flag(), attr="use_input_norm")}

    def __init__(self, dim: int, n_layers: int, **kwargs) -> None:
        super().__init__(dim, n_layers, **kwargs)
        self.input_norm = self.make_branch_norms(self.n_sublayers) if self.use_input_norm else None
        self.output_norm = self.make_norms(self.n_sublayers)
        self.final_norm = self.make_final_norm()
        self.embed_norm = self.make_norm() if self.use_embed_norm else None

    def enter(self, h: Tensor) -> Tensor:
        return h if self.embed_norm is None else self.embed_norm(h)

    def step(self, state: Tensor, i: int, branch: Branch) -> Tensor:
        u = state if self.input_norm is None else self.input_norm[i](state)
        return state + self.output_norm[i](branch(u))

    def exit(self, state: Tensor) -> Tensor:
        return state if self.final_norm is None else self.final_norm(state)
