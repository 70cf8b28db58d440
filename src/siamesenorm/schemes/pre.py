"""Pre-Norm and Post-Norm, the two classic placements."""

from __future__ import annotations

from dataclasses import replace

from torch import Tensor

from .base import Branch, ResidualScheme, register_scheme
from .fusion import AddThenNorm, fuses


@register_scheme
@fuses(AddThenNorm(entry="pre_norm", exit="final_norm"))
class PreNorm(ResidualScheme):
    """Pre-Norm (Xiong et al. 2020, arXiv 2002.04745; GPT-2).

    ``h <- h + F_i(LN_i(h))`` for every sublayer, then ``LN_final(h)``. The identity path keeps the
    gradient undamped with depth, but the hidden-state norm grows and deep layers are diluted.
    Parameters: ``pre_norm[i]`` (feeds the branch: non-affine with ``branch_affine=False``),
    ``final_norm`` (``None`` with ``final_norm=False``: exit returns the stream ``h`` itself).
    """

    name = "pre"
    role_norm_names = ("pre_norm", "final_norm")
    summary = "h = h + F(LN(h)); out = LN(h)"
    paper = "Xiong et al. 2020, arXiv 2002.04745"

    def __init__(self, dim: int, n_layers: int, **kwargs) -> None:
        super().__init__(dim, n_layers, **kwargs)
        self.pre_norm = self.make_branch_norms(self.n_sublayers)
        self.final_norm = self.make_final_norm()

    def step(self, h: Tensor, i: int, branch: Branch) -> Tensor:
        return h + branch(self.pre_norm[i](h))

    def exit(self, h: Tensor) -> Tensor:
        return h if self.final_norm is None else self.final_norm(h)


@register_scheme
class PostNorm(ResidualScheme):
    """Post-Norm (Vaswani et al. 2017, arXiv 1706.03762).

    ``h <- LN_i(h + F_i(h))``; no final norm unless ``final_norm=True``.
    """

    name = "post"
    summary = "h = LN(h + F(h))"
    paper = "Vaswani et al. 2017, arXiv 1706.03762"
    options = {"final_norm": replace(ResidualScheme.options["final_norm"], default=False)}

    def __init__(self, dim: int, n_layers: int, **kwargs) -> None:
        super().__init__(dim, n_layers, **kwargs)
        self.post_norm = self.make_norms(self.n_sublayers)
        self.final_norm = self.make_final_norm()

    def step(self, state: Tensor, i: int, branch: Branch) -> Tensor:
        return self.post_norm[i](state + branch(state))

    def exit(self, state: Tensor) -> Tensor:
        return state if self.final_norm is None else self.final_norm(state)
