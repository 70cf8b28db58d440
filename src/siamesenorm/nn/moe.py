"""Mixture-of-experts feed-forward (OLMoE, arXiv 2409.02060): token-choice top-k routing, dropless."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import UserError
from .mlp import SwiGLUMLP

__all__ = ["MoE"]


class MoE(nn.Module):
    """Top-``top_k`` of ``n_experts`` SwiGLU experts per token, the weights renormalised over them
    (``normalize``), plus an optional shared expert (``shared_hidden``; 0: none).

    Each forward sets :attr:`aux_loss` (``E * sum_i f_i P_i``, Switch Transformer) and :attr:`z_loss`
    (``mean_t logsumexp_t^2``, ST-MoE), unscaled, for the model to add; :attr:`load` and
    :attr:`entropy` (nats) describe it, detached."""

    def __init__(self, dim: int, n_experts: int, top_k: int, hidden: int, *, shared_hidden: int = 0,
                 normalize: bool = True, device=None, dtype=None) -> None:
        super().__init__()
        if n_experts < 1:
            raise UserError(f"an MoE needs at least one expert, got n_experts={n_experts}")
        if not 1 <= top_k <= n_experts:
            raise UserError(f"top_k must be between 1 and the number of experts ({n_experts}), "
                              f"got {top_k}")
        if hidden < 1 or shared_hidden < 0:
            raise UserError(f"expert hidden sizes must be positive, got hidden={hidden}, "
                              f"shared_hidden={shared_hidden}")
        kw = {"device": device, "dtype": dtype}
        self.dim, self.n_experts, self.top_k, self.hidden = dim, n_experts, top_k, hidden
        self.normalize = normalize
        self.router = nn.Linear(dim, n_experts, bias=False, **kw)
        # expert e: gate/up (dim -> hidden) and down (hidden -> dim), stored as x @ W matrices
        self.w_gate = nn.Parameter(torch.empty(n_experts, dim, hidden, **kw))
        self.w_up = nn.Parameter(torch.empty(n_experts, dim, hidden, **kw))
        self.w_down = nn.Parameter(torch.empty(n_experts, hidden, dim, **kw))
        self.shared = SwiGLUMLP(dim, shared_hidden, **kw) if shared_hidden else None
        self.aux_loss: Tensor | None = None
        self.z_loss: Tensor | None = None
        self.load: Tensor | None = None
        self.entropy: Tensor | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """As ``nn.Linear`` would, for every expert matrix."""
        self.router.reset_parameters()
        for w in (self.w_gate, self.w_up, self.w_down):
            bound = 1 / math.sqrt(w.shape[1])
            nn.init.uniform_(w, -bound, bound)
        if self.shared is not None:
            self.shared.reset_parameters()

    def extra_repr(self) -> str:
        shared = f", shared_hidden={self.shared.hidden}" if self.shared is not None else ""
        return (f"dim={self.dim}, n_experts={self.n_experts}, top_k={self.top_k}, "
                f"hidden={self.hidden}{shared}, normalize={self.normalize}")

    # ---- routing -----------------------------------------------------------------------------
    def route(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(logits, experts, weights)`` for ``x`` (tokens, dim): the logits in float32 for half inputs,
        each token's ``top_k`` experts and their weights."""
        logits = self.router(x)
        if logits.dtype in (torch.float16, torch.bfloat16):
            logits = logits.float()
        probs = logits.softmax(-1)
        weights, experts = probs.topk(self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(-1, keepdim=True)
        return logits, experts, weights

    def _losses(self, logits: Tensor, experts: Tensor) -> None:
        probs = logits.softmax(-1)
        chosen = torch.zeros_like(probs).scatter_(1, experts, 1.0)      # tokens x experts, 0/1
        fraction = chosen.mean(0)                                       # f_i (sums to top_k)
        self.aux_loss = self.n_experts * (fraction * probs.mean(0)).sum()
        self.z_loss = torch.logsumexp(logits, -1).square().mean()
        with torch.no_grad():
            self.load = fraction / self.top_k
            self.entropy = -(probs * probs.clamp_min(1e-30).log()).sum(-1).mean()

    # ---- forward -----------------------------------------------------------------------------
    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, self.dim)
        logits, experts, weights = self.route(flat)
        self._losses(logits, experts)
        tokens = flat.shape[0]
        # every (token, expert) assignment, sorted by expert so each expert's tokens are contiguous
        assigned = experts.reshape(-1)
        order = assigned.argsort(stable=True)
        source = torch.arange(tokens, device=x.device).repeat_interleave(self.top_k)[order]
        if x.device.type == "meta":
            # shapes only (the dry run): an even split. Dropless routing processes tokens x top_k
            # rows whatever the split, so the activation bytes are those of any real routing.
            share, extra = divmod(tokens * self.top_k, self.n_experts)
            counts = [share + (e < extra) for e in range(self.n_experts)]
        else:
            counts = torch.bincount(assigned, minlength=self.n_experts).tolist()
        inputs = flat[source]
        outputs = []
        for e, chunk in enumerate(inputs.split(counts)):
            # an expert without tokens still runs (on none), so each expert's weights take part in
            # every backward (zero gradients): DDP expects every parameter to be used each step
            h = F.silu(chunk @ self.w_gate[e]) * (chunk @ self.w_up[e])
            outputs.append(h @ self.w_down[e])
        mixed = torch.cat(outputs) * weights.reshape(-1)[order].unsqueeze(-1).to(flat.dtype)
        out = torch.zeros_like(flat).index_add_(0, source, mixed)
        if self.shared is not None:
            out = out + self.shared(flat)
        return out.reshape(shape)

    def num_experts_unused_parameters(self) -> int:
        """Parameters of the ``n_experts - top_k`` experts a token does not reach."""
        per_expert = self.w_gate[0].numel() + self.w_up[0].numel() + self.w_down[0].numel()
        return (self.n_experts - self.top_k) * per_expert

    def active_parameters(self) -> int:
        """Parameters one token uses: the router, ``top_k`` experts and the shared expert."""
        per_expert = self.w_gate[0].numel() + self.w_up[0].numel() + self.w_down[0].numel()
        shared = sum(p.numel() for p in self.shared.parameters()) if self.shared is not None else 0
        return self.router.weight.numel() + self.top_k * per_expert + shared
