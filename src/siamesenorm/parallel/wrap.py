"""Spread one model over the ranks with PyTorch's engines, DDP or FSDP2 (docs/scaling.md). Parameter
names do not change, so checkpoints of any engine load into any other."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import nn

from ..errors import UserError
from ..models.host import SchemeHost
from .env import World

__all__ = ["Parallel", "autocast_for", "parallel_mode", "parallelize"]


def parallel_mode(setting: str, world: World) -> str:
    """The engine (``none``, ``ddp`` or ``fsdp``) that ``train.parallel=setting`` means here."""
    if not world.distributed:
        return "none"
    if setting == "none":
        raise UserError(f"train.parallel=none trains in one process, but {world.size} were "
                          "launched; use auto, ddp or fsdp, or launch one process")
    return "fsdp" if setting == "auto" else setting


def _uses_mp_policy(mode: str, precision: str, device: torch.device) -> bool:
    return mode == "fsdp" and device.type == "cuda" and precision in ("auto", "bf16")


def autocast_for(mode: str, precision: str, device: torch.device) -> Callable[[], AbstractContextManager]:
    """The context each forward runs in: bf16 autocast, or nothing (float32, or FSDP2's policy)."""
    bf16 = precision == "bf16" or (precision == "auto" and device.type == "cuda")
    if not bf16 or _uses_mp_policy(mode, precision, device):
        return nullcontext
    return lambda: torch.autocast(device.type, dtype=torch.bfloat16)


class Parallel:
    """A model spread over the ranks: ``module`` is what the loop calls (DDP's wrapper, or the
    sharded model itself), ``model`` the model with its attributes (scheme, sublayers, ...)."""

    def __init__(self, model: nn.Module, module: nn.Module, mode: str) -> None:
        self.model, self.module, self.mode = model, module, mode

    def sync_gradients(self, sync: bool) -> AbstractContextManager:
        """Around one micro-batch's backward: reduce gradients over the ranks only when ``sync``."""
        if self.mode == "ddp" and not sync:
            return self.module.no_sync()
        if self.mode == "fsdp":
            self.module.set_requires_gradient_sync(sync)
        return nullcontext()


# FSDP2 warns, in every rank's first forward, that a sharded module returned a view: an in-place
# op on that view (``x += y``) would skip the module's pre-backward hook, "which can cause backward
# to fail or produce wrong gradients". Our MoE returns ``out.reshape(shape)``, a view; every scheme
# adds a sublayer's output out of place (DESIGN.md: residual adds are ``x = x + z``), so the hook
# always runs: tests/test_parallel.py's MoE runs under FSDP2 match one process step for step.
MOE_VIEW_WARNING = r"FSDP2-wrapped module \(FSDPMoE\) returned a view tensor"


def _quiet_moe_view_warning() -> None:
    warnings.filterwarnings("ignore", message=MOE_VIEW_WARNING, category=UserWarning)


def parallelize(model: nn.Module, mode: str, world: World, device: torch.device,
                precision: str) -> Parallel:
    """Apply ``mode`` to ``model``, already on ``device`` and initialised identically on every rank."""
    if mode == "none":
        return Parallel(model, model, mode)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        ids = [device.index] if device.type == "cuda" else None
        return Parallel(model, DistributedDataParallel(model, device_ids=ids), mode)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    _quiet_moe_view_warning()
    policy = MixedPrecisionPolicy()
    if _uses_mp_policy(mode, precision, device):
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    groups = list(model.sublayers) if isinstance(model, SchemeHost) else []
    for i, sublayer in enumerate(groups):
        # the last group is gathered for backward first anyway: do not free it after forward
        fully_shard(sublayer, mp_policy=policy, reshard_after_forward=i < len(groups) - 1)
    fully_shard(model, mp_policy=policy)
    return Parallel(model, model, mode)
