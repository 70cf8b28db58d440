"""When a run stops as failed: a step that diverged, or a stretch of steps with no gradient."""

from __future__ import annotations

import math
from typing import Any

from .state import RunState


def diverges(cfg: Any, state: RunState, step: int, loss: float, norm: float) -> bool:
    """A non-finite loss or gradient norm, or after the warm-up a loss above ``divergence_factor``
    times the lowest so far."""
    if not (math.isfinite(loss) and math.isfinite(norm)):
        return True
    return step > cfg.warmup and loss > cfg.divergence_factor * state.best_loss


def stalls(cfg: Any, state: RunState, step: int, norm: float) -> bool:
    """Count step ``step``'s gradient norm ``norm`` in the run's zero-gradient stretch; at
    ``stall_steps`` steps in a row, mark the run stalled from the stretch's first step."""
    state.zero_grad_steps = state.zero_grad_steps + 1 if norm == 0.0 else 0
    if state.zero_grad_steps < cfg.stall_steps:
        return False
    state.stalled_at = step - state.zero_grad_steps + 1
    return True
