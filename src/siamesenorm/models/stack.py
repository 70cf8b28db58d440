"""The residual loop, once: a scheme's ``enter``, its ``step`` over every sublayer, its ``exit``."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import UserError
from ..nn.attention import Attention
from ..nn.carrier import LayerCarrier
from ..nn.depth_attention import DepthKeysValues, check_depth_attention, depth_stride
from ..nn.value_residual import FirstValues
from ..schemes.base import SUBLAYERS_PER_BLOCK, ResidualScheme, build_scheme
from ..schemes.fusion import settled
from .checkpointing import carrying_step, set_scheme_checkpointing

__all__ = ["ResidualStack", "hidden_at"]

Wrap = Callable[[int, Callable[..., Tensor]], Callable[[Tensor], Tensor]]


class _Function(nn.Module):
    """A plain callable as a sublayer module."""

    def __init__(self, fn: Callable[..., Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        return self.fn(*args, **kwargs)


class ResidualStack(nn.Module):
    """A residual scheme around bare sublayers, attention at even indices and MLP at odd ones.

    ``scheme`` is a built scheme or a name, built with ``dim`` (required then), ``norm``, ``eps`` and
    ``options``. Attention of your own must honour ``scheme.requires`` (QKV-norm). ``depth_attention``
    and ``value_residual`` hand every attention sublayer ``depth_kv`` or ``first_values`` per forward
    (docs/own_model.md). The package's models subclass it (``ResidualStack()``) and call :meth:`run`."""

    carried: tuple[tuple[str, Callable[[], LayerCarrier]], ...] = ()   # made per forward, by keyword

    def __init__(self, scheme: ResidualScheme | str | None = None,
                 sublayers: Sequence[nn.Module | Callable[..., Tensor]] | None = None, *,
                 dim: int | None = None, norm: str = "layernorm", eps: float = 1e-5,
                 checkpointing: str = "none", depth_attention: bool = False,
                 depth_attention_stride: int | None = None, value_residual: bool = False,
                 **options: Any) -> None:
        super().__init__()
        if scheme is None and sublayers is None:
            return       # a subclass sets both itself
        if scheme is None or sublayers is None:
            raise ValueError("ResidualStack needs a scheme and its sublayers")
        if not isinstance(scheme, (ResidualScheme, str)):
            raise TypeError(f"ResidualStack: scheme must be a ResidualScheme or a scheme's name, got "
                            f"{type(scheme).__name__}")
        if isinstance(sublayers, (str, bytes, nn.Module)) or not isinstance(sublayers, Sequence):
            raise TypeError(f"ResidualStack: sublayers must be a list of modules or callables, got "
                            f"{type(sublayers).__name__}")
        for i, sub in enumerate(sublayers):
            if not callable(sub):
                raise TypeError(f"ResidualStack: sublayers[{i}] must be a module or a callable, got "
                                f"{type(sub).__name__}")
        if len(sublayers) == 0 or len(sublayers) % SUBLAYERS_PER_BLOCK:
            raise ValueError(f"sublayers must alternate attention and MLP, {SUBLAYERS_PER_BLOCK} per "
                             f"block; got {len(sublayers)}")
        if isinstance(scheme, str):
            if dim is None:
                raise ValueError(f"ResidualStack({scheme!r}, ...) needs dim= to build the scheme")
            scheme = build_scheme(scheme, dim, len(sublayers) // SUBLAYERS_PER_BLOCK, norm=norm,
                                  eps=eps, **options)
        elif options or dim is not None:
            raise ValueError("dim and scheme options go with a scheme's name; this scheme is built")
        if scheme.n_sublayers != len(sublayers):
            raise ValueError(f"the scheme has {scheme.n_layers} blocks ({scheme.n_sublayers} sublayers), "
                             f"got {len(sublayers)} sublayers")
        self.scheme = scheme
        self.sublayers = nn.ModuleList(s if isinstance(s, nn.Module) else _Function(s) for s in sublayers)
        self.carried = _layer_carriers(scheme, self.sublayers, depth_attention, depth_attention_stride,
                                       value_residual)
        self.set_checkpointing(checkpointing)

    def set_checkpointing(self, mode: str) -> None:
        """Activation checkpointing of every step from now on: ``none``, ``sublayer`` or ``selective``."""
        set_scheme_checkpointing(self.scheme, mode)

    def run(self, h: Tensor, *, attention_kwargs: dict[str, Any] | None = None,
            wrap: Wrap | None = None, states: list | None = None) -> Tensor:
        """``scheme.exit`` after ``scheme.step`` over every sublayer from ``scheme.enter(h)``.

        ``attention_kwargs`` go to every attention sublayer, carriers as keyword arguments of the branch
        call (so a branch ``wrap(i, sublayer)`` makes must pass keywords on). ``states`` receives the
        state after ``enter`` and after every block."""
        scheme = self.scheme
        if h.shape[-1] != scheme.dim:
            raise ValueError(f"ResidualStack: the input's last dimension is {h.shape[-1]}, the scheme's "
                             f"width (dim) is {scheme.dim}")
        bound = dict(attention_kwargs or {})
        for name, make in self.carried:
            bound.setdefault(name, make())
        carriers = {name: bound.pop(name) for name, value in list(bound.items())
                    if isinstance(value, LayerCarrier)}
        state = scheme.enter(h)
        if states is not None:
            states.append(state)
        for i, sublayer in enumerate(self.sublayers):
            attention = scheme.is_attention(i)
            branch = partial(sublayer, **bound) if bound and attention else sublayer
            if wrap is not None:
                branch = wrap(i, branch)
            if carriers and attention:
                state = carrying_step(scheme, state, i, branch, carriers)
            else:
                state = scheme.step(state, i, branch)
            if states is not None and not attention:
                states.append(state)
        for name, _ in self.carried:
            if not carriers[name].held and not torch.compiler.is_compiling():
                raise UserError(f"ResidualStack: no attention sublayer used {name}; "
                                f"{_CARRIED_USE[name]}")
        return scheme.exit(state)

    def forward(self, h: Tensor, **kwargs: Any) -> Tensor:
        """:meth:`run`; eagerly, a sublayer of another width is named in a ``ValueError``."""
        if torch.compiler.is_compiling():
            return self.run(h, **kwargs)
        wrap = _width_checked(self.scheme.dim, self.sublayers, kwargs.pop("wrap", None))
        return self.run(h, **kwargs, wrap=wrap)


