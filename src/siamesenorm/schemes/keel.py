"""Keel: Post-Norm with a Highway-style, up-weighted skip and a normalised branch input
(arXiv 2601.19895)."""

from __future__ import annotations

from dataclasses import replace

from torch import Tensor

from .base import MAX_SKIP_WEIGHT, Branch, Number, Option, ResidualScheme, register_scheme
from .fusion import NormThenNorm, fuses


@register_scheme
@fuses(NormThenNorm(pre="pre_norm", post="post_norm", skip="alpha"))
class Keel(ResidualScheme):
    """Keel (Chen, Wei et al. 2026, "Post-LayerNorm Is Back", arXiv 2601.19895).

    ``h <- LN^post_i(alpha * h + F_i(LN^pre_i(h)))``, ``alpha`` by default ``L = 2 * n_layers``; no
    final norm by default. The equation comes from summaries of the paper (docs/schemes.md)."""

    name = "keel"
    role_norm_names = ("pre_norm", "final_norm")
    summary = "h = LN(alpha*h + F(LN(h))), alpha = 2*n_layers"
    paper = "Chen, Wei et al. 2026, arXiv 2601.19895"
    options = {"alpha": Option(None, Number(low=0, high=MAX_SKIP_WEIGHT, optional=True)),
               "final_norm": replace(ResidualScheme.options["final_norm"], default=False)}

    def __init__(self, dim: int, n_layers: int, **kwargs) -> None:
        super().__init__(dim, n_layers, **kwargs)
        self.alpha = float(self.n_sublayers if self.alpha is None else self.alpha)
        self.pre_norm = self.make_branch_norms(self.n_sublayers)
        self.post_norm = self.make_norms(self.n_sublayers)
        self.final_norm = self.make_final_norm()

    def step(self, h: Tensor, i: int, branch: Branch) -> Tensor:
        return self.post_norm[i](self.alpha * h + branch(self.pre_norm[i](h)))

    def exit(self, h: Tensor) -> Tensor:
        return h if self.final_norm is None else self.final_norm(h)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, alpha={self.alpha:.4g}"
