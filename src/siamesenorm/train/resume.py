"""How a run's session begins, afresh or from its newest good checkpoint, and what it saves for the next."""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

import torch
from torch import nn

from ..parallel import World
from .hooks import BatchSource
from .rng import rng_state, set_rng_state
from .state import RunState

if TYPE_CHECKING:
    from .checkpoint import Checkpoints


def fresh_state(world: World, seed: int | None, grad_accum: int) -> RunState:
    """A new run's state; ``seed`` (None: leave them alone) seeds the global generators."""
    state = RunState(micro_batches=world.size * grad_accum)
    if seed is not None:
        # every rank draws its own dropout and noise; rank 0 draws what a single process would
        reseed(seed + 1_000_003 * world.rank)
    return state


def resumed_state(checkpoints: Checkpoints, module: nn.Module, optimizer: torch.optim.Optimizer,
                  source: BatchSource, world: World, seed: int | None,
                  grad_accum: int) -> tuple[RunState, int]:
    """Load the newest good checkpoint; the run's state and the micro-batches per rank keeping its batch."""
    saved = checkpoints.load_newest_good(module, optimizer)
    state = RunState.from_dict(saved.run)
    source.load_state_dict(saved.source)
    restore_rng(saved.rng, saved.rng_ranks, world, seed, state.step)
    return state, saved.micro_batches_per_rank(state.micro_batches or grad_accum)


def save_run(checkpoints: Checkpoints, module: nn.Module, optimizer: torch.optim.Optimizer,
             source: BatchSource, state: RunState, wall_time_s: float) -> None:
    """Checkpoint the run at ``state.step``, after ``wall_time_s`` seconds of all its sessions."""
    run = {**state.to_dict(), "wall_time_s": wall_time_s, "checkpoint_step": state.step}
    checkpoints.save(module, optimizer, step=state.step, previous=state.checkpoint_step, run=run,
                     source=source.state_dict(), rng=rng_state())
    state.checkpoint_step = state.step


def restore_rng(rng: dict, per_rank: list | None, world: World, seed: int | None, step: int) -> None:
    """Every rank's generators as saved; at another world size the others than rank 0 start from
    a seed of the step (exact only where the forward draws no random numbers)."""
    if per_rank is not None and len(per_rank) == world.size:
        set_rng_state(per_rank[world.rank])
    elif world.main or per_rank is None:
        set_rng_state(rng)
    else:
        reseed((seed or 0) + 1_000_003 * world.rank + 7919 * step)


def reseed(seed: int) -> None:
    torch.manual_seed(seed)
    random.seed(seed)
