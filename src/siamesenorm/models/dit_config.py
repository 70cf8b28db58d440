"""Configuration of the DiT (adaLN-Zero diffusion transformer), validated on construction, and its
sizes."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..nn.depth_attention import check_depth_attention
from ..nn.norms import NORM_KINDS
from . import config_checks as check

_OWNER = "DiTConfig"
# The scheme options a DiT changes (models/dit.py): adaLN-Zero modulates its norms, and its final
# layer has a norm of its own.
SCHEME_DEFAULTS = {"branch_affine": False, "final_norm": False}

_WIDTHS = {"S": (384, 12, 6), "B": (768, 12, 12), "L": (1024, 24, 16)}

# The DiT paper's sizes (arXiv 2212.09748, Table 1) with patch 2 and 4, at its latent input
# (32 x 32 x 4, a 256 px image through the SD VAE), and a tiny size for the 8x8 handwritten digits.
DIT_SIZES: dict[str, dict[str, Any]] = {
    f"DiT-{name}/{patch}": {"input_size": 32, "patch_size": patch, "in_chans": 4, "dim": dim,
                            "n_layers": layers, "n_heads": heads}
    for name, (dim, layers, heads) in _WIDTHS.items() for patch in (2, 4)
}
DIT_SIZES["digits"] = {"input_size": 8, "patch_size": 2, "in_chans": 1, "num_classes": 10,
                       "dim": 64, "n_layers": 4, "n_heads": 4}


@dataclass(frozen=True)
class DiTConfig:
    """DiT with adaLN-Zero blocks (Peebles & Xie 2023, arXiv 2212.09748) over any residual scheme.
    ``dim`` divides by ``n_heads`` and 4 (the 2-D sin-cos position embedding); ``learn_sigma``
    doubles the output channels; label ``num_classes`` is classifier-free guidance's null label,
    which replaces a label with probability ``class_dropout_prob`` in training."""

    input_size: int = 32
    patch_size: int = 2
    in_chans: int = 4
    num_classes: int = 1000
    dim: int = 384
    n_layers: int = 12
    n_heads: int = 6
    mlp_ratio: float = 4.0
    class_dropout_prob: float = 0.1
    learn_sigma: bool = True
    scheme: str = "pre"
    scheme_options: dict[str, Any] = field(default_factory=dict)
    norm: str = "layernorm"
    norm_eps: float = 1e-6
    frequency_dim: int = 256
    max_period: float = 10000.0
    depth_attention: bool = False
    depth_attention_stride: int | None = None

    def __post_init__(self) -> None:
        for name in ("input_size", "patch_size", "in_chans", "num_classes", "dim", "n_layers",
                     "n_heads", "frequency_dim"):
            check.positive_int(_OWNER, name, getattr(self, name))
        for name in ("mlp_ratio", "norm_eps", "max_period"):
            check.positive_number(_OWNER, name, getattr(self, name))
        check.probability(_OWNER, "class_dropout_prob", self.class_dropout_prob)
        check.boolean(_OWNER, "learn_sigma", self.learn_sigma)
        check.divisible(_OWNER, "input_size", self.input_size, f"{_OWNER}.patch_size",
                        self.patch_size)
        check.divisible(_OWNER, "dim", self.dim, f"{_OWNER}.n_heads", self.n_heads)
        check.divisible(_OWNER, "dim", self.dim, "4 (the 2-D sin-cos position embedding)", 4)
        check.divisible(_OWNER, "frequency_dim", self.frequency_dim, "2 (cos and sin halves)", 2)
        check.mlp_hidden(_OWNER, self.dim, self.mlp_ratio)
        check.OneOf(NORM_KINDS)(_OWNER, "norm", self.norm)
        check.scheme_name(_OWNER, "scheme", self.scheme)
        check.scheme_options(_OWNER, "scheme_options", self.scheme_options)
        check_depth_attention(self.depth_attention, self.depth_attention_stride)
        check.buildable(_OWNER, self.n_layers, self.estimated_parameters())
        check.resolve_model_scheme(self, **SCHEME_DEFAULTS)

    @property
    def resolved_scheme(self) -> Any:
        """The scheme's class and its options, filled and checked once."""
        return check.resolved_scheme(self, **SCHEME_DEFAULTS)

    def estimated_parameters(self) -> int:
        """The parameters of the patch, timestep and label embeddings, every block's attention,
        MLP and adaLN modulation, and the final layer, from the sizes alone (norms and the
        scheme's own parameters left out): what :func:`~.config_checks.buildable` bounds."""
        d, h, lin = self.dim, int(self.dim * self.mlp_ratio), check.linear
        block = 4 * lin(d, d, True) + lin(d, h, True) + lin(h, d, True) + lin(d, 6 * d, True)
        out = self.patch_size ** 2 * (2 * self.in_chans if self.learn_sigma else self.in_chans)
        return (self.in_chans * self.patch_size ** 2 * d + d
                + lin(self.frequency_dim, d, True) + lin(d, d, True) + (self.num_classes + 1) * d
                + self.n_layers * block + lin(d, 2 * d, True) + lin(d, out, True))

    @classmethod
    def from_size(cls, size: str, **overrides: Any) -> DiTConfig:
        """The config of a named size in :data:`DIT_SIZES` ("DiT-B/2", "digits", ...), with
        ``overrides`` on top."""
        return cls(**(check.size_preset(_OWNER, DIT_SIZES, size) | overrides))

    @property
    def out_channels(self) -> int:
        """``2 * in_chans`` with ``learn_sigma`` (noise, then variance), else ``in_chans``."""
        return 2 * self.in_chans if self.learn_sigma else self.in_chans

    @property
    def grid_size(self) -> int:
        """Patches per side."""
        return self.input_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid_size ** 2

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def hidden_dim(self) -> int:
        return int(self.dim * self.mlp_ratio)
