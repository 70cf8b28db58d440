"""The loop's hook for diagnostics that need a step's gradients or updated weights (docs/analysis.md).
A probe runs under :func:`~.rng.preserved_rng` and must change no gradient, weight or batch source."""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from torch import nn


@runtime_checkable
class StepProbe(Protocol):
    """On the steps it ``wants``: ``after_backward`` before clipping, ``after_update`` after the update."""

    def start(self, run_dir: Path, keep_until: int | None) -> None: ...

    def wants(self, step: int) -> bool: ...

    def after_backward(self, model: nn.Module, step: int) -> None: ...

    def after_update(self, model: nn.Module, step: int, diverged: bool) -> None: ...

    def close(self) -> None: ...
