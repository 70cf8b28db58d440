"""Which torch device a run or a command uses, refused in one line when it cannot be had."""

from __future__ import annotations

import torch

from .errors import ConfigError

__all__ = ["resolve_device"]


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
