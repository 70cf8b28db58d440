"""The official DiT interface: ``DiT_models`` and the official state-dict layout.

For the DiT repository's scripts (Peebles & Xie 2023, arXiv 2212.09748): :data:`DiT_models` has the
official twelve names and keyword arguments, plus ``scheme`` (default ``"siamese"``: the official
SiameseNorm DiT) and ``scheme_options``; each builds an :class:`OfficialDiT`, our :class:`~.dit.DiT`
whose ``state_dict()`` has the official keys in the official order (:func:`official_key`;
``load_state_dict`` also reads our own keys), so an official checkpoint loads strictly with
``scheme="pre"``. The fused ``qkv`` stacks q, k, v by rows (timm's split); the adaLN chunks keep the
official order; with ``class_dropout_prob == 0`` the saved label table drops the null row.
``forward`` drops labels as the official code does; ``forward_with_cfg`` guides the first 3
channels only (:attr:`guided_channels`), never dropping labels. Timestep features are computed in
float64 then rounded: float32 outputs agree to rounding, float64 exactly. The key mapping:
docs/own_model.md, "The official DiT interface".
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .dit import DiT
from .dit_config import DiTConfig

__all__ = ["DIT_OFFICIAL_SIZES", "DiT_models", "OfficialDiT", "native_key", "official_key"]

# name -> (depth, hidden_size, num_heads); the patch size is the number after the slash.
DIT_OFFICIAL_SIZES: dict[str, tuple[int, int, int]] = {
    "XL": (28, 1152, 16), "L": (24, 1024, 16), "B": (12, 768, 12), "S": (12, 384, 6)}

# ---- key mapping -----------------------------------------------------------------------------
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
_OFFICIAL_QKV = re.compile(r"blocks\.(\d+)\.attn\.qkv\.([^.]+)$")
_NATIVE_ONLY = ("sublayers.", "modulation.", "y_embedder.table.", "final_layer.modulation.")


def official_key(key: str) -> str:
    """The official DiT name of one of our DiT's state-dict keys (q, k and v all map to the fused
    ``qkv``); keys it does not know (``scheme.*``) stay as they are."""
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
    """Our DiT's name of an official key, the inverse of :func:`official_key` (but for the fused
    ``qkv``, which is three of our keys)."""
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


_BLOCK_ORDER = {"attn.qkv": 0, "attn": 1, "attn.proj": 2, "mlp.fc1": 3, "mlp.fc2": 4, "mlp": 5,
                "adaLN_modulation": 6}
_TOP_ORDER = ("pos_embed", "x_embedder.", "t_embedder.", "y_embedder.")
_FINAL_ORDER = ("final_layer.linear.", "final_layer.adaLN_modulation.", "final_layer.")


def _rank(key: str) -> tuple[int, ...]:
    """The official module order (attention's per-head norms between qkv and proj, as timm's);
    the scheme's keys after all, then anything unknown. Python's sort keeps weight before bias."""
    if m := _OFFICIAL_BLOCK.match(key):
        sub = f"{m[2]}.{m[3].split('.')[0]}"
        return (4, int(m[1]), _BLOCK_ORDER.get(sub, _BLOCK_ORDER[m[2]]))
    for rank, start in enumerate(_TOP_ORDER):
        if key == start or key.startswith(start) and start.endswith("."):
            return (rank,)
    for rank, start in enumerate(_FINAL_ORDER):
        if key.startswith(start):
            return (5, rank)
    return (6,) if key.startswith("scheme.") else (7,)


def _to_official(native: dict[str, Tensor]) -> dict[str, Tensor]:
    """Our keys -> the official ones, q, k and v fused, in the official order."""
    out: dict[str, Tensor] = {}
    fused: dict[str, dict[str, Tensor]] = {}
    for key, value in native.items():
        m = _NATIVE_SUBLAYER.match(key)
        if m and int(m[1]) % 2 == 0 and m[2] in _QKV:
            fused.setdefault(official_key(key), {})[m[2]] = value
        else:
            out[official_key(key)] = value
    for key, parts in fused.items():
        out[key] = torch.cat([parts[name] for name in _QKV])
    return dict(sorted(out.items(), key=lambda item: _rank(item[0])))


def _is_official(keys) -> bool:
    """Whether a (local) state dict is in the official layout: it has an official-only key, or no
    key only ours have (an empty dict counts as official, so strict loading names official keys)."""
    keys = list(keys)
    if any(native_key(k) != k or k == "pos_embed" for k in keys):
        return True
    return not any(k.startswith(_NATIVE_ONLY) or k.startswith("x_embedder.") and
                   not k.startswith("x_embedder.proj.") for k in keys)


def _save_official(module: OfficialDiT, state_dict: dict, prefix: str, local_metadata) -> None:
    """``state_dict`` post-hook: rename this module's keys (those under ``prefix``) to the official
    layout, in place and in the official order, and add the position embedding."""
    keys = [key for key in state_dict if key.startswith(prefix)]
    native = {key[len(prefix):]: state_dict.pop(key) for key in keys}
    for key, value in module._official_state(native).items():
        state_dict[prefix + key] = value


def _load_official(module: OfficialDiT, state_dict: dict, prefix: str, local_metadata, strict,
                   missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    """``load_state_dict`` pre-hook: an official-layout dict (under ``prefix``) is renamed to our
    keys in place, q, k and v split from ``qkv``; the position embedding is copied (or assigned)
    into its buffer. A shape that does not match is reported under its official name."""
    keys = [key for key in state_dict if key.startswith(prefix)]
    local = {key[len(prefix):]: state_dict[key] for key in keys}
    vars(module).pop("_official_load", None)
    if not _is_official(local):
        return                                      # our own DiT's keys: loaded as they are
    for key in keys:
        del state_dict[key]
    expected = {key: value.shape for key, value in module._official_state(
        {key: torch.empty(shape, device="meta") for key, shape in module._native_shapes().items()}
    ).items()}
    dropped: set[str] = set()                       # official keys reported as mismatched
    vars(module)["_official_load"] = (prefix, dropped)
    if "pos_embed" not in local:
        missing_keys.append(prefix + "pos_embed")
    for key, value in local.items():
        want = expected.get(key)
        if want is not None and isinstance(value, Tensor) and value.shape != want:
            error_msgs.append(f"size mismatch for {prefix}{key}: copying a param with shape "
                              f"{value.shape} from checkpoint, the shape in current model is {want}.")
            dropped.add(key)
        elif key == "pos_embed":
            module._load_pos_embed(value, local_metadata)
        elif want is not None and (m := _OFFICIAL_QKV.match(key)):
            attn = module.sublayers[2 * int(m[1])]
            sizes = [getattr(attn, name).out_features for name in _QKV]
            for name, part in zip(_QKV, value.split(sizes), strict=True):
                state_dict[f"{prefix}sublayers.{2 * int(m[1])}.{name}.{m[2]}"] = part
        elif key == "y_embedder.embedding_table.weight" and module.config.class_dropout_prob == 0:
            null = module.y_embedder.table.weight[module.config.num_classes:].detach()
            null = torch.zeros_like(value[:1]) if null.is_meta else null.to(value)
            state_dict[prefix + native_key(key)] = torch.cat((value, null))
        elif want is not None:
            state_dict[prefix + native_key(key)] = value
        else:
            state_dict[prefix + key] = value        # not ours: unexpected under its own name


def _name_official_keys(module: OfficialDiT, incompatible_keys) -> None:
    """``load_state_dict`` post-hook: after an official-layout load, name the missing keys
    officially (one ``qkv`` for q, k and v), leaving out those already reported as mismatched.
    (Unexpected keys keep the names they came with: only keys of this model are renamed.)"""
    pending = vars(module).pop("_official_load", None)
    if pending is None:
        return
    prefix, dropped = pending
    renamed: list[str] = []
    for key in incompatible_keys.missing_keys:
        if key.startswith(prefix):
            local = official_key(key[len(prefix):])
            if local in dropped:
                continue
            key = prefix + local
        if key not in renamed:
            renamed.append(key)
    incompatible_keys.missing_keys[:] = renamed


# ---- the model -------------------------------------------------------------------------------
class OfficialDiT(DiT):
    """Our :class:`~.dit.DiT` with the official DiT's constructor, attributes and state-dict layout.

    The keyword arguments are the official ``DiT``'s (``hidden_size``, ``depth``, ``num_heads``,
    ``in_channels`` ...), plus ``scheme`` and ``scheme_options`` (the residual scheme around the
    adaLN-Zero blocks: ``"pre"`` is the official DiT, ``"siamese"`` the official SiameseNorm DiT)
    and ``device``, ``dtype``. The state-dict layout is described in :mod:`.dit_official`.
    """

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
        self.register_state_dict_post_hook(_save_official)
        self.register_load_state_dict_pre_hook(_load_official)
        self.register_load_state_dict_post_hook(_name_official_keys)

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

    def initialize_weights(self) -> None:
        """The official name of :meth:`~.dit.DiT.reset_parameters` (DiT's init)."""
        self.reset_parameters()

    # ---- state-dict layout -------------------------------------------------------------------
    def _native_shapes(self) -> dict[str, torch.Size]:
        """Shapes of our own (un-renamed) state-dict entries: parameters and persistent buffers."""
        shapes = {name: p.shape for name, p in self.named_parameters(remove_duplicate=False)}
        for mod_name, mod in self.named_modules(remove_duplicate=False):
            for name, buf in mod._buffers.items():
                if buf is not None and name not in mod._non_persistent_buffers_set:
                    shapes[f"{mod_name}.{name}" if mod_name else name] = buf.shape
        return shapes

    def _official_state(self, native: dict[str, Tensor]) -> dict[str, Tensor]:
        """Our entries (local keys) in the official layout, with the position embedding."""
        native = dict(native, pos_embed=self.pos_embed.detach())
        table, cfg = "y_embedder.table.weight", self.config
        if cfg.class_dropout_prob == 0 and table in native:
            native[table] = native[table][: cfg.num_classes]     # no null row in the official table
        return _to_official(native)

    @torch.no_grad()
    def _load_pos_embed(self, value: Tensor, local_metadata: dict) -> None:
        if local_metadata.get("assign_to_params_buffers", False):
            self.pos_embed = value.detach()
        else:
            self.pos_embed.copy_(value)


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
