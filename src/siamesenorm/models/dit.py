"""DiT (arXiv 2212.09748) with adaLN-Zero blocks over any residual scheme: with ``"pre"`` it is DiT,
with ``"siamese"`` the official SiameseNorm DiT."""

from __future__ import annotations

import math
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from ..nn.attention import Attention
from ..nn.depth_attention import DepthKeysValues, depth_stride
from ..nn.mlp import GELUMLP
from ..nn.norms import build_norm
from ..schemes.base import Branch, ResidualScheme
from .dit_config import DIT_SIZES, DiTConfig
from .host import (
    BranchWeight,
    SchemeHost,
    branch_weights,
    build_sublayers,
    honour_requirements,
    reset_sublayer_norms,
    rng_devices,
)
from .stack import ResidualStack

__all__ = ["DIT_SIZES", "DiT", "DiTConfig", "modulate", "sincos_pos_embed_2d", "timestep_features"]


def modulate(h: Tensor, shift: Tensor, scale: Tensor) -> Tensor:
    """adaLN modulation of tokens ``h`` (B, T, d) by per-sample ``shift``, ``scale`` (B, d)."""
    return h * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1)


def _modulated(sublayer: nn.Module, shift: Tensor, scale: Tensor, gate: Tensor, u: Tensor,
               **kwargs: Any) -> Tensor:
    return gate.unsqueeze(1) * sublayer(modulate(u, shift, scale), **kwargs)


def adaln_branches(modulation: Tensor, attn: Branch, mlp: Branch) -> tuple[Branch, Branch]:
    """A block's attention and MLP branches ``u -> gate * F(modulate(u))`` from its modulation
    (B, 6 dim): shift, scale, gate of the attention, then of the MLP."""
    shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = modulation.chunk(6, dim=-1)
    return (partial(_modulated, attn, shift_a, scale_a, gate_a),
            partial(_modulated, mlp, shift_m, scale_m, gate_m))


def timestep_features(t: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
    """Sinusoidal features (B, dim) of timesteps ``t`` (B,), cos then sin, computed in float64."""
    half = dim // 2
    freqs = max_period ** (-torch.arange(half, device=t.device, dtype=torch.float64) / half)
    angles = t.to(torch.float64).unsqueeze(-1) * freqs
    return torch.cat((torch.cos(angles), torch.sin(angles)), dim=-1)


def sincos_pos_embed_2d(dim: int, grid_size: int, *, device=None) -> Tensor:
    """Fixed 2-D sin-cos position embedding (grid_size ** 2, dim) in float64, DiT's layout: the first
    half encodes the column, the second the row."""
    quarter = dim // 4
    omega = 10000.0 ** (-torch.arange(quarter, device=device, dtype=torch.float64) / quarter)
    coords = torch.arange(grid_size, device=device, dtype=torch.float64)
    rows, cols = torch.meshgrid(coords, coords, indexing="ij")

    def encode(pos: Tensor) -> Tensor:
        angles = pos.reshape(-1, 1) * omega
        return torch.cat((torch.sin(angles), torch.cos(angles)), dim=-1)

    return torch.cat((encode(cols), encode(rows)), dim=-1)


class TimestepEmbedder(nn.Module):
    """Timestep -> (B, dim): sinusoidal features, then ``Linear -> SiLU -> Linear``."""

    def __init__(self, dim: int, frequency_dim: int = 256, max_period: float = 10000.0, *,
                 device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.frequency_dim, self.max_period = frequency_dim, max_period
        self.mlp = nn.Sequential(nn.Linear(frequency_dim, dim, **kw), nn.SiLU(),
                                 nn.Linear(dim, dim, **kw))

    def reset_parameters(self) -> None:
        for layer in (self.mlp[0], self.mlp[2]):
            nn.init.normal_(layer.weight, 0.0, 0.02)
            nn.init.zeros_(layer.bias)

    @property
    def frequency_embedding_size(self) -> int:
        """The official DiT's name of :attr:`frequency_dim`."""
        return self.frequency_dim

    @staticmethod
    def timestep_embedding(t: Tensor, dim: int, max_period: float = 10000.0) -> Tensor:
        """The official DiT's static method: float32 features; an odd ``dim`` ends in a zero."""
        features = timestep_features(t, dim - dim % 2, max_period).float()
        return torch.nn.functional.pad(features, (0, dim % 2))

    def forward(self, t: Tensor) -> Tensor:
        weight = self.mlp[0].weight
        return self.mlp(timestep_features(t, self.frequency_dim, self.max_period).to(weight.dtype))


class LabelEmbedder(nn.Module):
    """Class label -> (B, dim), with a null label (index ``num_classes``) for classifier-free guidance
    that replaces each label with probability ``dropout_prob`` when asked."""

    def __init__(self, num_classes: int, dim: int, dropout_prob: float, *, device=None,
                 dtype=None) -> None:
        super().__init__()
        self.num_classes, self.dropout_prob = num_classes, dropout_prob
        self.table = nn.Embedding(num_classes + 1, dim, device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.table.weight, 0.0, 0.02)

    def forward(self, y: Tensor, drop: bool) -> Tensor:
        if drop and self.dropout_prob > 0:
            dropped = torch.rand(y.shape, device=y.device) < self.dropout_prob
            y = torch.where(dropped, torch.full_like(y, self.num_classes), y)
        return self.table(y)


class FinalLayer(nn.Module):
    """DiT's output layer: non-affine norm, adaLN modulation (shift, scale), a linear to patches."""

    def __init__(self, dim: int, patch_size: int, out_channels: int, *, norm: str, eps: float,
                 device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.norm = build_norm(norm, dim, eps, affine=False, **kw)
        self.modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim, **kw))
        self.linear = nn.Linear(dim, patch_size * patch_size * out_channels, **kw)

    def reset_parameters(self) -> None:
        for layer in (self.modulation[1], self.linear):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, h: Tensor, c: Tensor) -> Tensor:
        shift, scale = self.modulation(c).chunk(2, dim=-1)
        return self.linear(modulate(self.norm(h), shift, scale))


