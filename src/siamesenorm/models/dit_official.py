"""The official DiT interface: ``DiT_models`` and the official module tree, whose parameter names are
the official state-dict keys (docs/own_model.md, "The official DiT interface")."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.attention import head_norm, norm_heads
from ..nn.norms import build_norm
from ..schemes.base import ResidualScheme
from .dit import DiT, TimestepEmbedder, adaln_branches, modulate
from .dit_config import DiTConfig
from .host import BranchWeight, build_sublayers

__all__ = ["DIT_OFFICIAL_SIZES", "DiT_models", "OfficialDiT", "native_key", "official_key"]

# name -> (depth, hidden_size, num_heads); the patch size is the number after the slash.
DIT_OFFICIAL_SIZES: dict[str, tuple[int, int, int]] = {
    "XL": (28, 1152, 16), "L": (24, 1024, 16), "B": (12, 768, 12), "S": (12, 384, 6)}


# ---- the official modules --------------------------------------------------------------------
class PatchEmbed(nn.Module):
    """Images ``(B, C, H, W)`` -> patch tokens ``(B, T, dim)`` through ``proj``, a strided Conv2d."""

    def __init__(self, input_size: int, patch_size: int, in_channels: int, dim: int, *,
                 device=None, dtype=None) -> None:
        super().__init__()
        grid = input_size // patch_size
        self.img_size, self.patch_size = (input_size, input_size), (patch_size, patch_size)
        self.grid_size, self.num_patches = (grid, grid), grid * grid
        self.proj = nn.Conv2d(in_channels, dim, patch_size, stride=patch_size, device=device,
                              dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class LabelEmbedder(nn.Module):
    """Class labels -> (B, dim); the null label has a row only when ``dropout_prob > 0``, as officially."""

    def __init__(self, num_classes: int, dim: int, dropout_prob: float, *, device=None,
                 dtype=None) -> None:
        super().__init__()
        self.num_classes, self.dropout_prob = num_classes, dropout_prob
        self.embedding_table = nn.Embedding(num_classes + int(dropout_prob > 0), dim,
                                            device=device, dtype=dtype)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.embedding_table.weight, 0.0, 0.02)

    def token_drop(self, labels: Tensor, force_drop_ids: Tensor | None = None) -> Tensor:
        """Labels with the null label where ``force_drop_ids == 1``, or at random."""
        if force_drop_ids is None:
            drop = torch.rand(labels.shape[0], device=labels.device) < self.dropout_prob
        else:
            drop = force_drop_ids == 1
        return torch.where(drop, self.num_classes, labels)

    def forward(self, labels: Tensor, train: bool, force_drop_ids: Tensor | None = None) -> Tensor:
        if train and self.dropout_prob > 0 or force_drop_ids is not None:
            labels = self.token_drop(labels, force_drop_ids)
        return self.embedding_table(labels)


class Attention(nn.Module):
    """timm's attention as DiT uses it (fused ``qkv``, ``proj``); ``qkv_norm`` normalises q, k, v per head."""

    def __init__(self, dim: int, num_heads: int, *, qkv_norm: bool, norm: str, norm_eps: float,
                 device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, **kw)
        self.q_norm, self.k_norm, self.v_norm = (
            head_norm(norm, self.head_dim, norm_eps, **kw) if qkv_norm else None for _ in "qkv")
        self.proj = nn.Linear(dim, dim, **kw)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = (norm_heads(norm, part, self.head_dim).transpose(1, 2) for norm, part in
                   zip((self.q_norm, self.k_norm, self.v_norm), self.qkv(x).chunk(3, dim=-1)))
        return self.proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))

    def branch_weights(self, sublayer: int) -> list[BranchWeight]:
        """q, k, v (row blocks of ``qkv``; v gained) and ``proj``, for :func:`~.host.honour_requirements`."""
        parts = zip(self.qkv.weight.chunk(3), self.qkv.bias.chunk(3), (False, False, True),
                    ("q_proj", "k_proj", "v_proj"))
        return [BranchWeight(w, b, gained, sublayer, name) for w, b, gained, name in parts] + \
            [BranchWeight(self.proj.weight, self.proj.bias, True, sublayer, "out_proj")]


