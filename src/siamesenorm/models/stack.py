"""The residual loop, once: a scheme's ``enter``, its ``step`` over every sublayer, its ``exit``.

:class:`ResidualStack` is what every model of the package runs (the language model, the ViT and the
DiT subclass it) and what anyone can put around their own blocks::

    stack = ResidualStack("siamese", [attn_0, mlp_0, attn_1, mlp_1], dim=512)
    h = stack(x)                          # (batch, tokens, dim) in and out

The sublayers are bare: an attention and an MLP (or an MoE) alternating, each mapping a normalised
``(..., dim)`` tensor to its update, with no norm and no residual add of its own; the scheme puts
every norm and every add around them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from ..nn.carrier import LayerCarrier
from ..schemes.base import SUBLAYERS_PER_BLOCK, ResidualScheme, build_scheme
from .checkpointing import carrying_step, set_scheme_checkpointing

__all__ = ["ResidualStack", "hidden_at"]

Wrap = Callable[[int, Callable[..., Tensor]], Callable[[Tensor], Tensor]]


class _Function(nn.Module):
    """A plain callable as a sublayer module (it holds no parameters of its own)."""

    def __init__(self, fn: Callable[..., Tensor]) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, *args: Any, **kwargs: Any) -> Tensor:
        return self.fn(*args, **kwargs)


class ResidualStack(nn.Module):
    """A residual scheme around a list of bare sublayers.

    Args:
        scheme: a :class:`~siamesenorm.schemes.ResidualScheme` (its ``n_layers`` blocks take two
            sublayers each), or a scheme's name, built with ``dim`` (required then), ``norm``,
            ``eps`` and ``options`` for ``len(sublayers) // 2`` blocks.
        sublayers: modules or callables, attention at even indices and MLP at odd ones.
        checkpointing: ``none``, ``sublayer`` or ``selective``: activation checkpointing of each
            step (see :mod:`~siamesenorm.models.checkpointing`).

    A scheme may ask for something the sublayers must do (``scheme.requires``): HybridNorm and
    SiameseNorm's ``hybrid_pre`` form need attention that normalises q, k and v per head on the
    blocks in ``requires.qkv_norm_blocks``. The package's models honour it; attention of your own
    must do it itself.

    The models of the package subclass it: they build ``scheme`` and ``sublayers`` in their own
    order (``ResidualStack()`` with no arguments) and call :meth:`run` from their ``forward``.
    """

    def __init__(self, scheme: ResidualScheme | str | None = None,
                 sublayers: Sequence[nn.Module | Callable[..., Tensor]] | None = None, *,
                 dim: int | None = None, norm: str = "layernorm", eps: float = 1e-5,
                 checkpointing: str = "none", **options: Any) -> None:
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
        self.set_checkpointing(checkpointing)

    def set_checkpointing(self, mode: str) -> None:
        """Activation checkpointing of every step from now on (``none`` turns it off)."""
        set_scheme_checkpointing(self.scheme, mode)

    def run(self, h: Tensor, *, attention_kwargs: dict[str, Any] | None = None,
            wrap: Wrap | None = None, states: list | None = None) -> Tensor:
        """The loop: ``state = scheme.enter(h)``, ``state = scheme.step(state, i, branch_i)`` for
        every sublayer, then ``scheme.exit(state)``, the hidden state for a head.

        ``attention_kwargs`` go to every attention sublayer (a mask, a KV cache, positions). Those that
        are a :class:`~siamesenorm.nn.carrier.LayerCarrier` reach it as keyword arguments of the
        branch call (:func:`~.checkpointing.carrying_step`), so a branch that ``wrap`` makes must
        pass keyword arguments on to its sublayer.
        ``wrap(i, sublayer) -> branch`` makes the branch of sublayer ``i`` (called in order, once
        per sublayer: DiT's conditioning, stochastic depth). ``states`` receives the state after
        ``enter`` and after every block.
        """
        scheme = self.scheme
        if h.shape[-1] != scheme.dim:
            raise ValueError(f"ResidualStack: the input's last dimension is {h.shape[-1]}, the scheme's "
                             f"width (dim) is {scheme.dim}")
        bound = dict(attention_kwargs or {})
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
        return scheme.exit(state)

    def forward(self, h: Tensor, **kwargs: Any) -> Tensor:
        """:meth:`run`. Run eagerly (not compiled), a sublayer of another width than the scheme's
        is named in a ``ValueError`` (both widths) instead of failing deep in torch."""
        if torch.compiler.is_compiling():
            return self.run(h, **kwargs)
        wrap = _width_checked(self.scheme.dim, self.sublayers, kwargs.pop("wrap", None))
        return self.run(h, **kwargs, wrap=wrap)


# ---- sublayers of another width ------------------------------------------------------------------
def _first_linear_width(sub: Any) -> tuple[str, int] | None:
    """The name (``""``: ``sub`` itself) and input width of the first ``nn.Linear`` in ``sub``, which
    takes the sublayer's input in most blocks (attention's q projection, an MLP's first). Widths are named
    at the first call, not at construction: what a module of a user's feeds its layers is known
    only when it runs."""
    if not isinstance(sub, nn.Module):
        return None
    for name, module in sub.named_modules():
        if isinstance(module, nn.Linear) and not isinstance(module, nn.LazyLinear):
            return name, module.in_features
    return None


def _width_checked(dim: int, sublayers: nn.ModuleList, wrap: Wrap | None) -> Wrap:
    """A ``wrap`` (around ``wrap``, when given) whose branches name a sublayer of another width
    than the scheme's ``dim``: one that fails on its input when its first ``nn.Linear`` takes
    another width, or that returns another width than it was given. Any other failure is
    raised as it is."""
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
    """One tensor for the state at a block boundary (a model's ``hidden_states``): the stream of a
    one-stream scheme, else the scheme's exit applied there (SiameseNorm's merge)."""
    streams = scheme.streams(state)
    if len(streams) == 1:
        (only,) = streams.values()
        if isinstance(state, Tensor) and only is state:
            return only
    return scheme.exit(state)
