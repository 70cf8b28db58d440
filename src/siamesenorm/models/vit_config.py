"""Configuration of the DeiT-style vision transformer, validated on construction, and its sizes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..nn.depth_attention import check_depth_attention
from ..nn.norms import NORM_KINDS
from . import config_checks as check

_OWNER = "ViTConfig"

# The DeiT paper's sizes (arXiv 2012.12877, Table 1; patch 16 at 224 px, drop-path 0.1), and a
# tiny size that trains on the 8x8 handwritten digits on two CPU cores.
VIT_SIZES: dict[str, dict[str, Any]] = {
    "DeiT-T": {"image_size": 224, "patch_size": 16, "dim": 192, "n_layers": 12, "n_heads": 3},
    "DeiT-S": {"image_size": 224, "patch_size": 16, "dim": 384, "n_layers": 12, "n_heads": 6},
    "DeiT-B": {"image_size": 224, "patch_size": 16, "dim": 768, "n_layers": 12, "n_heads": 12},
    "digits": {"image_size": 8, "patch_size": 2, "in_chans": 1, "num_classes": 10, "dim": 64,
               "n_layers": 6, "n_heads": 4, "drop_path": 0.0},
}


@dataclass(frozen=True)
class ViTConfig:
    """Vision transformer in the DeiT style (arXiv 2012.12877) over any residual scheme: one class
    token and ``(image_size / patch_size) ** 2`` patches, MLP size ``int(dim * mlp_ratio)``,
    stochastic depth rising linearly to ``drop_path`` at the last block, ``label_smoothing`` as DeiT
    applies it (folded into mixup/cutmix targets unless ``data.augment.smoothing`` is set)."""

    image_size: int = 224
    patch_size: int = 16
    in_chans: int = 3
    num_classes: int = 1000
    dim: int = 192
    n_layers: int = 12
    n_heads: int = 3
    mlp_ratio: float = 4.0
    drop_path: float = 0.1
    dropout: float = 0.0
    scheme: str = "pre"
    scheme_options: dict[str, Any] = field(default_factory=dict)
    norm: str = "layernorm"
    norm_eps: float = 1e-6
    label_smoothing: float = 0.1
    init_std: float = 0.02
    depth_attention: bool = False
    depth_attention_stride: int | None = None

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "in_chans", "num_classes", "dim", "n_layers",
                     "n_heads"):
            check.positive_int(_OWNER, name, getattr(self, name))
        for name in ("mlp_ratio", "norm_eps", "init_std"):
            check.positive_number(_OWNER, name, getattr(self, name))
        for name in ("drop_path", "dropout", "label_smoothing"):
            check.probability(_OWNER, name, getattr(self, name))
        check.divisible(_OWNER, "image_size", self.image_size, f"{_OWNER}.patch_size",
                        self.patch_size)
        check.divisible(_OWNER, "dim", self.dim, f"{_OWNER}.n_heads", self.n_heads)
        check.mlp_hidden(_OWNER, self.dim, self.mlp_ratio)
        check.OneOf(NORM_KINDS)(_OWNER, "norm", self.norm)
        check.scheme_name(_OWNER, "scheme", self.scheme)
        check.scheme_options(_OWNER, "scheme_options", self.scheme_options)
        check_depth_attention(self.depth_attention, self.depth_attention_stride)
        check.buildable(_OWNER, self.n_layers, self.estimated_parameters())
        check.resolve_model_scheme(self)

    @property
    def resolved_scheme(self) -> Any:
        """The scheme's class and its options, filled and checked once."""
        return check.resolved_scheme(self)

    def estimated_parameters(self) -> int:
        """The parameters of the patch embedding, class token, position embedding, every block's
        attention and MLP, and the head, from the sizes alone (norms and the scheme's own
        parameters, which are few, left out): what :func:`~.config_checks.buildable` bounds."""
        d, h, lin = self.dim, int(self.dim * self.mlp_ratio), check.linear
        block = 4 * lin(d, d, True) + lin(d, h, True) + lin(h, d, True)
        return (self.in_chans * self.patch_size ** 2 * d + d + d + (self.num_patches + 1) * d
                + self.n_layers * block + lin(d, self.num_classes, True))

    @classmethod
    def from_size(cls, size: str, **overrides: Any) -> ViTConfig:
        """The config of a named size in :data:`VIT_SIZES`, with ``overrides`` on top."""
        return cls(**(check.size_preset(_OWNER, VIT_SIZES, size) | overrides))

    @property
    def grid_size(self) -> int:
        """Patches per side."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid_size ** 2

    @property
    def seq_len(self) -> int:
        """Tokens per image: the class token and the patches."""
        return self.num_patches + 1

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        return int(self.dim * self.mlp_ratio)
