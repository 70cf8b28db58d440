"""Training across processes with PyTorch's own engines: the world of a run, DDP and FSDP2, every
rank's share of one batch order, and the launcher behind ``--nproc`` (docs/scaling.md)."""

from .env import (
    SINGLE,
    World,
    all_max,
    all_mean,
    barrier,
    broadcast_object,
    current_world,
    exit_process,
    gather_objects,
    init_world,
    launched_world_size,
    leave_world,
    on_main,
)
from .source import RankSource
from .wrap import Parallel, autocast_for, parallel_mode, parallelize

__all__ = ["SINGLE", "Parallel", "RankSource", "World", "all_max", "all_mean", "autocast_for",
           "barrier", "broadcast_object", "current_world", "exit_process", "gather_objects",
           "init_world", "launched_world_size", "leave_world", "on_main", "parallel_mode",
           "parallelize"]