class Mlp(nn.Module):
    def __init__(self, dim: int, hidden: int, *, device=None, dtype=None) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden, device=device, dtype=dtype)
        self.act = nn.GELU(approximate="tanh")
        self.fc2 = nn.Linear(hidden, dim, device=device, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(self.act(self.fc1(x)))

    def branch_weights(self, sublayer: int) -> list[BranchWeight]:
        return [BranchWeight(fc.weight, fc.bias, True, sublayer, name)
                for fc, name in ((self.fc1, "up_proj"), (self.fc2, "down_proj"))]


class DiTBlock(nn.Module):
    """Block ``index``: ``block(state, c)`` runs its attention and MLP through the model's scheme
    (``norm1``, ``norm2`` are for code that calls them). Given a tensor, a one-stream scheme's block
    returns one, as officially."""

    def __init__(self, index: int, scheme: ResidualScheme, attn: Attention, mlp: Mlp, *,
                 norm: str, eps: float, device=None, dtype=None) -> None:
        super().__init__()
        kw, dim = {"device": device, "dtype": dtype}, scheme.dim
        self.index = index
        vars(self)["_scheme"] = scheme           # the model's: not a submodule here
        self.norm1 = build_norm(norm, dim, eps, affine=False, **kw)
        self.attn = attn
        self.norm2 = build_norm(norm, dim, eps, affine=False, **kw)
        self.mlp = mlp
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim, **kw))

    def forward(self, x: Any, c: Tensor) -> Any:
        attn, mlp = adaln_branches(self.adaLN_modulation(c), self.attn, self.mlp)
        scheme, i = self._scheme, 2 * self.index
        out = scheme.step(scheme.step(x, i, attn), i + 1, mlp)
        if isinstance(x, Tensor) and not isinstance(out, Tensor):
            streams = scheme.streams(out)
            if len(streams) == 1:
                (out,) = streams.values()
        return out


class FinalLayer(nn.Module):
    def __init__(self, dim: int, patch_size: int, out_channels: int, *, norm: str, eps: float,
                 device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.norm_final = build_norm(norm, dim, eps, affine=False, **kw)
        self.linear = nn.Linear(dim, patch_size * patch_size * out_channels, **kw)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim, 2 * dim, **kw))

    def reset_parameters(self) -> None:
        for layer in (self.adaLN_modulation[1], self.linear):
            nn.init.zeros_(layer.weight)
            nn.init.zeros_(layer.bias)

    def forward(self, x: Tensor, c: Tensor) -> Tensor:
        return self.linear(modulate(self.norm_final(x), *self.adaLN_modulation(c).chunk(2, dim=-1)))


