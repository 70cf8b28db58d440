"""What a model that hosts a residual scheme provides (:class:`SchemeHost`), and what the three hosts
(language model, ViT, DiT) share: building the scheme and the sublayers, and honouring the
scheme's requirements (``scheme.requires``) over their own initialisation.

This module alone reads a scheme's requirements: :func:`needs_qkv_norm` says which attentions
normalise q, k and v, :func:`honour_requirements` applies DeepNorm's init and any ``branch_gain``
to the weights a host lists as :class:`BranchWeight` records. The Hugging Face adaptation and the
OLMo-core models call them too (``tests/test_host.py`` keeps it so)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from ..nn.attention import Attention
from ..schemes.base import ResidualScheme, SchemeRequirements, build_scheme

__all__ = ["BranchWeight", "SchemeHost", "branch_weights", "build_model_scheme", "build_sublayers",
           "honour_requirements", "needs_qkv_norm", "reset_sublayer_norms", "rng_devices"]


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
    return nn.ModuleList(sub for block in range(scheme.n_layers)
                         for sub in (attention(block, needs_qkv_norm(scheme, block)), mlp(block)))


def reset_sublayer_norms(sublayers: nn.ModuleList) -> None:
    """Reset what the sublayers hold besides their linears (per-head QKV norms, RoPE tables)."""
    for sub in sublayers:
        for module in sub.modules():
            if module is not sub and not isinstance(module, nn.Linear) \
                    and hasattr(module, "reset_parameters"):
                module.reset_parameters()


class BranchWeight(NamedTuple):
    """One weight of a host's branches, as :func:`honour_requirements` takes it: plain data, so
    that every host (ours, a Hugging Face family, OLMo-core) describes its weights and this module
    alone applies what a scheme requires of them.

    Attributes:
        weight: a matrix, or matrices stored together (an MoE's experts), each drawn on its own:
            the weight read as ``weight.view(-1, *matrix)``.
        bias: its bias (set to zero), or ``None``.
        gained: whether a scheme's ``branch_gain`` applies to it (DeepNorm's beta goes on the value
            and output projections and on the MLP, not on q and k, nor on an MoE's router).
        sublayer, name: where it sits (the sublayer's index, its attribute: ``q_proj``,
            ``down_proj``, ...), for the host's own init; ``-1`` and ``""`` where it needs none.
        matrix: the shape of each matrix (default: the weight's last two dimensions), for weights
            stored flat (OLMo-core's router and experts).
    """

    weight: Tensor
    bias: Tensor | None
    gained: bool
    sublayer: int = -1
    name: str = ""
    matrix: tuple[int, int] | None = None


def branch_weights(sublayers: nn.ModuleList) -> list[BranchWeight]:
    """Every linear of the sublayers, in order: q, k, v, out of an attention; an MLP's in order."""
    out = []
    for i, sub in enumerate(sublayers):
        for name, module in sub.named_children():
            if isinstance(module, nn.Linear):
                gained = not (isinstance(sub, Attention) and name in ("q_proj", "k_proj")) \
                    and name != "router"      # an MoE's router scores experts, it is no branch
                out.append(BranchWeight(module.weight, module.bias, gained, i, name))
    return out


def needs_qkv_norm(scheme: ResidualScheme, block: int) -> bool:
    """Whether the scheme requires the attention of ``block`` to normalise q, k and v per head
    (HybridNorm; SiameseNorm's ``hybrid_pre``)."""
    return block in scheme.requires.qkv_norm_blocks


def _is_dtensor(t: Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def _draw_whole(weight: Tensor, draw: Callable[[Tensor], None]) -> None:
    """``draw`` on ``weight``; a sharded weight (a DTensor) is drawn whole on every rank and each
    rank keeps its part, so the values do not depend on the sharding."""
    if not _is_dtensor(weight):
        draw(weight)
        return
    from torch.distributed.tensor import distribute_tensor
    full = torch.zeros(weight.shape, dtype=weight.dtype, device=weight.device)
    draw(full)
    part = distribute_tensor(full, weight.device_mesh, weight.placements)
    weight.to_local().copy_(part.to_local())


def _xavier_normal(weight: Tensor, *, shape: tuple[int, ...], gain: float,
                   generator: torch.Generator | None) -> None:
    """Xavier-normal on each matrix of ``weight`` (read as ``weight.view(-1, *shape)``)."""
    for matrix in weight.view(-1, *shape):
        nn.init.xavier_normal_(matrix, gain=gain, generator=generator)


@torch.no_grad()
def honour_requirements(weights: Iterable[BranchWeight], requires: SchemeRequirements, *,
                        native: Callable[[BranchWeight], None] | None = None,
                        generator: torch.Generator | None = None,
                        native_xavier: bool = False) -> None:
    """Initialise the branch ``weights`` (in their order) by the host's own init ``native``,
    honouring what the scheme ``requires``; biases become zero.

    If the scheme requires ``init="xavier"`` (DeepNorm) and the host's init is not Xavier already
    (``native_xavier``), each matrix is Xavier-normal instead (drawn from ``generator``), with gain
    ``branch_gain`` on the gained weights and 1 on the others. Otherwise ``native`` initialises
    each weight (``None``: the host initialised them already), and a ``branch_gain`` other than 1
    then multiplies the gained ones. With nothing to do (no ``native``, no Xavier, no gain) the
    weights are left as they are.
    """
    xavier = requires.init == "xavier" and not native_xavier
    if native is None and not xavier and requires.branch_gain == 1.0:
        return
    for w in weights:
        gain = requires.branch_gain if w.gained else 1.0
        if xavier:
            shape = w.matrix or tuple(w.weight.shape[-2:])
            _draw_whole(w.weight, partial(_xavier_normal, shape=shape, gain=gain,
                                          generator=generator))
        else:
            if native is not None:
                native(w)
            if gain != 1.0:
                w.weight.mul_(gain)
        if w.bias is not None:
            nn.init.zeros_(w.bias)
