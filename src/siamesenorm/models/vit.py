"""Vision transformer in the DeiT style (arXiv 2012.12877) over any residual scheme: with ``"pre"``
it is DeiT, with ``"siamese"`` the official SiameseNorm DeiT."""

from __future__ import annotations

from functools import partial
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.attention import Attention
from ..nn.depth_attention import DepthKeysValues, depth_stride
from ..nn.mlp import GELUMLP
from .host import (
    SchemeHost,
    branch_weights,
    build_sublayers,
    honour_requirements,
    reset_sublayer_norms,
    rng_devices,
)
from .stack import ResidualStack
from .vit_config import VIT_SIZES, ViTConfig

__all__ = ["VIT_SIZES", "ViTConfig", "ViTOutput", "VisionTransformer", "drop_path"]


class ViTOutput(NamedTuple):
    """``logits``: ``(B, num_classes)``; ``loss``: mean cross-entropy or ``None``."""

    logits: Tensor
    loss: Tensor | None


def drop_path(x: Tensor, rate: float, training: bool = True) -> Tensor:
    """Stochastic depth: zero ``x`` for a fraction ``rate`` of the samples (first axis), scale the rest by
    ``1 / (1 - rate)``; the identity outside training."""
    if rate == 0.0 or not training:
        return x
    keep = 1.0 - rate
    mask = torch.empty((x.shape[0],) + (1,) * (x.dim() - 1), device=x.device, dtype=x.dtype)
    return x * mask.bernoulli_(keep) / keep


def _dropped(sublayer: nn.Module, rate: float, u: Tensor, **kwargs: Any) -> Tensor:
    return drop_path(sublayer(u, **kwargs), rate, True)


def _trunc_normal(weight: Tensor, std: float) -> None:
    """timm's ``trunc_normal_``, cut at +-2 (absolute)."""
    nn.init.trunc_normal_(weight, 0.0, std, -2.0, 2.0)


