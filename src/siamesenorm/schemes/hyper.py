"""Hyper-connections: n residual streams mixed by learned width and depth connections (arXiv 2409.19606),
and Frac-Connections: m fractions of one stream mixed the same way (arXiv 2503.14125)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import UserError
from ..functional.mixing import stream_mix
from ..nn.fused import fused_enabled, lean_region
from ..nn.norms import build_norm, normed_product
from .base import Branch, Flag, Number, Option, ResidualScheme, register_scheme

# The most residual streams (or fractions) a multi-stream scheme takes: the papers use 2 to 8
# (HC, arXiv 2409.19606; mHC, arXiv 2512.24880, n = 4); the mixing maps grow as n^2 per sublayer.
MAX_STREAMS = 16


class MultiStreamScheme(ResidualScheme):
    """Base of hyper and mhc: state ``(..., n, d)``, n copies of h on entry, their sum on exit."""

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
    """Hyper-connections (Zhu et al., ICLR 2025, arXiv 2409.19606; Algorithm 2 of Appendix J) and,
    with ``fracs=m``, Frac-Connections (arXiv 2503.14125).

    ``mix = A^T H; H' = B (.) F_i(LN_i(mix[:c])) + mix[c:]``; ``out = LN_final(sum_k H_k)``, ``A`` and
    ``B`` static plus, with ``dynamic``, ``tanh`` of projections of ``LN(H)`` (docs/schemes.md)."""

    name = "hyper"
    role_norm_names = ("norm", "final_norm")
    summary = "mix = A^T H; H = B F(LN(mix[0])) + mix[1:]; out = LN(sum H)"
    paper = "Zhu et al., ICLR 2025, arXiv 2409.19606; fracs: arXiv 2503.14125"
    options = {"n_streams": Option(2, Number(low=1, high=MAX_STREAMS, integer=True)),
               "dynamic": Option(True, Flag()),
               "fracs": Option(1, Number(low=1, high=MAX_STREAMS, integer=True))}

    def __init__(self, dim: int, n_layers: int, **kwargs) -> None:
        super().__init__(dim, n_layers, **kwargs)
        n, m = self.n_streams, self.fracs
        k, c, w = max(n, m), m, dim // m      # rows of H, input rows of the mix, row width
        s, kw = self.n_sublayers, self._factory
        self.norm = self.make_branch_norms(s)
        self.final_norm = self.make_final_norm()
        self.static_alpha = nn.Parameter(torch.empty(s, k, c + k, **kw))
        self.static_beta = nn.Parameter(torch.empty(s, k, **kw))
        if self.dynamic:
            self.dyn_norm = nn.ModuleList(build_norm(self.norm_kind, w, self.eps, **kw) for _ in range(s))
            self.alpha_proj = nn.Parameter(torch.empty(s, w, c + k, **kw))
            self.beta_proj = nn.Parameter(torch.empty(s, w, **kw))
            self.alpha_scale = nn.Parameter(torch.empty(s, **kw))
            self.beta_scale = nn.Parameter(torch.empty(s, **kw))
        self.reset_parameters()

    @classmethod
    def check_together(cls, options: Mapping[str, Any], dim: int | None = None) -> None:
        n, m = options.get("n_streams", 2), options.get("fracs", 1)
        if m > 1 and n > 1:
            raise UserError(f"scheme 'hyper': fracs={m} splits one stream (Frac-Connections); set "
                              f"n_streams=1, streams of fractions (n_streams={n}) are not defined")
        if dim is not None and dim % m:
            raise UserError(f"scheme 'hyper': fracs={m} must divide the model width dim={dim}")

    def reset_parameters(self) -> None:
        super().reset_parameters()
        n, m = self.n_streams, self.fracs
        like = {"device": self.static_alpha.device, "dtype": self.static_alpha.dtype}
        with torch.no_grad():
            self.static_alpha.zero_()
            for i in range(self.n_sublayers):
                if m == 1:
                    self.static_alpha[i, i % n, 0] = 1.0
                else:                               # Gamma = I_m: the input is h itself
                    self.static_alpha[i, :, :m] = torch.eye(m, **like)
                self.static_alpha[i, :, m:] = torch.eye(max(n, m), **like)
            self.static_beta.fill_(1.0)
            if self.dynamic:
                self.alpha_proj.zero_()
                self.beta_proj.zero_()
                self.alpha_scale.fill_(0.01)
                self.beta_scale.fill_(0.01)

    def enter(self, h: Tensor) -> Tensor:
        return h.unflatten(-1, (self.fracs, -1)) if self.fracs > 1 else super().enter(h)

    def exit(self, state: Tensor) -> Tensor:
        if self.fracs == 1:
            return super().exit(state)
        h = state.flatten(-2)
        return h if self.final_norm is None else self.final_norm(h)

    def streams(self, state: Tensor) -> dict[str, Tensor]:
        return {"h": state.flatten(-2)} if self.fracs > 1 else super().streams(state)

    def connections(self, state: Tensor, i: int) -> tuple[Tensor, Tensor]:
        """Width connection ``A`` (..., k, c+k) and depth connection ``B`` (..., k) of sublayer i."""
        alpha, beta = self.static_alpha[i], self.static_beta[i]
        if not self.dynamic:
            return alpha, beta
        norm = self.dyn_norm[i]
        if torch.compiler.is_compiling() and getattr(norm, "kind", None) in ("rmsnorm", "layernorm"):
            # Inductor's step moves fewer bytes when the normalised state is never written and one
            # product serves both projections (docs/performance.md).
            proj = torch.cat([self.alpha_proj[i], self.beta_proj[i].unsqueeze(-1)], -1)
            z = normed_product(norm, state, proj)
            alpha_z, beta_z = z[..., :-1], z[..., -1]
        else:
            normed = norm(state)
            alpha_z, beta_z = normed @ self.alpha_proj[i], normed @ self.beta_proj[i]
        alpha = alpha + self.alpha_scale[i] * torch.tanh(alpha_z)
        beta = beta + self.beta_scale[i] * torch.tanh(beta_z)
        return alpha, beta

    def _entry(self, state: Tensor, i: int) -> tuple[Tensor, Tensor, Tensor]:
        """The branch input, ``B`` and the carried rows ``mix[c:]``."""
        alpha, beta = self.connections(state, i)
        if fused_enabled() and alpha.dim() > 2:                  # one matrix per token
            mix = stream_mix(alpha, state)                        # (..., c+k, w)
        else:
            mix = alpha.transpose(-1, -2) @ state
        c = self.fracs
        return self.norm[i](mix[..., :c, :].flatten(-2)), beta, mix[..., c:, :]

    def step(self, state: Tensor, i: int, branch: Branch) -> Tensor:
        # The connections, the mixing and the norm keep only H for backward (recomputed there).
        inp, beta, carried = lean_region(self._entry, state, i)
        out = branch(inp).unflatten(-1, (self.fracs, -1))          # (..., c, w)
        return beta.unsqueeze(-1) * out + carried

