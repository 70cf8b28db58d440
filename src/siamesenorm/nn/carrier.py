"""What attention layers hand to later layers during one forward pass (value residuals' first
values, Depth-Attention's keys and values).

A model makes a fresh :class:`LayerCarrier` per forward and passes it among the attention keyword
arguments; a layer keeps its tensors in it under its index (the first write wins) and later layers
read them. Under activation checkpointing the residual loop runs each step on a :meth:`copy` and
merges what the step added (:meth:`merge`) afterwards, outside the checkpointed region, so the tensors
flow in and out of the region as its inputs and outputs: ``torch.compile`` refuses a write to an
outside object inside a checkpoint, and the recompute of a step leaves the carrier as it was.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LayerCarrier"]


class LayerCarrier:
    """Tensors (or tuples of them) by the index of the attention layer that made them: ``held``."""

    def __init__(self) -> None:
        self.held: dict[int, Any] = {}

    def empty(self) -> LayerCarrier:
        """A new, empty carrier like this one (a subclass with arguments passes them on)."""
        return type(self)()

    def keep(self, layer: int, item: Any) -> None:
        """Hold ``item`` for ``layer``, unless that layer already has one."""
        if layer not in self.held:
            self.held[layer] = item

    def copy(self) -> LayerCarrier:
        """A carrier holding what this one holds, for a step to add to."""
        other = self.empty()
        other.held = dict(self.held)
        return other

    def added_since(self, earlier: LayerCarrier) -> dict[int, Any]:
        """What this carrier holds and ``earlier`` does not (what a step on a copy added)."""
        return {layer: item for layer, item in self.held.items() if layer not in earlier.held}

    def merge(self, added: dict[int, Any]) -> None:
        """:meth:`keep` each of ``added``."""
        for layer, item in added.items():
            self.keep(layer, item)
