"""Classifier-free guidance (Ho and Salimans, arXiv 2207.12598) the way DiT (arXiv 2212.09748) runs it.

The batch is doubled: the first half carries the class labels, the second half the null class
(index ``num_classes``, the label a DiT learns through class dropout). The guided noise is
``eps_uncond + s (eps_cond - eps_uncond)`` on the ``eps`` channels; the variance channels of a
``learn_sigma`` model keep the conditional half's values. A DiT's ``forward_with_cfg(x, t, y, s)``
does the combination for such a doubled batch and returns it duplicated; any other denoiser
``model(x, t, y)`` (a stand-in, an oracle in a test) is combined here the same way.
"""

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
    """The guided model output at ``(x, t, y)`` with scale ``cfg_scale`` (``(B, out_ch, H, W)``).

    Always runs the doubled batch (scale 1 gives the conditional output up to rounding); samplers
    call it only when ``cfg_scale != 1``.
    """
    b, channels = len(x), x.shape[1]
    xx, tt = torch.cat([x, x]), torch.cat([t, t])
    yy = torch.cat([y, torch.full_like(y, null_label)])
    if isinstance(model, DiT):
        return model.forward_with_cfg(xx, tt, yy, cfg_scale)[:b]
    out = model(xx, tt, yy)
    cond, uncond = out[:b, :channels], out[b:, :channels]
    return torch.cat([uncond + cfg_scale * (cond - uncond), out[:b, channels:]], dim=1)
