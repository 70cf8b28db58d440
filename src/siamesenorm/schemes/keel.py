"""Keel: Post-Norm with a Highway-style, up-weighted skip and a normalised branch input
(arXiv 2601.19895)."""

from __future__ import annotations

from dataclasses import replace

from torch import Tensor

from .base import Branch, Number, Option, ResidualScheme, register_scheme


@register_scheme
class Keel(ResidualScheme):
    """Keel (Chen, Wei et al. 2026, ByteDance Seed, "Post-LayerNorm Is Back", arXiv 2601.19895).

    Post-Norm whose skip is scaled by ``alpha`` and whose branch reads a normalised stream::

        h <- LN^post_i(alpha * h + F_i(LN^pre_i(h)))

    ``alpha=None`` (default) is the paper's ``alpha = L``, the number of sublayers
    (``2 * n_layers``); a number overrides it. The skip carries ``alpha``-times the weight of the
    branch, so the gradient through ``LN^post`` reaches the first sublayers almost undamped; the
    stream stays normalised as in Post-Norm. The last ``LN^post`` already normalises the output, so
    as in ``post`` there is no final norm unless ``final_norm=True``. ``LN^pre`` feeds the branch
    alone (``branch_affine``). Parameters: ``post_norm[i]``, ``pre_norm[i]`` (and ``final_norm``).
    The equation and ``alpha = L`` come from summaries of the paper (its method section was not
    available to us); docs/schemes.md says what is and is not confirmed.
    """

    name = "keel"
    role_norm_names = ("pre_norm", "final_norm")
    summary = "h = LN(alpha*h + F(LN(h))), alpha = 2*n_layers"
    paper = "Chen, Wei et al. 2026, arXiv 2601.19895"
    options = {"alpha": Option(None, Number(low=0, optional=True)),
               "final_norm": replace(ResidualScheme.options["final_norm"], default=False)}

    def __init__(self, dim: int, n_layers: int, **kwargs) -> None:
        super().__init__(dim, n_layers, **kwargs)
        self.alpha = float(self.n_sublayers if self.alpha is None else self.alpha)
        self.pre_norm = self.make_branch_norms(self.n_sublayers)
        self.post_norm = self.make_norms(self.n_sublayers)
        self.final_norm = self.make_final_norm()

    def step(self, state: Tensor, i: int, branch: Branch) -> Tensor:
        return self.post_norm[i](self.alpha * state + branch(self.pre_norm[i](state)))

    def exit(self, state: Tensor) -> Tensor:
        return state if self.final_norm is None else self.final_norm(state)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, alpha={self.alpha:.4g}"
