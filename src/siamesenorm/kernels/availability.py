"""Whether the Triton kernels can run on a tensor, and the one-line notice when they cannot."""

from __future__ import annotations

import importlib.util
import os
import sys

import torch
from torch import Tensor

__all__ = ["announce_fallback", "kernels_available", "kernels_run_on", "kernels_switched_on",
           "triton_installed"]

_announced = False


def _find_triton() -> bool:
    """Whether Triton is installed, found without importing it (the kernels import it on first use)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


_TRITON = _find_triton()


def triton_installed() -> bool:
    return _TRITON


def kernels_switched_on() -> bool:
    """``SIAMESENORM_KERNELS`` is not ``0`` (read at each call, so a process can turn them off)."""
    return os.environ.get("SIAMESENORM_KERNELS", "1").strip().lower() not in ("0", "false", "no")


def kernels_available(t: Tensor) -> bool:
    """Triton is installed, ``SIAMESENORM_KERNELS`` is not ``0``, and ``t`` is on CUDA, or on the
    CPU with ``TRITON_INTERPRET=1`` (Triton's interpreter, for tests)."""
    if not (_TRITON and kernels_switched_on()):
        return False
    if t.is_cuda:
        return True
    return t.device.type == "cpu" and os.environ.get("TRITON_INTERPRET", "0") == "1"


def kernels_run_on(t: Tensor) -> bool:
    """:func:`kernels_available` for ``t``; where not, on CUDA outside a traced graph, say so once
    (:func:`announce_fallback`). An op's own shape and dtype checks come first."""
    if kernels_available(t):
        return True
    if t.is_cuda and not torch.compiler.is_compiling():
        announce_fallback()
    return False


def announce_fallback() -> None:
    """Say once per process, on stderr, that the PyTorch path runs in place of the kernels."""
    global _announced
    if _announced or not kernels_switched_on():     # switched off on purpose: nothing to say
        return
    _announced = True
    print("siamesenorm: fused Triton kernels need CUDA and triton; running the PyTorch path",
          file=sys.stderr)
