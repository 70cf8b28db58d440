"""Every rank's micro-batches from one seeded order: rank ``r`` of ``W`` trains on micro-batches
``r, r + W, ...`` of the step and draws the others too, so every copy of the source stays in step
and a checkpoint's source state resumes any world size."""

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
