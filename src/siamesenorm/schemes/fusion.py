"""The fused hand-over between sublayers, kept out of the schemes' equations.

A scheme's ``step``, ``exit`` and ``streams`` are its paper's equations. With the class decorator
:func:`fuses` it says which shape they have; where the fused kernels (or lean functions) run, the
dispatch here then leaves a sublayer's last residual write to the next sublayer's entry, which
does both in one kernel each way. Between two steps the state may then be a pending write
(:class:`PendingAdd`, :class:`PendingUpdate`, :class:`PendingNorm`); ``exit`` and ``streams``
accept it. A subclass that rewrites any of ``enter``, ``step``, ``exit`` or ``streams`` is not fused.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import Tensor

from ..nn.fused import (
    add_then_norm,
    defers_add,
    defers_update,
    fused_enabled,
    stream_entry,
    stream_update,
    stream_update_entry,
)

__all__ = ["AddThenNorm", "NormThenNorm", "PendingAdd", "PendingNorm", "PendingUpdate",
           "UpdateThenEntry", "fuses", "settled"]


class PendingAdd(NamedTuple):
    """The stream ``h + out``, its add left to the next norm."""

    h: Tensor
    out: Tensor


class PendingUpdate(NamedTuple):
    """The streams ``X = x + out / c`` and ``Y = y + out``, their writes left to the next entry."""

    x: Tensor
    y: Tensor
    out: Tensor
    c: float


class PendingNorm(NamedTuple):
    """The stream ``h`` and the next sublayer's input, normalised with it in one function."""

    h: Tensor
    normed: Tensor


@dataclass(frozen=True)
class AddThenNorm:
    """Sublayer ``i`` is ``h + F(entry[i](h))``, the exit ``exit(h)`` (``None``: ``h``); each add
    and the next norm run as one kernel (:func:`~siamesenorm.nn.fused.add_then_norm`)."""

    entry: str
    exit: str
    pending = PendingAdd

    def starts(self, scheme: Any, h: Tensor) -> bool:
        return defers_add(h, scheme.norm_kind)

    def step(self, scheme: Any, state: Tensor | PendingAdd, i: int, branch) -> Tensor | PendingAdd:
        norm = getattr(scheme, self.entry)[i]
        h, normed = add_then_norm(*state, norm) if isinstance(state, PendingAdd) else (state, norm(state))
        out = branch(normed)
        return PendingAdd(h, out) if defers_add(h, scheme.norm_kind) else h + out

    def finish(self, scheme: Any, state: PendingAdd) -> Tensor:
        return add_then_norm(*state, getattr(scheme, self.exit))[1]

    def settle(self, state: PendingAdd) -> Tensor:
        return state.h + state.out


@dataclass(frozen=True)
class UpdateThenEntry:
    """Two streams; sublayer ``i`` is ``x, u = stream_entry(x, y, **entry(i))``, then ``x, y =
    stream_update(x, y, F(u), scale(i))``, the exit ``stream_entry(x, y, **exit())[1]``; a
    sublayer's writes and the next entry run as one kernel
    (:func:`~siamesenorm.nn.fused.stream_update_entry`)."""

    entry: str
    scale: str
    exit: str
    pending = PendingUpdate

    def starts(self, scheme: Any, state: tuple) -> bool:
        return defers_update(state[0], state[1], scheme.norm_kind)

    def step(self, scheme: Any, state: tuple, i: int, branch) -> tuple:
        norms = getattr(scheme, self.entry)(i)
        if isinstance(state, PendingUpdate):
            x, y, u = stream_update_entry(*state, **norms)
        else:
            x, y = state
            x, u = stream_entry(x, y, **norms)
        out, c = branch(u), getattr(scheme, self.scale)(i)
        return PendingUpdate(x, y, out, c) if defers_update(x, y, scheme.norm_kind) \
            else stream_update(x, y, out, c)

    def finish(self, scheme: Any, state: PendingUpdate) -> Tensor:
        return stream_update_entry(*state, **getattr(scheme, self.exit)())[2]

    def settle(self, state: PendingUpdate) -> tuple:
        return stream_update(*state)


@dataclass(frozen=True)
class NormThenNorm:
    """Sublayer ``i`` is ``post[i](skip * h + F(pre[i](h)))``; within a block, the attention's post
    norm and the MLP's pre norm run as one lean function (:func:`~siamesenorm.nn.fused.stream_entry`),
    which keeps only their input (a block's norms stay its own: FSDP units)."""

    pre: str
    post: str
    skip: str
    pending = PendingNorm

    def starts(self, scheme: Any, h: Tensor) -> bool:
        return fused_enabled()

    def step(self, scheme: Any, state: Tensor | PendingNorm, i: int, branch) -> Tensor | PendingNorm:
        pre, post = getattr(scheme, self.pre), getattr(scheme, self.post)
        h, normed = state if isinstance(state, PendingNorm) else (state, pre[i](state))
        s = getattr(scheme, self.skip) * h + branch(normed)
        if scheme.is_attention(i):
            return PendingNorm(*stream_entry(s, x_norm=post[i], in_norm=pre[i + 1]))
        return post[i](s)

    def settle(self, state: PendingNorm) -> Tensor:
        return state.h


def settled(scheme: Any, state: Any) -> Any:
    """``state`` with any pending write done: the state the scheme's own equations hold."""
    spec = getattr(type(scheme), "fusion", None)
    return spec.settle(state) if spec is not None and isinstance(state, spec.pending) else state


_EQUATIONS = ("enter", "step", "exit", "streams")


def fuses(spec: AddThenNorm | UpdateThenEntry | NormThenNorm):
    """Class decorator: the scheme's equations have the shape ``spec`` describes, and the dispatch
    fuses them where it can; everywhere else they run as written."""
    def decorate(cls):
        own = {name: getattr(cls, name) for name in ("step", "exit", "streams")}

        def fusable(scheme) -> bool:
            return all(getattr(type(scheme), name) is getattr(cls, name) for name in _EQUATIONS)

        def step(self, state, i, branch):
            if isinstance(state, spec.pending) or (fusable(self) and spec.starts(self, state)):
                return spec.step(self, state, i, branch)
            return own["step"](self, state, i, branch)

        def exit(self, state):
            if isinstance(state, spec.pending):
                if hasattr(spec, "finish"):
                    return spec.finish(self, state)
                state = spec.settle(state)
            return own["exit"](self, state)

        def streams(self, state):
            return own["streams"](self, spec.settle(state) if isinstance(state, spec.pending) else state)

        for name, fn in (("step", step), ("exit", exit), ("streams", streams)):
            setattr(cls, name, functools.update_wrapper(fn, own[name]))
        cls.fusion = spec
        return cls
    return decorate
