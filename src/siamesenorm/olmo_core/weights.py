"""A stock OLMo-core model's weights in the scheme model of its own placement, and back.

OLMo-core names a block's norms by the block type; the scheme that is that type's placement
(``OWN_SCHEME``, ``OWN_OPTIONS``) holds the same norms by sublayer. Every other key is shared.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import UserError
from ..schemes import ResidualScheme
from .user_config import OWN_OPTIONS, OWN_SCHEME

__all__ = ["load_olmo_core_state", "map_from_olmo_core", "map_to_olmo_core", "olmo_core_state_dict"]

# OLMo-core's norm of a block -> (the scheme's norm list, 0 for the attention sublayer, 1 for the MLP)
_PRE = {"attention_norm": ("pre_norm", 0), "feed_forward_norm": ("pre_norm", 1)}
_NORMS = {
    ("pre", True): _PRE, ("lns", True): _PRE,
    ("peri_ln", True): {"attention_norm": ("input_norm", 0), "post_attention_norm": ("output_norm", 0),
                        "feed_forward_norm": ("input_norm", 1), "post_feed_forward_norm": ("output_norm", 1)},
    ("peri_ln", False): {"attention_norm": ("output_norm", 0), "feed_forward_norm": ("output_norm", 1)},
}
_FREE_OPTIONS = {"final_norm", "input_norm"}    # final_norm: an LM head without a norm
_BLOCK_KEY = re.compile(r"blocks\.(\d+)\.(\w+)\.(weight|bias)")
_SCHEME_KEY = re.compile(r"scheme\.(\w+)\.(\d+)\.(weight|bias)")
_FINAL = ("lm_head.norm.", "scheme.final_norm.")


def _own_placements() -> str:
    own: dict[str, list[str]] = {}
    for block, scheme in OWN_SCHEME.items():
        options = OWN_OPTIONS.get(block)
        name = scheme + "".join(f" {k}={v}" for k, v in (options or {}).items())
        own.setdefault(name, []).append(str(block.value))
    return "; ".join(f"{k} ({', '.join(v)})" for k, v in own.items())


def _norm_table(scheme: ResidualScheme) -> dict[str, tuple[str, int]]:
    """OLMo-core's block norm names -> the scheme's, or a one-line refusal."""
    input_norm = getattr(scheme, "use_input_norm", True)
    table = _NORMS.get((scheme.name, input_norm))
    if table is None:
        raise UserError(f"scheme {scheme.name!r} is no stock OLMo-core block's placement; those are "
                        f"{_own_placements()}")
    if scheme.norm_kind not in ("rmsnorm", "layernorm"):
        raise UserError(f"norm={scheme.norm_kind}: OLMo-core's blocks have RMSNorm or LayerNorm")
    for key, option in type(scheme).all_options().items():
        if key in _FREE_OPTIONS or option.attr is None:
            continue
        value = getattr(scheme, option.attr or key)
        if value != option.default:
            raise UserError(f"scheme {scheme.name!r} with {key}={value!r} is no stock OLMo-core block's "
                            f"placement; leave {key} at {option.default!r}")
    return table


def _ln_scale(key: str, block: int, tensor: Tensor) -> None:
    """LayerNorm Scaling's constant: OLMo-core keeps it as a buffer, ``lns`` computes it."""
    want = 1 / math.sqrt(block + 1)
    if tensor.device.type != "meta" and abs(float(tensor) - want) > 1e-6:
        raise UserError(f"{key} is {float(tensor):g}, not 1/sqrt({block + 1}) = {want:g} as scheme 'lns' "
                        "computes (OLMo-core 3.0.0's init_weights leaves it unset): set it before mapping")


