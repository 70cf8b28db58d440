"""The running totals and status of a training run, which a checkpoint carries across a resume (a field
an older checkpoint lacks takes its default)."""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RunState:
    """Counters and records of one run. ``step`` counts completed optimizer updates."""

    step: int = 0
    last_loss: float | None = None
    best_loss: float = math.inf           # lowest finite training loss so far
    last_val_loss: float | None = None
    best_val_loss: float | None = None
    best_val_step: int | None = None
    last_extra: dict[str, Any] = field(default_factory=dict)   # what the evaluation last returned
    tokens_seen: int = 0
    train_time_s: float = 0.0             # time inside training steps (no eval, no checkpoints)
    wall_time_s: float = 0.0              # of the sessions before this one
    seq_len: int | None = None            # of the training batches, for flops_per_token
    checkpoint_step: int | None = None    # step of the checkpoint on disk
    micro_batches: int | None = None      # per step over all ranks (world size x grad_accum)
    zero_grad_steps: int = 0              # consecutive steps with a zero gradient, up to ``step``
    stalled_at: int | None = None         # first step of the zero-gradient stretch that ended the run
    diverged_at: int | None = None        # the step whose loss or gradient ended the run (not applied)

    @property
    def ended(self) -> bool:
        """Whether the run stopped as failed: a resumed run that did trains no further."""
        return self.diverged_at is not None or self.stalled_at is not None

    def record_step(self, step: int, loss: float, tokens: int, seconds: float) -> None:
        """Step ``step``, applied: its loss, tokens and time inside the step."""
        self.step, self.last_loss, self.best_loss = step, loss, min(self.best_loss, loss)
        self.tokens_seen += tokens
        self.train_time_s += seconds

    def record_val(self, val_loss: float | None, extra: dict[str, Any]) -> None:
        self.last_extra = dict(extra)
        if val_loss is None:
            return
        self.last_val_loss = val_loss
        if math.isfinite(val_loss) and (self.best_val_loss is None or val_loss < self.best_val_loss):
            self.best_val_loss, self.best_val_step = val_loss, self.step

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RunState:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


class Phase(enum.Enum):
    """Where a step is, for what an interrupt may save."""
    IDLE = "idle"           # between steps: everything on disk or in memory is consistent
    COMPUTE = "compute"     # gradients of a step: the step can be taken back
    UPDATE = "update"       # inside optimizer.step: half-updated weights, nothing is saved
    AFTER = "after"         # updated, the step not yet recorded: one process saves, many do not
