"""Keel: Post-Norm with a Highway-style, up-weighted skip and a normalised branch input
(arXiv 2601.19895)."""

from __future__ import annotations

from dataclasses import replace

from torch import Tensor

from ..nn.fused import stream_entry
from .base import MAX_SKIP_WEIGHT, Branch, Number, Option, ResidualScheme, register_scheme


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
    options = {"alpha": Option(None, Number(low=0, high=MAX_SKIP_WEIGHT, optional=True)),
               "final_norm": replace(ResidualScheme.options["final_norm"], default=False)}

    def __init__(self, dim: int, n_layers: int, **kwargs) -> None:
        super().__init__(dim, n_layers, **kwargs)
        self.alpha = float(self.n_sublayers if self.alpha is None else self.alpha)
        self.pre_norm = self.make_branch_norms(self.n_sublayers)
        self.post_norm = self.make_norms(self.n_sublayers)
        self.final_norm = self.make_final_norm()

    def step(self, state: Tensor | tuple, i: int, branch: Branch) -> Tensor | tuple:
        # state: h, or (h, LN^pre_i(h)): the previous sublayer's LN^post and this one's LN^pre ran
        # as one lean entry (nn.fused.stream_entry), which keeps their input alone. Only from a
        # block's attention to its MLP: a block's norms are its own (OLMo-core's blocks, FSDP units).
        h, normed = state if isinstance(state, tuple) else (state, self.pre_norm[i](state))
        s = self.alpha * h + branch(normed)
        if self.is_attention(i):
            return stream_entry(s, x_norm=self.post_norm[i], in_norm=self.pre_norm[i + 1])
        return self.post_norm[i](s)

    def exit(self, state: Tensor | tuple) -> Tensor:
        h = state[0] if isinstance(state, tuple) else state
        return h if self.final_norm is None else self.final_norm(h)

    def streams(self, state: Tensor | tuple) -> dict[str, Tensor]:
        return {"h": state[0] if isinstance(state, tuple) else state}

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, alpha={self.alpha:.4g}"
