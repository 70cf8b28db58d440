"""The summary of a run, as written to ``summary.json``."""

from __future__ import annotations

import math
from typing import Any

from torch import nn

from ..models.host import SchemeHost
from .state import RunState
from .throughput import model_flops_per_token


def perplexity(loss: float | None) -> float | None:
    """``exp(loss)``; infinite past float range, ``None`` for no loss."""
    return None if loss is None else math.exp(loss) if loss < 700 else math.inf


def build_summary(model: nn.Module, state: RunState, steps_planned: int, *, diverged_at: int | None,
                  interrupted: bool, wall_time_s: float,
                  stalled_at: int | None = None) -> dict[str, Any]:
    """Figures of the run so far: ``steps`` counts applied updates; ``stalled_at`` is the first of the
    zero-gradient steps that stopped it, ``failed`` says it diverged or stalled; ``final_*`` are the last
    evaluation's figures; ``tokens_per_s`` leaves evaluation and checkpoints out."""
    # Any module trains (the loop's contract is only ``model(x, y).loss``); a scheme host gives its
    # own counts, other modules every parameter and no FLOPs.
    count = model.num_parameters() if isinstance(model, SchemeHost) else \
        sum(p.numel() for p in model.parameters())
    flops = model_flops_per_token(model, state.seq_len)
    out = {
        "steps": state.step, "steps_planned": steps_planned,
        "diverged": diverged_at is not None, "diverged_at": diverged_at,
        "stalled": stalled_at is not None, "stalled_at": stalled_at,
        "failed": diverged_at is not None or stalled_at is not None,
        "interrupted": interrupted, "checkpoint_step": state.checkpoint_step,
        "final_loss": state.last_loss,
        "best_loss": state.best_loss if math.isfinite(state.best_loss) else None,
        "final_val_loss": state.last_val_loss, "final_val_ppl": perplexity(state.last_val_loss),
        "best_val_loss": state.best_val_loss, "best_val_ppl": perplexity(state.best_val_loss),
        "best_val_step": state.best_val_step,
        "wall_time_s": wall_time_s, "train_time_s": state.train_time_s,
        "tokens_seen": state.tokens_seen,
        "tokens_per_s": state.tokens_seen / state.train_time_s if state.train_time_s > 0 else None,
        "num_parameters": count, "flops_per_token": flops,
    }
    out.update({f"final_{k}": v for k, v in state.last_extra.items() if f"final_{k}" not in out})
    return out
