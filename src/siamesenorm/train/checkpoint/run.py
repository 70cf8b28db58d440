"""The checkpoints of a run: the last, the kept ones before it, and the newest that loads."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ...errors import UserError
from ...parallel.env import SINGLE, World, barrier, gather_objects
from .keep import kept_name, older_checkpoints, prune_checkpoints
from .load import load_checkpoint
from .safe import UnsafeCheckpoint
from .save import save_checkpoint


@dataclass(frozen=True)
class Saved:
    """What a checkpoint holds besides model and optimizer: counters, source state, generators."""

    run: dict
    source: dict
    rng: dict
    rng_ranks: list | None
    world_size: int

    def micro_batches_per_rank(self, micro_batches: int) -> int:
        """Micro-batches per rank that keep a resumed run's global batch of ``micro_batches``."""
        if micro_batches % self.world_size:
            raise UserError(f"the checkpoint's global batch is {micro_batches} micro-batches, which "
                              f"{self.world_size} processes cannot split evenly; resume with a "
                              "number of processes that divides it")
        return micro_batches // self.world_size


class Checkpoints:
    """A run's checkpoints: the last at ``path``, and the ``keep - 1`` before it beside it as ``step_<N>``."""

    def __init__(self, path: Path, keep: int, world: World = SINGLE) -> None:
        self.path, self.keep, self.world = Path(path), keep, world

    def save(self, module: nn.Module, optimizer: torch.optim.Optimizer, *, step: int,
             previous: int | None, run: dict, source: dict, rng: dict) -> None:
        """Write the checkpoint of ``step`` (a collective across processes); the one of step
        ``previous`` it replaces is kept as ``step_<previous>`` while ``keep`` allows."""
        extra = {"run": run, "source": source, "rng": rng}
        if self.world.distributed:
            extra["rng_ranks"] = gather_objects(self.world, rng)
        keep_as = kept_name(self.path, previous) if self.keep > 1 and previous and previous != step else None
        save_checkpoint(self.path, module, optimizer, extra, world=self.world, keep_as=keep_as)
        if self.world.main:
            prune_checkpoints(self.path, self.keep)

    def load_newest_good(self, module: nn.Module, optimizer: torch.optim.Optimizer) -> Saved:
        """Load the newest checkpoint that loads (the last, else the kept ones, newest first). A
        fallback says so on stderr and moves the last one aside (to ``checkpoints/damaged-<time>``)."""
        first = None
        for path in [self.path, *older_checkpoints(self.path)]:
            try:
                extra = load_checkpoint(path, module, optimizer, world=self.world)
                saved = Saved(extra["run"], extra["source"], extra["rng"], extra.get("rng_ranks"),
                              self.world.size)
            except KeyError as error:
                raise UserError(f"checkpoint {path} lacks the training state {error}; it was not "
                                  "written by siamesenorm.train") from None
            except UnsafeCheckpoint:        # altered, not damaged: no fallback, nothing moved
                raise
            except UserError as error:
                first = first or error
                continue
            if first is not None and self.world.main:
                print(f"warning: {first}; resuming from {path} instead{self._move_aside()}",
                      file=sys.stderr, flush=True)
            barrier(self.world)
            return saved
        assert first is not None
        raise first

    def _move_aside(self) -> str:
        if not self.path.exists():
            return ""
        damaged = self.path.with_name(f"damaged-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}")
        os.replace(self.path, damaged)
        return f" ({self.path.name} moved to {damaged.name})"