# ---- what attention layers hand to later ones --------------------------------------------------
_CARRIED_USE = {"depth_kv": "with depth_attention=True each attention sublayer takes depth_kv and mixes "
                            "its values with depth_kv.mix(block, q, k, v) (docs/own_model.md)",
                "first_values": "with value_residual=True each attention sublayer takes first_values "
                                "(siamesenorm.nn.attention.Attention(value_residual=...) does)"}


def _takes(sub: Any, keyword: str) -> bool:
    fn = sub.fn if isinstance(sub, _Function) else sub.forward if isinstance(sub, nn.Module) else sub
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return True             # no signature to read: the check after the forward says it
    return any(p.name == keyword or p.kind is p.VAR_KEYWORD for p in params)


def _layer_carriers(scheme: ResidualScheme, sublayers: nn.ModuleList, depth_attention: Any,
                    stride: Any, value_residual: Any) -> tuple[tuple[str, Callable[[], LayerCarrier]], ...]:
    """The carriers a forward hands the attention sublayers; our :class:`Attention` ones are switched
    to Depth-Attention, and checked to be built for the block they sit in."""
    try:
        check_depth_attention(depth_attention, stride, owner="", true="True")
    except UserError as error:
        raise UserError(f"ResidualStack: {error}") from None
    if not isinstance(value_residual, bool):
        raise UserError(f"ResidualStack: value_residual must be True or False, got {value_residual!r}")
    if depth_attention and value_residual:
        raise UserError("ResidualStack: depth_attention and value_residual both rewrite the values "
                        "attention reads, and Depth-Attention defines no combination; choose one")
    carried: list[tuple[str, Callable[[], LayerCarrier]]] = []
    if depth_attention:
        carried.append(("depth_kv", partial(DepthKeysValues, depth_stride(stride, scheme.n_layers))))
    if value_residual:
        carried.append(("first_values", FirstValues))
    for i, sub in enumerate(sublayers):
        if not carried or not scheme.is_attention(i):
            continue
        name, block = type(sub.fn if isinstance(sub, _Function) else sub).__name__, scheme.block_of(i)
        for keyword, _ in carried:
            if not _takes(sub, keyword):
                raise UserError(f"ResidualStack: sublayers[{i}] ({name}) takes no {keyword} keyword; "
                                f"{_CARRIED_USE[keyword]}")
        if not isinstance(sub, Attention):
            continue
        if sub.layer_idx != block:
            raise UserError(f"ResidualStack: sublayers[{i}] (Attention) has layer_idx={sub.layer_idx} but "
                            f"is block {block}'s attention; build it with layer_idx={block}")
        if value_residual and sub.value_residual is None:
            raise UserError(f"ResidualStack: sublayers[{i}] (Attention) has no value residual; build it "
                            "with value_residual='fixed' or 'learned'")
        sub.depth_attention = sub.depth_attention or bool(depth_attention)   # no parameters of its own
    return tuple(carried)


