"""Training augmentations for small images: DeiT's recipe (arXiv 2012.12877), scaled down. Every draw
comes from the generator passed in, in a fixed order, so a resumed sampler repeats its batches."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from ...errors import UserError

__all__ = ["ImageAugment", "cutmix_box", "one_hot_targets"]


@dataclass(frozen=True)
class ImageAugment:
    """Which augmentations a sampler applies; the defaults suit 8x8 digits (0 turns one off).

    With ``mixup_alpha`` or ``cutmix_alpha`` on, targets are soft ``(B, num_classes)``; with both, a
    batch uses cutmix with probability ``switch_prob``, and ``mix_prob`` is the chance it is mixed at
    all. ``smoothing`` is folded into the soft targets (a ViT run that mixes with it at 0 folds in
    ``model.label_smoothing`` instead).
    """

    translate: int = 1
    hflip: bool = False
    erase_prob: float = 0.25
    mixup_alpha: float = 0.0
    cutmix_alpha: float = 0.0
    switch_prob: float = 0.5
    mix_prob: float = 1.0
    smoothing: float = 0.0

    def __post_init__(self) -> None:
        if self.translate < 0 or self.mixup_alpha < 0 or self.cutmix_alpha < 0:
            raise UserError("augment translate, mixup_alpha and cutmix_alpha must not be negative, got "
                              f"{self.translate}, {self.mixup_alpha}, {self.cutmix_alpha}")
        for name in ("erase_prob", "switch_prob", "mix_prob"):
            if not 0 <= getattr(self, name) <= 1:
                raise UserError(f"augment {name} must be in [0, 1], got {getattr(self, name)}")
        if not 0 <= self.smoothing < 1:
            raise UserError(f"augment smoothing must be in [0, 1), got {self.smoothing}")

    @property
    def mixes(self) -> bool:
        return self.mixup_alpha > 0 or self.cutmix_alpha > 0

    def __call__(self, x: Tensor, y: Tensor, num_classes: int,
                 generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """Augment ``x (B, C, H, W)`` in [-1, 1] and labels ``y (B,)`` (soft targets when mixing)."""
        if self.translate:
            x = translate(x, self.translate, generator)
        if self.hflip:
            flip = torch.rand(len(x), generator=generator) < 0.5
            x = torch.where(flip[:, None, None, None], x.flip(-1), x)
        if self.erase_prob > 0:
            x = random_erase(x, self.erase_prob, generator)
        if self.mixes:
            return self._mix(x, y, num_classes, generator)
        return x, y

    def _mix(self, x: Tensor, y: Tensor, num_classes: int,
             generator: torch.Generator) -> tuple[Tensor, Tensor]:
        u = torch.rand(2, generator=generator, dtype=torch.float64).tolist()
        seed = int(torch.randint(0, 2**62, (1,), generator=generator))
        targets = one_hot_targets(y, num_classes, self.smoothing)
        if u[0] >= self.mix_prob:
            return x, targets
        use_cutmix = self.cutmix_alpha > 0 and (self.mixup_alpha == 0 or u[1] < self.switch_prob)
        alpha = self.cutmix_alpha if use_cutmix else self.mixup_alpha
        lam = float(np.random.default_rng(seed).beta(alpha, alpha))   # torch's Beta takes no generator
        partner = x.flip(0)
        if use_cutmix:
            top, bottom, left, right = cutmix_box(x.shape[-2], x.shape[-1], lam, generator)
            x = x.clone()
            x[..., top:bottom, left:right] = partner[..., top:bottom, left:right]
            lam = 1.0 - (bottom - top) * (right - left) / (x.shape[-2] * x.shape[-1])
        else:
            x = lam * x + (1.0 - lam) * partner
        return x, lam * targets + (1.0 - lam) * targets.flip(0)


def one_hot_targets(y: Tensor, num_classes: int, smoothing: float = 0.0) -> Tensor:
    """Float ``(B, num_classes)`` targets: ``1 - smoothing + smoothing / K`` on the label."""
    off = smoothing / num_classes
    return F.one_hot(y, num_classes).float() * (1.0 - smoothing) + off


def translate(x: Tensor, pad: int, generator: torch.Generator) -> Tensor:
    """Shift each image by a random offset in ``[-pad, pad]`` per axis, filling with black (-1)."""
    b, _, h, w = x.shape
    shifts = torch.randint(0, 2 * pad + 1, (2, b), generator=generator)
    padded = F.pad(x, (pad, pad, pad, pad), value=-1.0)
    rows = (shifts[0][:, None] + torch.arange(h))[:, None, :, None]          # (B, 1, H, 1)
    cols = (shifts[1][:, None] + torch.arange(w))[:, None, None, :]          # (B, 1, 1, W)
    batch = torch.arange(b)[:, None, None, None]
    chans = torch.arange(x.shape[1])[None, :, None, None]
    return padded[batch, chans, rows, cols]


def random_erase(x: Tensor, prob: float, generator: torch.Generator, *,
                 area: tuple[float, float] = (0.02, 1 / 3), ratio: tuple[float, float] = (0.3, 1 / 0.3),
                 attempts: int = 10) -> Tensor:
    """Random erasing (arXiv 1708.04896): with probability ``prob`` per image, the first of ``attempts``
    rectangles (``area`` fraction, log-uniform aspect ``ratio``) that fits is filled with uniform noise."""
    b, c, h, w = x.shape
    out = x.clone()
    apply = (torch.rand(b, generator=generator) < prob).tolist()
    fracs = torch.empty(b, attempts, dtype=torch.float64).uniform_(area[0], area[1], generator=generator)
    logs = torch.empty(b, attempts, dtype=torch.float64).uniform_(math.log(ratio[0]), math.log(ratio[1]),
                                                                   generator=generator)
    corners = torch.rand(b, attempts, 2, generator=generator, dtype=torch.float64)
    noise = torch.rand(b, c, h, w, generator=generator, dtype=x.dtype) * 2.0 - 1.0
    for i in range(b):
        if not apply[i]:
            continue
        for k in range(attempts):
            target, aspect = fracs[i, k].item() * h * w, math.exp(logs[i, k].item())
            eh, ew = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
            if 0 < eh < h and 0 < ew < w:
                top = int(corners[i, k, 0].item() * (h - eh + 1))
                left = int(corners[i, k, 1].item() * (w - ew + 1))
                out[i, :, top:top + eh, left:left + ew] = noise[i, :, top:top + eh, left:left + ew]
                break
    return out


def cutmix_box(h: int, w: int, lam: float, generator: torch.Generator) -> tuple[int, int, int, int]:
    """``(top, bottom, left, right)`` of a clipped box of about ``1 - lam`` of the image, randomly centred."""
    cut = math.sqrt(1.0 - lam)
    ch, cw = int(h * cut), int(w * cut)
    cy = int(torch.randint(0, h, (1,), generator=generator))
    cx = int(torch.randint(0, w, (1,), generator=generator))
    top, bottom = max(cy - ch // 2, 0), min(cy + ch // 2, h)
    left, right = max(cx - cw // 2, 0), min(cx + cw // 2, w)
    return top, bottom, left, right
