"""Attention Residuals: each sublayer reads a softmax mix of all earlier outputs (arXiv 2603.15031)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..errors import UserError
from ..nn.depth_mix import depth_mix
from ..nn.norms import build_norm
from .base import Branch, Number, Option, ResidualScheme, register_scheme


@register_scheme
class AttentionResiduals(ResidualScheme):
    """Attention Residuals, AttnRes (Kimi Team, arXiv 2603.15031; Eqs. 1-6 and Fig. 2).

    ``x_i = sum_j softmax_j(w_i . RMSNorm_i(v_j)) v_j`` over ``v_0 = h`` and the outputs
    ``v_{j+1} = F_j(LN_j(x_j))``; with ``block_size=S`` each block of ``S`` sublayers is one source,
    the sum of its outputs (Eqs. 5-6). The state is the tuple of sources."""

    name = "attn_res"
    role_norm_names = ("input_norm", "final_norm")  # each sublayer"s mix of sources
    summary = "x = sum_j softmax_j(w . RMSNorm(v_j)) v_j; v = F(LN(x)); out = LN(mix of all v)"
    paper = "Kimi Team 2026, arXiv 2603.15031"
    options = {"block_size": Option(None, Number(low=1, integer=True, optional=True))}

    def __init__(self, dim: int, n_layers: int, **kwargs) -> None:
        super().__init__(dim, n_layers, **kwargs)
        s, kw = self.n_sublayers, self._factory
        if self.block_size is not None and self.block_size > s:
            raise UserError(f"scheme {self.name!r}: option block_size={self.block_size} is more than "
                              f"the {s} sublayers ({n_layers} blocks of attention and MLP)")
        # Sublayer 0 reads the embedding alone (a softmax over one source is 1): no query, no key
        # norm. Row i - 1 of pseudo_query and key_norm[i - 1] belong to sublayer i >= 1.
        self.pseudo_query = nn.Parameter(torch.empty(s - 1, dim, **kw))
        self.key_norm = nn.ModuleList(self._make_key_norm() for _ in range(s - 1))
        self.input_norm = self.make_branch_norms(s)
        self.output_query = nn.Parameter(torch.empty(dim, **kw))
        self.output_key_norm = self._make_key_norm()
        self.final_norm = self.make_final_norm()
        self.reset_parameters()

    def _make_key_norm(self) -> nn.Module:
        return build_norm("rmsnorm", self.dim, self.eps, **self._factory)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        with torch.no_grad():
            self.pseudo_query.zero_()
            self.output_query.zero_()

    def starts_block(self, i: int) -> bool:
        """Whether sublayer ``i`` is the first of a block (every sublayer in the full form)."""
        return self.block_size is None or i % self.block_size == 0

    def mix(self, sources: tuple[Tensor, ...], query: Tensor, key_norm: nn.Module,
            norm: nn.Module | None = None) -> Tensor:
        """``sum_j softmax_j(query . key_norm(v_j)) v_j`` over the sources ``v_j`` (then ``norm``)."""
        return depth_mix(sources, query, key_norm.weight, key_norm.eps, norm)

    def entry(self, i: int, state: tuple[Tensor, ...]) -> Tensor:
        """The branch input ``LN_i(x_i)``."""
        if i == 0:
            return self.input_norm[0](state[0])
        return self.mix(state, self.pseudo_query[i - 1], self.key_norm[i - 1], self.input_norm[i])

    # ----------------------------------------------------------------------------------------
    def enter(self, h: Tensor) -> tuple[Tensor, ...]:
        return (h,)

    def step(self, state: tuple, i: int, branch: Branch) -> tuple[Tensor, ...]:
        out = branch(self.entry(i, state))
        if self.starts_block(i):        # the last source is complete: out opens a new one
            return (*state, out)
        return (*state[:-1], state[-1] + out)

    def exit(self, state: tuple) -> Tensor:
        h = self.mix(state, self.output_query, self.output_key_norm)
        return h if self.final_norm is None else self.final_norm(h)

    def streams(self, state: tuple) -> dict[str, Tensor]:
        """The sum of the sources: what standard residuals would carry (``h + sum_j F_j``)."""
        total = state[0]
        for source in state[1:]:
            total = total + source
        return {"sum": total}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, block_size={self.block_size}"