# ---- sublayers of another width ------------------------------------------------------------------
def _first_linear_width(sub: Any) -> tuple[str, int] | None:
    """The name (``""``: ``sub`` itself) and input width of the first ``nn.Linear`` in ``sub``."""
    if not isinstance(sub, nn.Module):
        return None
    for name, module in sub.named_modules():
        if isinstance(module, nn.Linear) and not isinstance(module, nn.LazyLinear):
            return name, module.in_features
    return None


def _width_checked(dim: int, sublayers: nn.ModuleList, wrap: Wrap | None) -> Wrap:
    """A ``wrap`` (around ``wrap``) whose branches name a sublayer of another width in a ``ValueError``."""
    def wrapped(i: int, branch: Callable[..., Tensor]) -> Callable[..., Tensor]:
        inner = branch if wrap is None else wrap(i, branch)
        sub = sublayers[i]
        sub = sub.fn if isinstance(sub, _Function) else sub

        def call(x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
            try:
                out = inner(x, *args, **kwargs)
            except (RuntimeError, ValueError) as error:
                first = _first_linear_width(sub)
                if first is not None and first[1] != x.shape[-1]:
                    where = f" (its first Linear, {first[0]!r})" if first[0] else ""
                    raise ValueError(
                        f"ResidualStack: sublayers[{i}] ({type(sub).__name__}) takes width "
                        f"{first[1]}{where}, but the scheme gives it width {x.shape[-1]} (dim={dim}); "
                        "build the sublayers and the scheme for one width") from error
                raise
            if isinstance(out, Tensor) and out.shape[-1] != x.shape[-1]:
                raise ValueError(f"ResidualStack: sublayers[{i}] ({type(sub).__name__}) returned width "
                                 f"{out.shape[-1]} for an input of width {x.shape[-1]} (dim={dim}); a "
                                 "sublayer's update has the width of its input")
            return out
        return call
    return wrapped


def hidden_at(scheme: ResidualScheme, state: Any) -> Tensor:
    """The state at a block boundary as one tensor: a one-stream scheme's stream, else the scheme's exit."""
    state = settled(scheme, state)
    streams = scheme.streams(state)
    if len(streams) == 1:
        (only,) = streams.values()
        if isinstance(state, Tensor) and only is state:
            return only
    return scheme.exit(state)
