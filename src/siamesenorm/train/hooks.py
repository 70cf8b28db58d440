"""What the training loop is given from outside: where batches come from, and what a task measures
at each evaluation besides the validation loss."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol, runtime_checkable

from torch import Tensor, nn


@runtime_checkable
class BatchSource(Protocol):
    """Where training batches come from.

    ``next_batch`` returns ``(x, y)``, int64 tensors of shape ``(B, T)`` (``y`` may hold ``-100``
    for ignored targets). ``state_dict`` returns a snapshot (later ``next_batch`` calls must not
    change it) of plain containers, numbers, strings and tensors; after ``load_state_dict`` of it,
    ``next_batch`` returns the same batches as it did after the snapshot was taken.
    """

    def next_batch(self) -> tuple[Tensor, Tensor]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Evaluation:
    """A task's figures at each evaluation, on every rank, without moving a training generator.

    The loop enters :meth:`validating` around its validation forwards (a task that reads something
    off them, as the MoE router's load, watches there), then calls the evaluation with the model in
    eval mode under ``no_grad``: ``evaluation(model, step) -> {name: number}``. The last figures of
    a run go to its summary as ``final_<name>``. This base measures nothing.
    """

    def validating(self, model: nn.Module) -> AbstractContextManager:
        return nullcontext()

    def __call__(self, model: nn.Module, step: int) -> dict[str, Any]:
        return {}
