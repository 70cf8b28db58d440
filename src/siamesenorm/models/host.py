"""What a model that hosts a residual scheme provides and shares: building the scheme and sublayers,
and honouring the scheme's requirements over the host's own initialisation."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from ..nn.attention import Attention
from ..schemes.base import ResidualScheme, SchemeRequirements

__all__ = ["BranchWeight", "SchemeHost", "branch_weights", "build_sublayers",
           "honour_requirements", "needs_qkv_norm", "reset_sublayer_norms", "rng_devices"]


@runtime_checkable
class SchemeHost(Protocol):
    """A module that runs ``scheme.enter/step/exit`` over its bare ``sublayers`` (attention at even
    indices, MLP at odd). Subclass it: from Python 3.12 a structural check misses submodules."""

    scheme: ResidualScheme
    sublayers: nn.ModuleList

    def num_parameters(self) -> int:
        ...

    def tokens_in(self, x: Tensor) -> int:
        """Tokens the model processes for the batch ``x`` (for tokens/s)."""
        ...

    def flops_per_token(self, seq_len: int | None = None) -> float | None:
        """Training FLOPs per token at context ``seq_len``; ``None``: no estimate."""
        ...


def rng_devices(device) -> dict:
    """Arguments of :func:`torch.random.fork_rng` covering ``device``'s generator, so that a model built
    inside the fork draws its ``reset_parameters()`` from the caller's state."""
    dev = torch.device(device) if device is not None else torch.get_default_device()
    if dev.type in ("cpu", "meta"):
        return {"devices": []}
    index = dev.index if dev.index is not None else 0
    return {"devices": [index], "device_type": dev.type}


def build_sublayers(scheme: ResidualScheme, attention: Callable[[int, bool], nn.Module],
                    mlp: Callable[[int], nn.Module]) -> nn.ModuleList:
    """``attention(block, qkv_norm)`` then ``mlp(block)`` for every block, ``qkv_norm`` true where the
    scheme requires it."""
    return nn.ModuleList(sub for block in range(scheme.n_layers)
                         for sub in (attention(block, needs_qkv_norm(scheme, block)), mlp(block)))


def reset_sublayer_norms(sublayers: nn.ModuleList) -> None:
    """Reset what the sublayers hold besides their linears (per-head norms, RoPE tables)."""
    for sub in sublayers:
        for module in sub.modules():
            if module is not sub and not isinstance(module, nn.Linear) \
                    and hasattr(module, "reset_parameters"):
                module.reset_parameters()


class BranchWeight(NamedTuple):
    """One weight of a host's branches, for :func:`honour_requirements`. ``weight`` may hold several
    matrices of shape ``matrix`` (an MoE's experts), each drawn on its own; ``gained``: the scheme's
    ``branch_gain`` applies (not q, k, nor a router)."""

    weight: Tensor
    bias: Tensor | None
    gained: bool
    sublayer: int = -1
    name: str = ""
    matrix: tuple[int, int] | None = None


def branch_weights(sublayers: nn.ModuleList) -> list[BranchWeight]:
    out = []
    for i, sub in enumerate(sublayers):
        for name, module in sub.named_children():
            if isinstance(module, nn.Linear):
                gained = not (isinstance(sub, Attention) and name in ("q_proj", "k_proj")) \
                    and name != "router"      # an MoE's router scores experts, it is no branch
                out.append(BranchWeight(module.weight, module.bias, gained, i, name))
    return out


def needs_qkv_norm(scheme: ResidualScheme, block: int) -> bool:
    return block in scheme.requires.qkv_norm_blocks


def _is_dtensor(t: Tensor) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor
    return isinstance(t, DTensor)


def _draw_whole(weight: Tensor, draw: Callable[[Tensor], None]) -> None:
    """``draw`` on ``weight``; a DTensor is drawn whole, so the values do not depend on the sharding."""
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
    for matrix in weight.view(-1, *shape):
        nn.init.xavier_normal_(matrix, gain=gain, generator=generator)


@torch.no_grad()
def honour_requirements(weights: Iterable[BranchWeight], requires: SchemeRequirements, *,
                        native: Callable[[BranchWeight], None] | None = None,
                        generator: torch.Generator | None = None,
                        native_xavier: bool = False) -> None:
    """Initialise the branch ``weights`` by ``native`` (``None``: done already), zero their biases and
    honour ``requires``: Xavier-normal from ``generator`` for DeepNorm (unless ``native_xavier``),
    ``branch_gain`` on the gained weights."""
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
