"""DeepNorm: Post-Norm with an up-weighted residual and down-scaled init (arXiv 2203.00555)."""

from __future__ import annotations

from torch import Tensor

from .base import (
    MAX_BRANCH_GAIN,
    MAX_SKIP_WEIGHT,
    Branch,
    Number,
    OneOf,
    Option,
    ResidualScheme,
    SchemeRequirements,
    register_scheme,
)


@register_scheme
class DeepNorm(ResidualScheme):
    """DeepNorm (Wang et al. 2022, DeepNet, arXiv 2203.00555).

    ``h <- LN_i(alpha * h + F_i(h))``, ``alpha = (2L)^(1/4)``, with Xavier init of gain
    ``beta = (8L)^(-1/4)`` on v, out and the FFN weights (``L = n_layers``); options override both."""

    name = "deepnorm"
    summary = "h = LN(alpha*h + F(h)), Xavier init x beta"
    paper = "Wang et al. 2022, arXiv 2203.00555"
    options = {"arch": Option("decoder", OneOf(("decoder", "encoder"))),
               "alpha": Option(None, Number(low=0, high=MAX_SKIP_WEIGHT, optional=True)),
               "beta": Option(None, Number(low=0, high=MAX_BRANCH_GAIN, optional=True))}

    def __init__(self, dim: int, n_layers: int, **kwargs) -> None:
        super().__init__(dim, n_layers, **kwargs)
        # Decoder-only and encoder-only have the same formula, with M or N the layer count.
        self.alpha = float((2 * n_layers) ** 0.25 if self.alpha is None else self.alpha)
        self.beta = float((8 * n_layers) ** -0.25 if self.beta is None else self.beta)
        self.post_norm = self.make_norms(self.n_sublayers)
        self.requires = SchemeRequirements(init="xavier", branch_gain=self.beta)

    def step(self, state: Tensor, i: int, branch: Branch) -> Tensor:
        return self.post_norm[i](self.alpha * state + branch(state))

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, arch={self.arch}, alpha={self.alpha:.4g}, beta={self.beta:.4g}"