# ---- the model -------------------------------------------------------------------------------
class OfficialDiT(DiT):
    """Our :class:`~.dit.DiT` in the official module tree, with the official constructor and attributes
    plus ``scheme``, ``scheme_options``, ``device`` and ``dtype``."""

    guided_channels = 3       # the official forward_with_cfg guides the first 3 channels

    def __init__(self, *, input_size: int = 32, patch_size: int = 2, in_channels: int = 4,
                 hidden_size: int = 1152, depth: int = 28, num_heads: int = 16,
                 mlp_ratio: float = 4.0, class_dropout_prob: float = 0.1, num_classes: int = 1000,
                 learn_sigma: bool = True, scheme: str = "siamese",
                 scheme_options: dict[str, Any] | None = None, device=None, dtype=None) -> None:
        config = DiTConfig(input_size=input_size, patch_size=patch_size, in_chans=in_channels,
                           num_classes=num_classes, dim=hidden_size, n_layers=depth,
                           n_heads=num_heads, mlp_ratio=mlp_ratio,
                           class_dropout_prob=class_dropout_prob, learn_sigma=learn_sigma,
                           scheme=scheme, scheme_options=dict(scheme_options or {}))
        super().__init__(config, device=device, dtype=dtype)
        self.register_load_state_dict_pre_hook(_read_native_layout)

    # ---- the module tree -----------------------------------------------------------------------
    def _build_sublayers(self, scheme: ResidualScheme, kw: dict) -> nn.ModuleList:
        cfg = self.config
        return build_sublayers(
            scheme,
            lambda block, qkv_norm: Attention(cfg.dim, cfg.n_heads, qkv_norm=qkv_norm,
                                              norm=cfg.norm, norm_eps=cfg.norm_eps, **kw),
            lambda block: Mlp(cfg.dim, cfg.hidden_dim, **kw))

    def _build(self, scheme: ResidualScheme, sublayers: nn.ModuleList, kw: dict) -> None:
        cfg = self.config
        norms = {"norm": cfg.norm, "eps": cfg.norm_eps}
        self.pos_embed = nn.Parameter(torch.empty(1, cfg.num_patches, cfg.dim, **kw),
                                      requires_grad=False)
        self.x_embedder = PatchEmbed(cfg.input_size, cfg.patch_size, cfg.in_chans, cfg.dim, **kw)
        self.t_embedder = TimestepEmbedder(cfg.dim, cfg.frequency_dim, cfg.max_period, **kw)
        self.y_embedder = LabelEmbedder(cfg.num_classes, cfg.dim, cfg.class_dropout_prob, **kw)
        self.blocks = nn.ModuleList(
            DiTBlock(b, scheme, sublayers[2 * b], sublayers[2 * b + 1], **norms, **kw)
            for b in range(cfg.n_layers))
        self.final_layer = FinalLayer(cfg.dim, cfg.patch_size, cfg.out_channels, **norms, **kw)
        self.scheme = scheme

    @property
    def sublayers(self) -> nn.ModuleList:
        """Every block's ``attn`` and ``mlp``, in order (a view: they are saved under ``blocks``)."""
        return nn.ModuleList(sub for block in self.blocks for sub in (block.attn, block.mlp))

    def _patch_proj(self) -> nn.Conv2d:
        return self.x_embedder.proj

    def _block_modulations(self) -> list[nn.Linear]:
        return [block.adaLN_modulation[1] for block in self.blocks]

    def _num_labels(self) -> int:
        return self.y_embedder.embedding_table.num_embeddings

    def _branch_weights_of(self, module: nn.Module) -> list[BranchWeight] | None:
        for b, block in enumerate(self.blocks):
            if module is block.attn or module is block.mlp:
                return module.branch_weights(2 * b + (module is block.mlp))
        return None

    def _qkv_bound(self, sublayer: int) -> float:
        qkv = self.blocks[sublayer // 2].attn.qkv
        return math.sqrt(6.0 / (qkv.in_features + qkv.out_features))

    def _embed(self, x: Tensor) -> Tensor:
        return self.x_embedder(x) + self.pos_embed

    def _run_blocks(self, h: Tensor, c: Tensor) -> Tensor:
        state = self.scheme.enter(h)
        for block in self.blocks:
            state = block(state, c)
        return self.scheme.exit(state)

    # ---- the official attributes -------------------------------------------------------------
    @property
    def in_channels(self) -> int:
        return self.config.in_chans

    @property
    def learn_sigma(self) -> bool:
        return self.config.learn_sigma

    @property
    def patch_size(self) -> int:
        return self.config.patch_size

    @property
    def num_heads(self) -> int:
        return self.config.n_heads

    @property
    def num_patches(self) -> int:
        return self.x_embedder.num_patches

    def initialize_weights(self) -> None:
        """The official name of :meth:`~.dit.DiT.reset_parameters`."""
        self.reset_parameters()

    # ---- a plain DiT's weights -----------------------------------------------------------------
    def official_state(self, native: dict[str, Tensor]) -> dict[str, Tensor]:
        """A plain :class:`~.dit.DiT`'s state dict (same config) in this layout: keys renamed, q, k and v
        fused, the label table cut, the position embedding added where missing."""
        out: dict[str, Tensor] = {}
        fused: dict[str, dict[str, Tensor]] = {}
        for key, value in native.items():
            m = _NATIVE_SUBLAYER.match(key)
            if m and int(m[1]) % 2 == 0 and m[2] in _QKV:
                fused.setdefault(official_key(key), {})[m[2]] = value
            else:
                out[official_key(key)] = value
        for key, parts in fused.items():
            if len(parts) == len(_QKV):          # else the fused key is reported missing
                out[key] = torch.cat([parts[name] for name in _QKV])
        table = "y_embedder.embedding_table.weight"
        if table in out:
            out[table] = out[table][: self._num_labels()]
        out.setdefault("pos_embed", self.pos_embed.detach())
        return out


# ---- a plain DiT's keys ------------------------------------------------------------------------
_TOP = (("x_embedder.", "x_embedder.proj."),
        ("y_embedder.table.", "y_embedder.embedding_table."),
        ("final_layer.modulation.", "final_layer.adaLN_modulation."),
        ("final_layer.norm.", "final_layer.norm_final."))
_KIND = ("attn", "mlp")                                     # sublayer 2b, 2b + 1
_RENAMES = ({"out_proj": "proj"}, {"up_proj": "fc1", "down_proj": "fc2"})
_INVERSE = tuple({new: old for old, new in renames.items()} for renames in _RENAMES)
_QKV = ("q_proj", "k_proj", "v_proj")
_NATIVE_SUBLAYER = re.compile(r"sublayers\.(\d+)\.([^.]+)(\..+)?$")
_NATIVE_MODULATION = re.compile(r"modulation\.(\d+)\.(.+)$")
_OFFICIAL_BLOCK = re.compile(r"blocks\.(\d+)\.(attn|mlp|adaLN_modulation)\.(.+)$")
_NATIVE_ONLY = ("sublayers.", "modulation.", "y_embedder.table.", "final_layer.modulation.",
                "x_embedder.weight", "x_embedder.bias")


def official_key(key: str) -> str:
    """The official name of one of our DiT's keys (q, k, v -> ``qkv``); others stay as they are."""
    if m := _NATIVE_SUBLAYER.match(key):
        i, name, rest = int(m[1]), m[2], m[3] or ""
        kind = i % 2
        name = "qkv" if kind == 0 and name in _QKV else _RENAMES[kind].get(name, name)
        return f"blocks.{i // 2}.{_KIND[kind]}.{name}{rest}"
    if m := _NATIVE_MODULATION.match(key):
        return f"blocks.{m[1]}.adaLN_modulation.{m[2]}"
    for native, official in _TOP:
        if key.startswith(native):
            return official + key[len(native):]
    return key


def native_key(key: str) -> str:
    """Our DiT's name of an official key: :func:`official_key` inverted, but for ``qkv`` (three of ours)."""
    if m := _OFFICIAL_BLOCK.match(key):
        b, kind, rest = int(m[1]), m[2], m[3]
        if kind == "adaLN_modulation":
            return f"modulation.{b}.{rest}"
        k = _KIND.index(kind)
        name, dot, tail = rest.partition(".")
        return f"sublayers.{2 * b + k}.{_INVERSE[k].get(name, name)}{dot}{tail}"
    for native, official in _TOP:
        if key.startswith(official):
            return native + key[len(official):]
    return key


def _read_native_layout(module: OfficialDiT, state_dict: dict, prefix: str, *_: Any) -> None:
    """``load_state_dict`` pre-hook: a plain DiT's state dict is read in the official layout."""
    keys = [key for key in state_dict if key.startswith(prefix)]
    if not any(key[len(prefix):].startswith(_NATIVE_ONLY) for key in keys):
        return
    native = {key[len(prefix):]: state_dict.pop(key) for key in keys}
    for key, value in module.official_state(native).items():
        state_dict[prefix + key] = value


# ---- DiT_models ------------------------------------------------------------------------------
def _model_fn(name: str, depth: int, hidden_size: int, num_heads: int,
              patch_size: int) -> Callable[..., OfficialDiT]:
    def build(*, input_size: int = 32, in_channels: int = 4, num_classes: int = 1000,
              learn_sigma: bool = True, class_dropout_prob: float = 0.1, mlp_ratio: float = 4.0,
              scheme: str = "siamese", scheme_options: dict[str, Any] | None = None, device=None,
              dtype=None) -> OfficialDiT:
        return OfficialDiT(input_size=input_size, patch_size=patch_size, in_channels=in_channels,
                           hidden_size=hidden_size, depth=depth, num_heads=num_heads,
                           mlp_ratio=mlp_ratio, class_dropout_prob=class_dropout_prob,
                           num_classes=num_classes, learn_sigma=learn_sigma, scheme=scheme,
                           scheme_options=scheme_options, device=device, dtype=dtype)

    build.__name__ = build.__qualname__ = name.replace("-", "_").replace("/", "_")
    build.__doc__ = (f"{name}: depth {depth}, hidden size {hidden_size}, {num_heads} heads, patch "
                     f"{patch_size}, as the official ``{build.__name__}``; see :class:`OfficialDiT`.")
    return build


DiT_models: dict[str, Callable[..., OfficialDiT]] = {
    f"DiT-{size}/{patch}": _model_fn(f"DiT-{size}/{patch}", *dims, patch)
    for size, dims in DIT_OFFICIAL_SIZES.items() for patch in (2, 4, 8)}
