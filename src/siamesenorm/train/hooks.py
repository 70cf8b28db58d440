"""What the training loop is given from outside: where batches come from, and what a task measures."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn


@runtime_checkable
class BatchSource(Protocol):
    """Where training batches come from: ``next_batch() -> (x, y)``, int64 ``(B, T)`` (``y`` may hold
    ``-100``). After ``load_state_dict`` of a ``state_dict`` snapshot (plain containers and tensors),
    ``next_batch`` repeats the batches that followed it."""

    def next_batch(self) -> tuple[Tensor, Tensor]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Evaluation:
    """A task's figures at each evaluation, ``evaluation(model, step) -> {name: number}`` in eval mode under
    ``no_grad``, moving no training generator; :meth:`validating` wraps the validation forwards. The last
    figures go to the summary as ``final_<name>``."""

    def validating(self, model: nn.Module) -> AbstractContextManager:
        return nullcontext()

    def __call__(self, model: nn.Module, step: int) -> dict[str, Any]:
        return {}