def map_from_olmo_core(state_dict: Mapping[str, Any], scheme: ResidualScheme) -> dict[str, Any]:
    """The state of a stock OLMo-core model under the key names of the scheme model of its own
    placement (``scheme``: that model's ``model.scheme``); tensors are not copied."""
    table = _norm_table(scheme)
    out: dict[str, Any] = {}
    for key, tensor in state_dict.items():
        block = _BLOCK_KEY.fullmatch(key)
        if key.endswith(".ln_scale"):
            if scheme.name != "lns":
                raise UserError(f"{key}: the state is a default_scaled model's; load it into scheme 'lns'")
            _ln_scale(key, int(key.split(".")[1]), tensor)
        elif block and block[2] in table:
            norms, offset = table[block[2]]
            out[f"scheme.{norms}.{2 * int(block[1]) + offset}.{block[3]}"] = tensor
        elif block and block[2].endswith("_norm"):
            raise UserError(f"{key}: scheme {scheme.name!r} has no {block[2]}; the state is another block "
                            f"type's ({_own_placements()})")
        elif key.startswith(_FINAL[0]):
            out[_FINAL[1] + key[len(_FINAL[0]):]] = tensor
        else:
            out[key] = tensor
    if scheme.name == "lns" and not any(k.endswith(".ln_scale") for k in state_dict):
        raise UserError("the state has no blocks.*.ln_scale: it is no default_scaled model's, whose "
                        "placement scheme 'lns' is")
    return out


def map_to_olmo_core(state_dict: Mapping[str, Any], scheme: ResidualScheme) -> dict[str, Any]:
    """The inverse of :func:`map_from_olmo_core`: a scheme model's state as the stock OLMo-core
    model's of its placement (``lns`` adds OLMo-core's ``ln_scale`` buffers)."""
    stock = {value: name for name, value in _norm_table(scheme).items()}
    out: dict[str, Any] = {}
    blocks: dict[int, Tensor] = {}
    for key, tensor in state_dict.items():
        norm = _SCHEME_KEY.fullmatch(key)
        if norm and (norm[1], int(norm[2]) % 2) in stock:
            b = int(norm[2]) // 2
            out[f"blocks.{b}.{stock[norm[1], int(norm[2]) % 2]}.{norm[3]}"] = tensor
            blocks.setdefault(b, tensor)
        elif key.startswith(_FINAL[1]):
            out[_FINAL[0] + key[len(_FINAL[1]):]] = tensor
        elif key.startswith("scheme."):
            raise UserError(f"{key} has no counterpart in a stock OLMo-core model")
        else:
            out[key] = tensor
    if scheme.name == "lns":
        for b, like in blocks.items():
            dtype = torch.promote_types(like.dtype, torch.float32)      # OLMo-core's is float32
            out[f"blocks.{b}.ln_scale"] = torch.tensor(1 / math.sqrt(b + 1), dtype=dtype, device=like.device)
    return out


def load_olmo_core_state(model: nn.Module, state_dict: Mapping[str, Any]) -> None:
    """Load a stock OLMo-core model's ``state_dict`` into ``model``, the scheme model of the same
    config under its own placement (``from_transformer_config(config, OWN_SCHEME[...], ...)``)."""
    scheme = _scheme_of(model)
    mapped = map_from_olmo_core(state_dict, scheme)
    own = model.state_dict()
    want = map_to_olmo_core(own, scheme)
    missing, extra = sorted(set(want) - set(state_dict)), sorted(set(state_dict) - set(want))
    if missing or extra:
        first = f"it lacks {missing[0]}" if missing else f"it has {extra[0]}, which the model has not"
        raise UserError(f"the state is not the model's OLMo-core counterpart ({len(missing)} keys missing, "
                        f"{len(extra)} extra): {first}")
    for key, tensor in mapped.items():
        if tuple(tensor.shape) != tuple(own[key].shape):
            raise UserError(f"{key} has shape {tuple(tensor.shape)} in the state, {tuple(own[key].shape)} in "
                            "the model: build the model from the state's own config")
    model.load_state_dict(mapped)


def olmo_core_state_dict(model: nn.Module) -> dict[str, Any]:
    """``model``'s state (a scheme model of a stock block type's placement) as that stock
    OLMo-core model's, for its ``load_state_dict``."""
    return map_to_olmo_core(model.state_dict(), _scheme_of(model))


def _scheme_of(model: nn.Module) -> ResidualScheme:
    scheme = getattr(model, "scheme", None)
    if not isinstance(scheme, ResidualScheme):
        raise UserError(f"model must be a scheme model (from_transformer_config(...).build()), got "
                        f"{type(model).__name__}")
    return scheme
