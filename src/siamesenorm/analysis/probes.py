"""Cheap probes of a model's depth behaviour: per-block stream RMS and per-block gradient norms.

They work for any scheme through its ``streams()`` view of the state, so the same probe reads
Pre-Norm's single stream, SiameseNorm's X and Y, or every stream of hyper-connections.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["block_grad_norms", "stream_rms"]


def stream_rms(model: nn.Module, tokens: torch.Tensor) -> dict[str, list[float]]:
    """RMS of every stream of the scheme after each block (at the end of its MLP sublayer)."""
    scheme, out = model.scheme, {}
    state = scheme.enter(model.embed(tokens))
    for i, sub in enumerate(model.sublayers):
        state = scheme.step(state, i, sub)
        if i % 2 == 1:
            for name, s in scheme.streams(state).items():
                out.setdefault(name, []).append(s.pow(2).mean().sqrt().item())
    return out


def block_grad_norms(model: nn.Module) -> list[float]:
    """Gradient norm of the sublayer weights of each block."""
    norms = []
    for b in range(model.config.n_layers):
        grads = [p.grad for sub in model.sublayers[2 * b:2 * b + 2] for p in sub.parameters()
                 if p.grad is not None]
        norms.append(torch.sqrt(sum(g.pow(2).sum() for g in grads)).item())
    return norms
