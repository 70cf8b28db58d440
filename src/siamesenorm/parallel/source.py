"""Every rank's micro-batches from one seeded order.

The run's batch source (one seeded generator, the same on every rank) yields the global sequence of
micro-batches ``m0, m1, m2, ...``. Step ``s`` of a run with ``W`` ranks and ``A`` micro-batches per
rank uses ``m[s*W*A] .. m[s*W*A + W*A - 1]``; rank ``r`` trains on ``m[s*W*A + a*W + r]`` for
``a = 0 .. A-1``. Each rank draws every micro-batch of the step from its copy of the source and keeps
its own, so all copies stay in the same state: a run with 2 ranks and ``grad_accum=1`` trains on
exactly the samples, in the same order, of 1 rank with ``grad_accum=2``, and a checkpoint's source
state (rank 0's) resumes any world size. Drawing is cheap next to a forward pass (the windows of the
other ranks are cut and dropped).
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["RankSource"]


class RankSource:
    """Rank ``rank`` of ``size``'s share of ``source`` (a :class:`~siamesenorm.train.BatchSource`)."""

    def __init__(self, source, rank: int, size: int) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a world of {size}")
        self.source, self.rank, self.size = source, rank, size

    def next_batch(self) -> tuple[Tensor, Tensor]:
        mine = None
        for r in range(self.size):
            batch = self.source.next_batch()
            if r == self.rank:
                mine = batch
        assert mine is not None
        return mine

    def state_dict(self) -> dict:
        return self.source.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.source.load_state_dict(state)
