"""Observe (and prune) a model's residual streams without re-implementing its forward pass."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from ..models.host import SchemeHost
from ..schemes.base import SUBLAYERS_PER_BLOCK

_METHODS = ("enter", "step", "exit")


def sublayers_of_blocks(blocks: Iterable[int]) -> set[int]:
    return {b * SUBLAYERS_PER_BLOCK + j for b in blocks for j in range(SUBLAYERS_PER_BLOCK)}


class StreamTap:
    """Context manager wrapping ``model.scheme``'s enter/step/exit to record ``scheme.streams(state)``.

    ``skip``: sublayers whose step returns the state unchanged; ``record=False`` only skips. After a
    forward pass ``states[k]`` holds the streams after ``k`` sublayers (0: entry), ``output`` what
    ``exit`` returned.
    """

    def __init__(self, model: SchemeHost, *, skip: Iterable[int] = (), record: bool = True) -> None:
        self.scheme = model.scheme
        self.skip = frozenset(int(i) for i in skip)
        self.record = record
        self.states: list[dict[str, Tensor]] = []
        self.output: Tensor | None = None
        self.forwards = 0
        self._saved: dict[str, Any] = {}

    def _keep(self, state: Any) -> None:
        if self.record:
            self.states.append({k: v.detach() for k, v in self.scheme.streams(state).items()})

    def __enter__(self) -> StreamTap:
        scheme = self.scheme
        self._saved = {name: scheme.__dict__[name] for name in _METHODS if name in scheme.__dict__}
        enter, step, exit_ = scheme.enter, scheme.step, scheme.exit  # bound (possibly wrapped) methods

        def tapped_enter(h: Tensor, *args: Any, **kwargs: Any) -> Any:
            state = enter(h, *args, **kwargs)
            self.states, self.output = [], None
            self._keep(state)
            return state

        def tapped_step(state: Any, i: int, branch: Any, *args: Any, **kwargs: Any) -> Any:
            if i not in self.skip:
                state = step(state, i, branch, *args, **kwargs)
            self._keep(state)
            return state

        def tapped_exit(state: Any, *args: Any, **kwargs: Any) -> Tensor:
            out = exit_(state, *args, **kwargs)
            self.output = out.detach() if self.record else None
            self.forwards += 1
            return out

        for name, fn in zip(_METHODS, (tapped_enter, tapped_step, tapped_exit)):
            object.__setattr__(scheme, name, fn)
        return self

    def __exit__(self, *exc: object) -> None:
        for name in _METHODS:
            if name in self._saved:
                object.__setattr__(self.scheme, name, self._saved[name])
            else:
                self.scheme.__dict__.pop(name, None)
        self._saved = {}

    def block_states(self) -> list[dict[str, Tensor]]:
        """The streams at block boundaries: entry, then after each block's last sublayer."""
        return self.states[::SUBLAYERS_PER_BLOCK]
