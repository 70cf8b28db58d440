"""The small CNN behind the FD-proxy score (NOT Inception-v3): conv stages down to at most 4x4, a global
average pool (the features) and a linear head; about 15k parameters at 8x8 with ``width=16``."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
from torch import Tensor, nn

from ..errors import UserError

__all__ = ["ProxyNet", "ProxySettings"]


@dataclass(frozen=True)
class ProxySettings:
    """How the proxy classifier is built and trained (AdamW, cosine decay to 0); part of its cache key."""

    width: int = 16
    epochs: int = 15
    batch_size: int = 128
    lr: float = 8e-3
    weight_decay: float = 1e-4
    val_fraction: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.width < 1 or self.epochs < 1 or self.batch_size < 1 or not self.lr > 0:
            raise UserError(f"proxy settings need positive width, epochs, batch_size and lr, got {self}")
        if not 0 < self.val_fraction < 1:
            raise UserError(f"proxy val_fraction must be in (0, 1), got {self.val_fraction}")

    def to_dict(self) -> dict:
        return asdict(self)


def _stage_count(image_size: int) -> int:
    return 1 + max(0, math.ceil(math.log2(image_size / 4)))


class ProxyNet(nn.Module):
    def __init__(self, in_chans: int, image_size: int, num_classes: int, width: int = 16, *,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if in_chans < 1 or image_size < 1 or num_classes < 2:
            raise UserError(f"the proxy classifier needs in_chans >= 1, image_size >= 1 and at least 2 "
                              f"classes, got {in_chans}, {image_size}, {num_classes}")
        self.in_chans, self.image_size, self.num_classes = in_chans, image_size, num_classes
        factory = {"device": device, "dtype": dtype}
        layers: list[nn.Module] = []
        channels = in_chans
        for stage in range(_stage_count(image_size)):
            out = width * 2 ** min(stage, 2)
            for k in range(1 if stage == 0 else 2):
                stride = 2 if stage > 0 and k == 0 else 1
                layers += [nn.Conv2d(channels, out, 3, stride, 1, **factory),
                           nn.GroupNorm(min(4, out), out, **factory), nn.ReLU()]
                channels = out
        self.body = nn.Sequential(*layers)
        self.feature_dim = channels
        self.head = nn.Linear(channels, num_classes, **factory)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, nonlinearity="relu")
                nn.init.zeros_(module.bias)
            elif isinstance(module, nn.GroupNorm):
                nn.init.ones_(module.weight)
                nn.init.zeros_(module.bias)
        nn.init.normal_(self.head.weight, std=0.01)
        nn.init.zeros_(self.head.bias)

    def features(self, x: Tensor) -> Tensor:
        """``(B, feature_dim)``: the globally pooled last conv stage."""
        return self.body(x).mean(dim=(2, 3))

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.features(x))
