"""Which torch device a run or a command uses, refused in one line when it cannot be had."""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .errors import UserError

__all__ = ["check_device_name", "deterministic", "environment", "machine_memory", "resolve_device"]

# The kinds of device a run or a command can use. ``meta`` (shapes without data) builds models for
# ``--dry-run`` but cannot train or generate; other backends (xpu, hpu, ...) are not supported.
DEVICE_KINDS = ("auto", "cpu", "cuda", "mps")


def _setting(option: str, value: str) -> str:
    return f"{option} {value}" if option.startswith("-") else f"{option}={value}"


def check_device_name(name: Any, option: str = "train.device") -> None:
    """Refuse a device name no run can use, whatever this machine has (not a kind in
    :data:`DEVICE_KINDS`, or ``meta``)."""
    if not isinstance(name, str) or not name:
        raise UserError(f"{_setting(option, repr(name))}: give auto, cpu, cuda, cuda:N or mps")
    if name == "auto":
        return
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"{_setting(option, repr(name))}: unknown device; use auto, cpu or cuda") from None
    if device.type == "meta":
        raise UserError(f"{_setting(option, name)}: the meta device holds shapes, not numbers, and "
                          "cannot train or generate; use cpu or cuda (train --dry-run sizes a model "
                          "without memory)")
    if device.type not in DEVICE_KINDS:
        raise UserError(f"{_setting(option, repr(name))}: unknown device; use auto, cpu or cuda")


def resolve_device(name: str, option: str = "train.device") -> torch.device:
    """``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda[:N]`` or ``mps``, present on this
    machine; errors name ``option`` as the user set it."""
    check_device_name(name, option)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"{_setting(option, name)} but no CUDA device is available; use "
                              f"{_setting(option, 'cpu')}")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"{_setting(option, name)} but this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s), cuda:0 to "
                              f"cuda:{torch.cuda.device_count() - 1}")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"{_setting(option, name)} but no MPS device (Apple GPU) is available; use "
                          f"{_setting(option, 'cpu')}")
    return device


def machine_memory(device: torch.device) -> int | None:
    """The bytes of memory ``device`` has: a CUDA device's own; for the CPU, the machine's RAM or
    this process's cgroup limit (a container's), whichever is smaller; ``None`` when unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type != "cpu":
        return None
    sizes = []
    try:
        sizes.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        pass
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:       # "max", or the v1 "unlimited" number
            sizes.append(int(text))
    return min(sizes) if sizes else None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def environment(device: torch.device, world_size: int = 1) -> dict[str, Any]:
    """What a run's numbers depend on besides its configuration and seed: versions, device, threads."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    return {"torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "device": str(device), "device_name": name,
            "threads": torch.get_num_threads(), "world_size": world_size,
            "deterministic": torch.are_deterministic_algorithms_enabled()}


@contextlib.contextmanager
def deterministic(enabled: bool) -> Iterator[None]:
    """PyTorch's deterministic algorithms on for the duration (``enabled``), then as before; sets
    ``CUBLAS_WORKSPACE_CONFIG`` when absent."""
    if not enabled:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    cudnn = torch.backends.cudnn.benchmark
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.benchmark = cudnn