_QKV = ("q_proj", "k_proj", "v_proj")


def fused_qkv_bound(attn: Attention) -> float:
    """Xavier-uniform's bound for q, k and v as one fused ``qkv`` matrix, as official DiT."""
    projections = [getattr(attn, name) for name in _QKV]
    fan_out = sum(p.out_features for p in projections)
    return math.sqrt(6.0 / (projections[0].in_features + fan_out))


class DiT(ResidualStack, SchemeHost):
    """Class-conditional diffusion transformer from a :class:`DiTConfig`.

    The scheme is built with ``branch_affine=False, final_norm=False`` (overridable): adaLN follows
    each branch norm and the final layer normalises itself. :class:`~.dit_official.OfficialDiT`
    overrides the ``_build`` ... ``_run_blocks`` methods below for the official module tree."""

    #: Output channels that :meth:`forward_with_cfg` guides: ``None`` means the ``in_chans`` noise
    #: channels; the official DiT code guides the first 3 (:class:`~.dit_official.OfficialDiT`).
    guided_channels: int | None = None

    def __init__(self, config: DiTConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.config = cfg = config
        kw = {"device": device, "dtype": dtype}
        # Fork the generator so that the default inits below leave the caller's state to
        # reset_parameters(), exactly as a meta-device build followed by reset_parameters() does.
        with torch.random.fork_rng(**rng_devices(device)):
            scheme = cfg.resolved_scheme.build(cfg.dim, cfg.n_layers, norm=cfg.norm, eps=cfg.norm_eps, **kw)
            self._build(scheme, self._build_sublayers(scheme, kw), kw)
        self.reset_parameters()

    def _build_sublayers(self, scheme: ResidualScheme, kw: dict) -> nn.ModuleList:
        cfg = self.config
        return build_sublayers(
            scheme,
            lambda block, qkv_norm: Attention(
                cfg.dim, cfg.n_heads, qkv_norm=qkv_norm, norm=cfg.norm, norm_eps=cfg.norm_eps,
                bias=True, layer_idx=block, causal=False, rope=False,
                max_seq_len=cfg.num_patches, depth_attention=cfg.depth_attention, **kw),
            lambda block: GELUMLP(cfg.dim, cfg.hidden_dim, bias=True, approximate="tanh", **kw))

    # ---- the module tree: OfficialDiT builds the official one around the same computation ----
    def _build(self, scheme: ResidualScheme, sublayers: nn.ModuleList, kw: dict) -> None:
        """Register the modules, in this order (the order of the state dict and of the init)."""
        cfg = self.config
        self.scheme = scheme
        self.x_embedder = nn.Conv2d(cfg.in_chans, cfg.dim, cfg.patch_size, stride=cfg.patch_size,
                                    **kw)
        self.register_buffer("pos_embed", torch.empty(1, cfg.num_patches, cfg.dim, **kw),
                             persistent=False)
        self.t_embedder = TimestepEmbedder(cfg.dim, cfg.frequency_dim, cfg.max_period, **kw)
        self.y_embedder = LabelEmbedder(cfg.num_classes, cfg.dim, cfg.class_dropout_prob, **kw)
        self.sublayers = sublayers
        self.modulation = nn.ModuleList(
            nn.Sequential(nn.SiLU(), nn.Linear(cfg.dim, 6 * cfg.dim, **kw))
            for _ in range(cfg.n_layers))
        self.final_layer = FinalLayer(cfg.dim, cfg.patch_size, cfg.out_channels, norm=cfg.norm,
                                      eps=cfg.norm_eps, **kw)

    def _patch_proj(self) -> nn.Conv2d:
        return self.x_embedder

    def _block_modulations(self) -> list[nn.Linear]:
        return [mod[1] for mod in self.modulation]

    def _num_labels(self) -> int:
        return self.y_embedder.table.num_embeddings

    def _branch_weights_of(self, module: nn.Module) -> list[BranchWeight] | None:
        """The branch weights ``module`` holds, if it is where they sit."""
        return branch_weights(self.sublayers) if module is self.sublayers else None

    def _embed(self, x: Tensor) -> Tensor:
        return self.x_embedder(x).flatten(2).transpose(1, 2) + self.pos_embed

    def _run_blocks(self, h: Tensor, c: Tensor) -> Tensor:
        block: list[Branch] = []     # this block's attention and MLP branches

        def modulated(i: int, sublayer: nn.Module) -> Branch:
            if i % 2 == 0:
                block[:] = adaln_branches(self.modulation[i // 2](c), sublayer,
                                          self.sublayers[i + 1])
            return block[i % 2]

        cfg, attend = self.config, None
        if cfg.depth_attention:          # the source layers' keys and values, for the later ones
            attend = {"depth_kv": DepthKeysValues(depth_stride(cfg.depth_attention_stride, cfg.n_layers))}
        return self.run(h, attention_kwargs=attend, wrap=modulated)

    @property
    def out_channels(self) -> int:
        return self.config.out_channels

    # ---- initialisation ----------------------------------------------------------------------
    def _qkv_bound(self, sublayer: int) -> float:
        return fused_qkv_bound(self.sublayers[sublayer])

    def _init_branch_weight(self, branch: BranchWeight) -> None:
        if branch.name in _QKV:
            bound = self._qkv_bound(branch.sublayer)
            nn.init.uniform_(branch.weight, -bound, bound)
        else:
            nn.init.xavier_uniform_(branch.weight)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-initialise every parameter and buffer in a fixed order, as DiT: linears Xavier-uniform (q, k, v
        as one fused ``qkv``), label table and timestep MLP N(0, 0.02), adaLN and the final linear zero.
        A ``branch_gain`` multiplies the gained weights; a fresh model outputs exactly 0."""
        cfg = self.config
        self.scheme.reset_parameters()
        reset_sublayer_norms(self.sublayers)
        # Every linear in module order (the official code's ``apply(_basic_init)`` with its tree),
        # so the draws come in that order too; the timestep MLP and adaLN layers are redone below.
        done: tuple[str, ...] = ("scheme.",)
        for name, module in self.named_modules():
            if name.startswith(done):
                continue
            if (weights := self._branch_weights_of(module)) is not None:
                honour_requirements(weights, self.scheme.requires,
                                    native=self._init_branch_weight, native_xavier=True)
                done += (f"{name}.",)
            elif isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                nn.init.zeros_(module.bias)
        # on the meta device (a dry run) nothing is computed: no memory the model's size needs
        where = "meta" if self.pos_embed.is_meta else None
        self.pos_embed.copy_(sincos_pos_embed_2d(cfg.dim, cfg.grid_size, device=where).unsqueeze(0))
        proj = self._patch_proj()
        nn.init.xavier_uniform_(proj.weight.view(cfg.dim, -1))
        nn.init.zeros_(proj.bias)
        self.y_embedder.reset_parameters()
        self.t_embedder.reset_parameters()
        for linear in self._block_modulations():
            nn.init.zeros_(linear.weight)
            nn.init.zeros_(linear.bias)
        self.final_layer.reset_parameters()

    # ---- forward -----------------------------------------------------------------------------
    def _check_inputs(self, x: Tensor, t: Tensor, y: Tensor) -> None:
        cfg = self.config
        want = (cfg.in_chans, cfg.input_size, cfg.input_size)
        if x.dim() != 4 or tuple(x.shape[1:]) != want:
            raise ValueError(f"x must have shape (batch, {', '.join(map(str, want))}), got "
                              f"{tuple(x.shape)}; resize it or change DiTConfig")
        b = x.shape[0]
        if tuple(t.shape) != (b,) or tuple(y.shape) != (b,):
            raise ValueError(f"t and y must have shape ({b},), got {tuple(t.shape)} and "
                              f"{tuple(y.shape)}")
        if y.dtype.is_floating_point or y.dtype == torch.bool:
            raise ValueError(f"y must hold integer class labels, got dtype {y.dtype}")
        # A value check reads the labels back (a sync, a graph break): skipped under torch.compile
        # and on the meta device (no values: the dry run sizes a model there).
        top = self._num_labels() - 1
        if b and not torch.compiler.is_compiling() and not y.is_meta and \
                (int(y.min()) < 0 or int(y.max()) > top):
            null = f"{top} is the null label" if top == cfg.num_classes else \
                "no null label: class_dropout_prob is 0"
            raise ValueError(f"labels must lie in 0..{top} ({null}), got "
                              f"{int(y.min())}..{int(y.max())}")

    def unpatchify(self, tokens: Tensor) -> Tensor:
        """``(B, T, p * p * C)`` -> ``(B, C, H, W)``; each token's features are ordered (p, p, C)."""
        cfg = self.config
        b, g, p, ch = tokens.shape[0], cfg.grid_size, cfg.patch_size, cfg.out_channels
        x = tokens.reshape(b, g, g, p, p, ch)
        return x.permute(0, 5, 1, 3, 2, 4).reshape(b, ch, g * p, g * p)

    def _forward(self, x: Tensor, t: Tensor, y: Tensor, drop_labels: bool) -> Tensor:
        self._check_inputs(x, t, y)
        c = self.t_embedder(t) + self.y_embedder(y, drop_labels)
        return self.unpatchify(self.final_layer(self._run_blocks(self._embed(x), c), c))

    def forward(self, x: Tensor, t: Tensor, y: Tensor) -> Tensor:
        """Prediction (B, out_channels, H, W) for noisy ``x`` (B, C, H, W) at timesteps ``t`` (B,) with
        labels ``y`` (B,); in training each label becomes the null label with ``class_dropout_prob``."""
        return self._forward(x, t, y, drop_labels=self.training)

    def forward_with_cfg(self, x: Tensor, t: Tensor, y: Tensor, cfg_scale: float) -> Tensor:
        """Classifier-free guidance in one batch: the first half conditional, the second the null label; only
        the first half of ``x`` is read. The first ``in_chans`` channels (:attr:`guided_channels` when set)
        become ``uncond + cfg_scale * (cond - uncond)`` in both halves; the rest are returned as predicted."""
        if x.shape[0] % 2:
            raise ValueError(f"forward_with_cfg needs an even batch (conditional half, then "
                              f"unconditional half), got {x.shape[0]}")
        half = x[: x.shape[0] // 2]
        out = self._forward(torch.cat((half, half)), t, y, drop_labels=False)
        n = self.config.in_chans if self.guided_channels is None else self.guided_channels
        eps, rest = out[:, :n], out[:, n:]
        cond, uncond = eps.chunk(2)
        guided = uncond + cfg_scale * (cond - uncond)
        return torch.cat((torch.cat((guided, guided)), rest), dim=1)

    # ---- accounting --------------------------------------------------------------------------
    def tokens_in(self, x: Tensor) -> int:
        """Patches of every image."""
        return len(x) * self.config.num_patches

    def num_parameters(self) -> int:
        """Parameters; the fixed position embedding is not counted."""
        return sum(p.numel() for p in self.parameters() if p is not self.pos_embed)

    def flops_per_token(self, seq_len: int | None = None) -> None:
        """``None``: no FLOPs estimate for a DiT."""
        return None

    def extra_repr(self) -> str:
        cfg = self.config
        return (f"input_size={cfg.input_size}, patch_size={cfg.patch_size}, "
                f"out_channels={cfg.out_channels}, scheme={cfg.scheme}")

