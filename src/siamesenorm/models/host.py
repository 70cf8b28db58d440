"""What a model that hosts a residual scheme provides (:class:`SchemeHost`), and what the three hosts
(language model, ViT, DiT) share: building the scheme and the sublayers, and honouring the
scheme's requirements (``scheme.requires``) over their own initialisation."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from ..nn.attention import Attention
from ..schemes.base import ResidualScheme, SchemeRequirements, build_scheme

__all__ = ["BranchLinear", "SchemeHost", "branch_linears", "build_model_scheme", "build_sublayers",
           "init_branch_weights", "reset_sublayer_norms", "rng_devices"]


@runtime_checkable
class SchemeHost(Protocol):
    """A module that runs ``scheme.enter/step/exit`` over its bare ``sublayers``.

    The models of :mod:`siamesenorm.models` and :class:`~siamesenorm.diffusion.DiffusionObjective`
    subclass it, as a host of one's own should: ``isinstance(module, SchemeHost)`` then holds on
    every Python (from 3.12 a structural check no longer sees a module's submodules).

    Attributes:
        scheme: the residual scheme; it owns every norm of the residual path.
        sublayers: ``SUBLAYERS_PER_BLOCK * scheme.n_layers`` bare sublayers: attention at even
            indices, MLP at odd ones (sublayer ``i`` belongs to block ``i // 2``).
    """

    scheme: ResidualScheme
    sublayers: nn.ModuleList

    def num_parameters(self) -> int:
        """The number of parameters, as the run's summary reports it."""
        ...

    def tokens_in(self, x: Tensor) -> int:
        """How many tokens the model processes for the input batch ``x`` (for tokens/s)."""
        ...

    def flops_per_token(self, seq_len: int | None = None) -> float | None:
        """Training FLOPs per token at context ``seq_len``; ``None`` where the model has no estimate."""
        ...


def rng_devices(device) -> dict:
    """Arguments of :func:`torch.random.fork_rng` that cover the generator ``device`` (``None``: the
    default device) draws from: a model builds its parts inside that fork, so its own
    ``reset_parameters()`` draws from the caller's state, as after a build on the meta device."""
    dev = torch.device(device) if device is not None else torch.get_default_device()
    if dev.type in ("cpu", "meta"):
        return {"devices": []}
    index = dev.index if dev.index is not None else 0
    return {"devices": [index], "device_type": dev.type}


def build_model_scheme(name: str, dim: int, n_layers: int, *, norm: str, eps: float,
                       options: dict[str, Any], device=None, dtype=None,
                       **defaults: Any) -> ResidualScheme:
    """Build a model's scheme with the model's ``defaults`` overridden by the user's ``options``."""
    return build_scheme(name, dim, n_layers, norm=norm, eps=eps, device=device, dtype=dtype,
                        **(defaults | options))


def build_sublayers(scheme: ResidualScheme, attention: Callable[[int, bool], nn.Module],
                    mlp: Callable[[int], nn.Module]) -> nn.ModuleList:
    """``attention(block, qkv_norm)`` then ``mlp(block)`` for every block of ``scheme``, with
    ``qkv_norm`` true on the blocks whose QKV-norm the scheme requires (HybridNorm)."""
    qkv = scheme.requires.qkv_norm_blocks
    return nn.ModuleList(sub for block in range(scheme.n_layers)
                         for sub in (attention(block, block in qkv), mlp(block)))


def reset_sublayer_norms(sublayers: nn.ModuleList) -> None:
    """Reset what the sublayers hold besides their linears (per-head QKV norms, RoPE tables)."""
    for sub in sublayers:
        for module in sub.modules():
            if module is not sub and not isinstance(module, nn.Linear) \
                    and hasattr(module, "reset_parameters"):
                module.reset_parameters()


class BranchLinear(NamedTuple):
    """A linear of a sublayer: ``sublayer`` is its index, ``name`` its attribute (``q_proj``,
    ``down_proj``, ...), ``gained`` whether a scheme's ``branch_gain`` applies to its weight (DeepNorm's
    beta goes on the value and output projections and on the MLP, not on q and k)."""

    sublayer: int
    name: str
    linear: nn.Linear
    gained: bool


def branch_linears(sublayers: nn.ModuleList) -> list[BranchLinear]:
    """Every linear of the sublayers, in order: q, k, v, out of an attention; an MLP's in order."""
    out = []
    for i, sub in enumerate(sublayers):
        for name, module in sub.named_children():
            if isinstance(module, nn.Linear):
                gained = not (isinstance(sub, Attention) and name in ("q_proj", "k_proj")) \
                    and name != "router"      # an MoE's router scores experts, it is no branch
                out.append(BranchLinear(i, name, module, gained))
    return out


@torch.no_grad()
def init_branch_weights(sublayers: nn.ModuleList, requires: SchemeRequirements,
                        native: Callable[[BranchLinear], None], *, native_xavier: bool = False) -> None:
    """Initialise every sublayer linear (weights in :func:`branch_linears` order; biases zero) by the
    host's own init ``native``, honouring what the scheme ``requires``.

    If the scheme requires ``init="xavier"`` (DeepNorm) and the host's init is not Xavier already
    (``native_xavier``), each weight is Xavier-normal instead, with gain ``branch_gain`` on the
    gained weights and 1 on the others. Otherwise ``native`` initialises it, and a ``branch_gain``
    other than 1 then multiplies the gained weights.
    """
    xavier = requires.init == "xavier" and not native_xavier
    for branch in branch_linears(sublayers):
        weight, gain = branch.linear.weight, requires.branch_gain if branch.gained else 1.0
        if xavier:
            nn.init.xavier_normal_(weight, gain=gain)
        else:
            native(branch)
            if gain != 1.0:
                weight.mul_(gain)
        if branch.linear.bias is not None:
            nn.init.zeros_(branch.linear.bias)
