"""Rotary position embeddings (RoPE), rotate-half convention."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..errors import UserError


class RotaryEmbedding(nn.Module):
    """Rotate q or k, ``(B, H, T, head_dim)``, by their positions. The cos/sin tables are non-persistent
    buffers, in at least float32; :meth:`reset_parameters` recomputes them (after the meta device)."""

    def __init__(self, head_dim: int, max_seq_len: int, theta: float = 10000.0, *,
                 device=None, dtype=None) -> None:
        super().__init__()
        if head_dim <= 0 or head_dim % 2:
            raise UserError(f"RoPE needs an even head_dim (dim // n_heads), got {head_dim}")
        if max_seq_len <= 0:
            raise UserError(f"max_seq_len must be positive, got {max_seq_len}")
        if not theta > 0:
            raise UserError(f"rope_theta must be positive, got {theta!r}")
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, float(theta)
        table_dtype = torch.float32
        if dtype is not None and dtype.is_floating_point:
            table_dtype = torch.promote_types(dtype, torch.float32)
        shape = (max_seq_len, head_dim // 2)
        self.register_buffer("cos", torch.empty(shape, device=device, dtype=table_dtype),
                             persistent=False)
        self.register_buffer("sin", torch.empty(shape, device=device, dtype=table_dtype),
                             persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        device, half = self.cos.device, self.head_dim // 2
        exponent = torch.arange(half, device=device, dtype=torch.float64) * 2.0 / self.head_dim
        inv_freq = self.theta ** -exponent
        positions = torch.arange(self.max_seq_len, device=device, dtype=torch.float64)
        angles = torch.outer(positions, inv_freq)
        self.cos.copy_(angles.cos())
        self.sin.copy_(angles.sin())

    def forward(self, x: Tensor, pos: int | Tensor = 0) -> Tensor:
        """Rotate ``x`` (..., T, head_dim) as if its first row sat at ``pos``; or, ``pos`` a (B, T) tensor,
        row ``t`` of sequence ``b`` at ``pos[b, t]`` (left-padded batches)."""
        t = x.shape[-2]
        if isinstance(pos, Tensor):
            if pos.shape != (x.shape[0], t):
                raise ValueError(f"positions of shape {tuple(pos.shape)} do not match the "
                                 f"{x.shape[0]} x {t} input")
            # a data-dependent check would synchronise a GPU: indexing past the table fails anyway
            cos, sin = self.cos[pos].unsqueeze(1), self.sin[pos].unsqueeze(1)   # (B, 1, T, d/2)
        else:
            if pos < 0 or pos + t > self.max_seq_len:
                raise ValueError(f"positions {pos}..{pos + t - 1} exceed max_seq_len="
                                 f"{self.max_seq_len}; raise max_seq_len or shorten the input")
            cos, sin = self.cos[pos:pos + t], self.sin[pos:pos + t]
        work = torch.promote_types(x.dtype, cos.dtype)
        x1, x2 = x.to(work).chunk(2, dim=-1)
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        return out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, max_seq_len={self.max_seq_len}, theta={self.theta}"
