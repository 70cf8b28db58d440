"""Which torch device a run or a command uses, refused in one line when it cannot be had."""

from __future__ import annotations

import contextlib
import os
import platform
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from .errors import ConfigError

__all__ = ["deterministic", "environment", "resolve_device"]


def resolve_device(name: str, option: str = "train.device") -> torch.device:
    """``auto`` (CUDA when available, else CPU), ``cpu`` or ``cuda[:N]``.

    ``option`` is how the user set it (``train.device`` in a configuration, ``--device`` on the
    command line); the error that refuses an unknown or absent device names it in that form.
    """
    def setting(value: str) -> str:
        return f"{option} {value}" if option.startswith("-") else f"{option}={value}"

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"{setting(repr(name))}: unknown device; use auto, cpu or cuda") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"{setting(name)} but no CUDA device is available; use {setting('cpu')}")
    return device


def _cpu_name() -> str:
    """The processor's model name (``/proc/cpuinfo`` on Linux), else what ``platform`` knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def environment(device: torch.device, world_size: int = 1) -> dict[str, Any]:
    """What a run's numbers depend on besides its configuration and seed: versions, the device
    and its name, threads per process, processes, and whether deterministic algorithms are on
    (floating-point order differs between CPUs, libraries and thread counts)."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    return {"torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "device": str(device), "device_name": name,
            "threads": torch.get_num_threads(), "world_size": world_size,
            "deterministic": torch.are_deterministic_algorithms_enabled()}


@contextlib.contextmanager
def deterministic(enabled: bool) -> Iterator[None]:
    """PyTorch's deterministic algorithms on (``enabled``) for the duration, then as before: an
    operation without a deterministic implementation then raises rather than varying between
    runs. On CUDA, cuBLAS needs ``CUBLAS_WORKSPACE_CONFIG`` set before its first use; it is set
    here when absent."""
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
