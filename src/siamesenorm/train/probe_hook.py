"""The training loop's hook for diagnostics that need a step's gradients or its updated weights.

The loop calls a :class:`StepProbe` on the steps it ``wants``: ``after_backward`` once the step's
gradients are accumulated (before clipping and before the optimizer step, so a spike shows at its
full size), and ``after_update`` once the optimizer step is taken (or refused, on a diverged step).
Each call runs inside :func:`~.rng.preserved_rng`, and a probe must not change the gradients, the
weights or the batch source, so a run trains bit for bit the same with or without probes, and a
resumed run repeats the probes of an uninterrupted one. ``start`` receives the step up to which
existing records are kept on resume (``None``: a fresh run), as the metric log does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol, runtime_checkable

from torch import nn


@runtime_checkable
class StepProbe(Protocol):
    """What :func:`~siamesenorm.train.train` calls (see the module docstring)."""

    def start(self, run_dir: Path, keep_until: int | None) -> None: ...

    def wants(self, step: int) -> bool: ...

    def after_backward(self, model: nn.Module, step: int) -> None: ...

    def after_update(self, model: nn.Module, step: int, diverged: bool) -> None: ...

    def close(self) -> None: ...