class VisionTransformer(ResidualStack, SchemeHost):
    """Image classifier from a :class:`ViTConfig`: the scheme owns every norm, the head reads the class
    token, and the stochastic-depth rate rises linearly from 0 in block 0 to ``drop_path``."""

    def __init__(self, config: ViTConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.config = cfg = config
        kw = {"device": device, "dtype": dtype}
        # Fork the generator so that the default inits below leave the caller's state to
        # reset_parameters(), exactly as a meta-device build followed by reset_parameters() does.
        with torch.random.fork_rng(**rng_devices(device)):
            self.scheme = cfg.resolved_scheme.build(cfg.dim, cfg.n_layers, norm=cfg.norm,
                                                    eps=cfg.norm_eps, **kw)
            self.patch_embed = nn.Conv2d(cfg.in_chans, cfg.dim, cfg.patch_size,
                                         stride=cfg.patch_size, **kw)
            self.cls_token = nn.Parameter(torch.empty(1, 1, cfg.dim, **kw))
            self.pos_embed = nn.Parameter(torch.empty(1, cfg.seq_len, cfg.dim, **kw))
            self.sublayers = build_sublayers(
                self.scheme,
                lambda block, qkv_norm: Attention(
                    cfg.dim, cfg.n_heads, qkv_norm=qkv_norm, norm=cfg.norm, norm_eps=cfg.norm_eps,
                    bias=True, dropout=cfg.dropout, layer_idx=block, causal=False, rope=False,
                    max_seq_len=cfg.seq_len, depth_attention=cfg.depth_attention, **kw),
                lambda block: GELUMLP(cfg.dim, cfg.hidden_dim, bias=True, dropout=cfg.dropout, **kw))
            self.head = nn.Linear(cfg.dim, cfg.num_classes, **kw)
        self.drop_path_rates = [cfg.drop_path * b / max(cfg.n_layers - 1, 1)
                                for b in range(cfg.n_layers)]
        self.reset_parameters()

    # ---- initialisation ----------------------------------------------------------------------
    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-initialise every parameter in a fixed order from the torch generator, as DeiT (truncated
        normal, std ``init_std``), honouring the scheme's ``requires``."""
        std = self.config.init_std
        self.scheme.reset_parameters()
        reset_sublayer_norms(self.sublayers)
        self.patch_embed.reset_parameters()
        _trunc_normal(self.pos_embed, std)
        _trunc_normal(self.cls_token, std)
        honour_requirements(branch_weights(self.sublayers), self.scheme.requires,
                            native=lambda branch: _trunc_normal(branch.weight, std))
        _trunc_normal(self.head.weight, std)
        nn.init.zeros_(self.head.bias)

    # ---- forward -----------------------------------------------------------------------------
    def _check_images(self, images: Tensor) -> None:
        cfg = self.config
        want = (cfg.in_chans, cfg.image_size, cfg.image_size)
        if images.dim() != 4 or tuple(images.shape[1:]) != want:
            raise ValueError(f"images must have shape (batch, {', '.join(map(str, want))}), got "
                              f"{tuple(images.shape)}; resize them or change ViTConfig")

    def embed(self, images: Tensor) -> Tensor:
        """Tokens ``(B, 1 + num_patches, dim)``: class token and patches, plus positions."""
        self._check_images(images)
        patches = self.patch_embed(images).flatten(2).transpose(1, 2)
        cls = self.cls_token.expand(patches.shape[0], -1, -1)
        h = torch.cat((cls, patches), dim=1) + self.pos_embed
        return F.dropout(h, self.config.dropout, self.training)

    def forward_tokens(self, images: Tensor) -> Tensor:
        """``scheme.exit`` of the final state, every token: ``(B, 1 + num_patches, dim)``."""
        cfg, attend = self.config, None
        if cfg.depth_attention:          # the source layers' keys and values, for the later ones
            attend = {"depth_kv": DepthKeysValues(depth_stride(cfg.depth_attention_stride, cfg.n_layers))}
        return self.run(self.embed(images), attention_kwargs=attend, wrap=self._stochastic_depth)

    def _stochastic_depth(self, i: int, sublayer: nn.Module):
        rate = self.drop_path_rates[i // 2]
        return partial(_dropped, sublayer, rate) if self.training and rate > 0 else sublayer

    def features(self, images: Tensor) -> Tensor:
        """The class token of ``scheme.exit(state)``: ``(B, dim)``."""
        return self.forward_tokens(images)[:, 0]

    def forward(self, images: Tensor, targets: Tensor | None = None) -> ViTOutput:
        """Logits for ``images`` (B, in_chans, image_size, image_size); with ``targets``, class indices
        (B,) or probabilities (B, num_classes), the loss too."""
        logits = self.head(self.features(images))
        return ViTOutput(logits, None if targets is None else self.loss(logits, targets))

    def loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        """Mean cross-entropy in at least float32; ``label_smoothing`` applies to integer targets in
        training only, never to soft targets."""
        n, k = logits.shape
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if targets.dtype.is_floating_point:
            if tuple(targets.shape) != (n, k):
                raise ValueError(f"soft targets must have shape ({n}, {k}), got {tuple(targets.shape)}")
            return F.cross_entropy(logits, targets.to(logits.dtype))
        if tuple(targets.shape) != (n,):
            raise ValueError(f"class-index targets must have shape ({n},), got {tuple(targets.shape)}")
        smoothing = self.config.label_smoothing if self.training else 0.0
        return F.cross_entropy(logits, targets, label_smoothing=smoothing)

    # ---- accounting --------------------------------------------------------------------------
    def tokens_in(self, images: Tensor) -> int:
        """Class token and patches of every image."""
        return len(images) * (1 + self.config.num_patches)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def flops_per_token(self, seq_len: int | None = None) -> None:
        """``None``: a ViT's cost is per image (:meth:`flops_per_image`)."""
        return None

    def flops_per_image(self) -> float:
        """Rough forward FLOPs for one image, a multiply-add counted as 2 (DeiT's "FLOPs" are half that);
        norms, softmax, GELU and the scheme's mixing left out."""
        cfg = self.config
        t, d, h = cfg.seq_len, cfg.dim, cfg.hidden_dim
        embed = 2 * cfg.num_patches * d * cfg.in_chans * cfg.patch_size ** 2
        block = 8 * t * d * d + 4 * t * d * h + 4 * t * t * d
        return float(embed + cfg.n_layers * block + 2 * d * cfg.num_classes)

    def extra_repr(self) -> str:
        cfg = self.config
        return (f"image_size={cfg.image_size}, patch_size={cfg.patch_size}, scheme={cfg.scheme}, "
                f"drop_path={cfg.drop_path}")
