"""The processes of one run: who we are (rank, world size) and the process group between them. A single
process is the world of size 1 and never touches ``torch.distributed``."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn, TypeVar

import torch
import torch.distributed as dist

from ..devices import resolve_device
from ..errors import UserError

__all__ = ["SINGLE", "World", "all_max", "all_mean", "barrier", "broadcast_object", "current_world",
           "exit_process", "gather_objects", "init_world", "launched_world_size", "leave_world",
           "local_world_size", "on_main"]

T = TypeVar("T")

# Whether this process joined a process group (init_world): see exit_process.
_joined = False

# How long a collective may wait for a peer before raising (seconds); a rank that died is noticed
# by the launcher first (torchrun stops the others within seconds), this is the last resort.
TIMEOUT_ENV = "SIAMESENORM_DIST_TIMEOUT"
DEFAULT_TIMEOUT_S = 600


@dataclass(frozen=True)
class World:
    """``rank`` of ``size`` processes; ``local_rank`` on this node."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        """Whether this process writes the run's files (rank 0)."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


SINGLE = World()
"""The world of one process."""


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} is not an integer") from None


def launched_world_size() -> int:
    """The world size a launcher asked for (``WORLD_SIZE``; 1 when not launched by one)."""
    size = _env_int("WORLD_SIZE", 1)
    if size < 1:
        raise UserError(f"environment variable WORLD_SIZE={size} is not a world size (at least 1); "
                          "unset it to run in one process")
    return size


# What torchrun gives every process of a world besides WORLD_SIZE, and ``init_process_group``
# needs (its env:// rendezvous).
_WORLD_VARIABLES = ("RANK", "MASTER_ADDR", "MASTER_PORT")


def _check_launched_world(size: int) -> None:
    """Refuse a ``WORLD_SIZE`` above 1 without a launcher's other variables, or a ``RANK`` out of range."""
    missing = [name for name in _WORLD_VARIABLES if not os.environ.get(name)]
    if missing:
        raise UserError(f"WORLD_SIZE={size} says this process is part of a torchrun world, but "
                          f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not set; start "
                          f"it with torchrun (or --nproc {size}), or unset WORLD_SIZE to run in one "
                          "process")
    rank = _env_int("RANK", 0)
    if not 0 <= rank < size:
        raise UserError(f"RANK={rank} is outside the world of WORLD_SIZE={size} processes "
                          f"(0 to {size - 1})")


def local_world_size(world: World) -> int:
    """Processes of ``world`` on this machine (``LOCAL_WORLD_SIZE``, else the whole world)."""
    return max(1, min(world.size, _env_int("LOCAL_WORLD_SIZE", world.size)))


def current_world() -> World:
    """This process's place: from the default process group when one is up, else the world of 1."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size(), _env_int("LOCAL_RANK", 0))
    return World()


def init_world(device_name: str) -> tuple[World, torch.device]:
    """Join the launcher's process group (world size above 1) and pick the device (``cuda:LOCAL_RANK``)."""
    size = launched_world_size()
    device = resolve_device(device_name)
    if size <= 1:
        return World(), device
    if not dist.is_initialized():
        _check_launched_world(size)
    rank, local = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    if device.type == "cuda":
        if local >= torch.cuda.device_count():
            raise UserError(f"LOCAL_RANK={local} but this node has {torch.cuda.device_count()} CUDA "
                              "devices; start at most one process per GPU")
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = timedelta(seconds=_env_int(TIMEOUT_ENV, DEFAULT_TIMEOUT_S))
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=size, timeout=timeout,
                                device_id=device if device.type == "cuda" else None)
        global _joined
        _joined = True
    return World(rank, size, local), device


def leave_world(world: World) -> None:
    """Close the process group :func:`init_world` joined."""
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End this process with exit status ``code``; the entry points' last call. A process that joined a
    process group flushes its streams and calls ``os._exit``: gloo's threads, torn down with the
    interpreter, abort it now and then (SIGABRT) after the run has finished."""
    if not _joined:
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):     # closed, or a broken pipe: nothing more can be written
            pass
    os._exit(code)


def on_main(world: World, fn: Callable[[], T]) -> T | None:
    """Run ``fn`` on rank 0 only, the others waiting; a failure there is raised on every rank (a UserError
    with the same line), so no rank waits in a collective for a peer that is gone."""
    if not world.distributed:
        return fn()
    result, failure = None, None
    if world.main:
        try:
            result = fn()
        except UserError as error:
            failure = ("config", str(error))
            broadcast_object(world, failure)
            raise
        except BaseException as error:
            broadcast_object(world, ("crash", f"{type(error).__name__}: {error}"))
            raise
    failure = broadcast_object(world, failure)
    if failure is not None and not world.main:
        kind, text = failure
        if kind == "config":
            raise UserError(text)
        raise RuntimeError(f"rank 0 failed: {text}")
    return result


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


def broadcast_object(world: World, obj):
    if not world.distributed:
        return obj
    box = [obj if world.main else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(world: World, obj) -> list | None:
    """Every rank's ``obj``, in rank order, on rank 0 (None elsewhere)."""
    if not world.distributed:
        return [obj]
    out = [None] * world.size if world.main else None
    dist.gather_object(obj, out, dst=0)
    return out


def all_mean(world: World, values: torch.Tensor) -> torch.Tensor:
    if not world.distributed:
        return values
    values = values.clone()
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values / world.size


def all_max(world: World, flag: bool, device: torch.device) -> bool:
    """Whether ``flag`` holds on any rank (every rank gets the same answer)."""
    if not world.distributed:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item() > 0)
