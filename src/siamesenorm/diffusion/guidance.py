"""Classifier-free guidance (arXiv 2207.12598) as DiT runs it: a doubled batch, its second half with the
null class; a ``learn_sigma`` model's variance channels keep the conditional half's values."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..errors import UserError
from ..models.dit import DiT

__all__ = ["guided_output", "null_label_of"]


def null_label_of(model: nn.Module, null_label: int | None = None) -> int:
    """The null class of ``model``: ``null_label`` if given, else a DiT's ``config.num_classes``."""
    if null_label is not None:
        return int(null_label)
    if isinstance(model, DiT):
        return model.config.num_classes
    raise UserError("classifier-free guidance needs the null class: the model is not a DiT; "
                      "pass null_label=NUM_CLASSES")


def guided_output(model: nn.Module, x: Tensor, t: Tensor, y: Tensor, cfg_scale: float,
                  null_label: int) -> Tensor:
    """The guided output ``(B, out_ch, H, W)`` at ``(x, t, y)``; always runs the doubled batch."""
    b, channels = len(x), x.shape[1]
    xx, tt = torch.cat([x, x]), torch.cat([t, t])
    yy = torch.cat([y, torch.full_like(y, null_label)])
    if isinstance(model, DiT):
        return model.forward_with_cfg(xx, tt, yy, cfg_scale)[:b]
    out = model(xx, tt, yy)
    cond, uncond = out[:b, :channels], out[b:, :channels]
    return torch.cat([uncond + cfg_scale * (cond - uncond), out[:b, channels:]], dim=1)
