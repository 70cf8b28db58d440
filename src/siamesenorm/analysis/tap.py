"""Observe (and prune) a model's residual streams without re-implementing its forward pass.

Every model of the library runs ``state = scheme.enter(h)``, ``state = scheme.step(state, i,
branch)`` for each sublayer and ``scheme.exit(state)``. :class:`StreamTap` wraps those three methods
of ``model.scheme`` for the duration of a ``with`` block, so any model (language model, ViT, DiT,
whatever extra arguments its branches take) can be observed by simply running it::

    with StreamTap(model) as tap:
        loss_fn(model, batch)            # any call that runs the model once
    tap.states[k]                        # {stream name: tensor} after k sublayers (k=0: entry)
    tap.output                           # what scheme.exit returned (the head's input)

``skip`` names sublayers whose step is replaced by the identity (the state passes unchanged, the
branch is not called): skipping both sublayers of a block removes that block, the layer-pruning
experiment of the SiameseNorm paper (arXiv 2602.08064, Fig. 2c).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import Tensor

from ..models.host import SchemeHost
from ..schemes.base import SUBLAYERS_PER_BLOCK

_METHODS = ("enter", "step", "exit")


def sublayers_of_blocks(blocks: Iterable[int]) -> set[int]:
    """The sublayer indices of ``blocks`` (``SUBLAYERS_PER_BLOCK`` consecutive sublayers each)."""
    return {b * SUBLAYERS_PER_BLOCK + j for b in blocks for j in range(SUBLAYERS_PER_BLOCK)}


class StreamTap:
    """Context manager: record ``scheme.streams(state)`` after entry and after every step.

    Args:
        model: the model whose ``scheme`` to observe.
        skip: sublayer indices whose step returns the state unchanged.
        record: keep the (detached) stream tensors; ``False`` only skips, storing nothing.

    After each forward pass: ``states`` holds ``n_sublayers + 1`` dicts (index ``k``: after ``k``
    sublayers), ``output`` the tensor ``exit`` returned, ``forwards`` counts the passes seen.
    A new pass (a new ``enter``) starts ``states`` afresh. The scheme's methods are restored on
    leaving the block, even after an error; taps may nest.
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
