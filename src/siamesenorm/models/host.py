"""What the vision models share as hosts of a residual scheme: building it, and the sublayer
weights its requirements (``scheme.requires``) act on."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from ..errors import ConfigError
from ..nn.attention import Attention

if TYPE_CHECKING:
    from ..schemes.base import ResidualScheme


def build_model_scheme(name: str, dim: int, n_layers: int, *, norm: str, eps: float,
                       options: dict[str, Any], device=None, dtype=None,
                       **defaults: Any) -> ResidualScheme:
    """Build a model's scheme with the model's ``defaults`` overridden by the user's ``options``;
    refuse a scheme that does not serve two sublayers (attention, MLP) per block."""
    # Importing through the package registers every built-in scheme.
    from ..schemes.base import build_scheme

    scheme = build_scheme(name, dim, n_layers, norm=norm, eps=eps, device=device, dtype=dtype,
                          **(defaults | options))
    if scheme.sublayers_per_block != 2:
        raise ConfigError(f"scheme {name!r} expects {scheme.sublayers_per_block} sublayers per "
                          "block; the model has 2 (attention, MLP)")
    return scheme


def reset_sublayer_norms(sublayers: nn.ModuleList) -> None:
    """Reset what the sublayers hold besides their linears (per-head QKV norms)."""
    for sub in sublayers:
        for module in sub.modules():
            if module is not sub and not isinstance(module, nn.Linear) \
                    and hasattr(module, "reset_parameters"):
                module.reset_parameters()


def branch_weights(sublayers: nn.ModuleList) -> list[tuple[Tensor, bool]]:
    """Every sublayer weight with whether it takes a scheme's ``branch_gain`` (DeepNorm's beta
    goes on the value and output projections and on the MLP, not on q and k)."""
    out = []
    for sub in sublayers:
        if isinstance(sub, Attention):
            out += [(sub.q_proj.weight, False), (sub.k_proj.weight, False),
                    (sub.v_proj.weight, True), (sub.out_proj.weight, True)]
        else:
            out += [(m.weight, True) for m in sub.children() if isinstance(m, nn.Linear)]
    return out
