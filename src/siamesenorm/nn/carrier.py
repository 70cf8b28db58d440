"""What attention layers hand to later layers during one forward pass (value residuals, Depth-Attention)."""

from __future__ import annotations

from typing import Any

__all__ = ["LayerCarrier"]


class LayerCarrier:
    """Tensors by the index of the attention layer that made them (``held``); the first write wins.
    Under activation checkpointing a step runs on a :meth:`copy`, and :meth:`merge` takes what it added."""

    def __init__(self) -> None:
        self.held: dict[int, Any] = {}

    def empty(self) -> LayerCarrier:
        return type(self)()

    def keep(self, layer: int, item: Any) -> None:
        if layer not in self.held:
            self.held[layer] = item

    def copy(self) -> LayerCarrier:
        other = self.empty()
        other.held = dict(self.held)
        return other

    def added_since(self, earlier: LayerCarrier) -> dict[int, Any]:
        return {layer: item for layer, item in self.held.items() if layer not in earlier.held}

    def merge(self, added: dict[int, Any]) -> None:
        for layer, item in added.items():
            self.keep(layer, item)
