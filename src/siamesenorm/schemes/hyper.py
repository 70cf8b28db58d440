"""Hyper-connections: n residual streams mixed by learned width and depth connections (arXiv 2409.19606)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..nn.fused import lean_region
from .base import Branch, Flag, Number, ResidualScheme, register_scheme


class MultiStreamScheme(ResidualScheme):
    """Shared by hyper and mhc: ``n_streams`` copies of the embedding on entry, a state of shape
    ``(..., n, d)``, and ``final_norm`` of the streams' sum on exit (the bare sum with
    ``final_norm=False``)."""

    n_streams: int
    final_norm: nn.Module | None

    def enter(self, h: Tensor) -> Tensor:
        return h.unsqueeze(-2).expand(*h.shape[:-1], self.n_streams, h.shape[-1])

    def exit(self, state: Tensor) -> Tensor:
        total = state.sum(-2)
        return total if self.final_norm is None else self.final_norm(total)

    def streams(self, state: Tensor) -> dict[str, Tensor]:
        return {f"h{k}": state[..., k, :] for k in range(self.n_streams)}


@register_scheme
class HyperConnections(MultiStreamScheme):
    r"""Hyper-connections (Zhu et al., ICLR 2025, arXiv 2409.19606; Algorithm 2 of its Appendix J).

    The state is ``H`` of shape ``(..., n, d)``, ``n`` copies of the embedding on entry. Sublayer
    ``i`` owns ``A = [A_m | A_r]`` (``n x (n+1)``) and ``B`` (``n``)::

        mix = A^T H                     # (n+1) rows: mix[0] is the sublayer input
        H'  = B (x) F_i(LN_i(mix[0])) + mix[1:]
        out = LN_final(sum_k H_k)

    Static init: ``A_m = e_{i mod n}``, ``A_r = I``, ``B = 1`` (equal to Pre-Norm on n copies).
    Dynamic (DHC, ``dynamic=True``): ``A = A_static + s_a * tanh(LN(H) W_a)`` and
    ``B = B_static + s_b * tanh(LN(H) W_b)``, with ``W`` initialised to 0 and ``s = 0.01``.
    The SiameseNorm paper compares with HC 2xDHC (``n_streams=2, dynamic=True``).
    Parameters: ``norm[i]``, ``static_alpha``, ``static_beta``, ``dyn_norm[i]``, ``alpha_proj``,
    ``beta_proj``, ``alpha_scale``, ``beta_scale``, ``final_norm``. ``branch_affine=False`` makes
    ``norm[i]`` non-affine (``dyn_norm`` feeds the connections, not the branch, and stays affine);
    ``final_norm=False``: exit returns ``sum_k H_k``.
    """

    name = "hyper"
    summary = "mix = A^T H; H = B F(LN(mix[0])) + mix[1:]; out = LN(sum H)"
    paper = "Zhu et al., ICLR 2025, arXiv 2409.19606"
    option_checks = {"n_streams": Number(low=1, integer=True), "dynamic": Flag()}

    def __init__(self, dim: int, n_layers: int, *, n_streams: int = 2, dynamic: bool = True,
                 norm: str = "layernorm", eps: float = 1e-5, branch_affine: bool = True,
                 final_norm: bool = True, device=None, dtype=None) -> None:
        super().__init__(dim, n_layers, norm=norm, eps=eps, branch_affine=branch_affine,
                         final_norm=final_norm, device=device, dtype=dtype)
        n = self.n_streams = self.checked("n_streams", n_streams)
        self.dynamic = self.checked("dynamic", dynamic)
        s, kw = self.n_sublayers, self._factory
        self.norm = self.make_branch_norms(s)
        self.final_norm = self.make_final_norm()
        self.static_alpha = nn.Parameter(torch.empty(s, n, n + 1, **kw))
        self.static_beta = nn.Parameter(torch.empty(s, n, **kw))
        if self.dynamic:
            self.dyn_norm = self.make_norms(s)
            self.alpha_proj = nn.Parameter(torch.empty(s, dim, n + 1, **kw))
            self.beta_proj = nn.Parameter(torch.empty(s, dim, **kw))
            self.alpha_scale = nn.Parameter(torch.empty(s, **kw))
            self.beta_scale = nn.Parameter(torch.empty(s, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        n = self.n_streams
        with torch.no_grad():
            self.static_alpha.zero_()
            for i in range(self.n_sublayers):
                self.static_alpha[i, i % n, 0] = 1.0
                self.static_alpha[i, :, 1:] = torch.eye(n)
            self.static_beta.fill_(1.0)
            if self.dynamic:
                self.alpha_proj.zero_()
                self.beta_proj.zero_()
                self.alpha_scale.fill_(0.01)
                self.beta_scale.fill_(0.01)

    def connections(self, state: Tensor, i: int) -> tuple[Tensor, Tensor]:
        """Width connection ``A`` (..., n, n+1) and depth connection ``B`` (..., n) of sublayer i."""
        alpha, beta = self.static_alpha[i], self.static_beta[i]
        if not self.dynamic:
            return alpha, beta
        normed = self.dyn_norm[i](state)
        alpha = alpha + self.alpha_scale[i] * torch.tanh(normed @ self.alpha_proj[i])
        beta = beta + self.beta_scale[i] * torch.tanh(normed @ self.beta_proj[i])
        return alpha, beta

    def _entry(self, state: Tensor, i: int) -> tuple[Tensor, Tensor, Tensor]:
        """The branch input ``LN_i(mix[0])``, ``B`` and the carried streams ``mix[1:]``."""
        alpha, beta = self.connections(state, i)
        mix = alpha.transpose(-1, -2) @ state                     # (..., n+1, d)
        return self.norm[i](mix[..., 0, :]), beta, mix[..., 1:, :]

    def step(self, state: Tensor, i: int, branch: Branch) -> Tensor:
        # The connections, the mixing and the norm keep only H for backward (recomputed there).
        inp, beta, carried = lean_region(self._entry, state, i)
        out = branch(inp)                                         # (..., d)
        return beta.unsqueeze(-1) * out.unsqueeze(-2) + carried

