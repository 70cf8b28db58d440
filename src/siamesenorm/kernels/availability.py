"""Whether the Triton kernels can run on a tensor, and the one-line notice when they cannot."""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import os
import re
import sys

import torch
from torch import Tensor

from ..compute import compute_path

__all__ = ["TRITON_RANGE", "announce_fallback", "kernels_available", "kernels_available_on", "kernels_run_on",
           "kernels_switched_on",
           "triton_installed", "triton_supported", "triton_version"]

# The Triton releases the kernels are tested under: both ends in CI (the interpreter), and on a GPU
# by `benchmarks/gpu.py --smoke`. Outside it the PyTorch path runs, said once.
TRITON_RANGE = ((3, 6), (3, 9))

_announced = False


def _find_triton() -> bool:
    """Whether Triton is installed, found without importing it (the kernels import it on first use)."""
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


def _installed_version() -> str | None:
    for dist in ("triton", "pytorch-triton", "pytorch-triton-rocm"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


_TRITON = _find_triton()
_VERSION = _installed_version() if _TRITON else None


def triton_installed() -> bool:
    return _TRITON


def triton_version() -> str | None:
    """Triton's version as installed (its distribution's metadata), or None."""
    return _VERSION


def triton_supported(version: str | None = None) -> bool:
    """Whether ``version`` (default: the installed one) lies in :data:`TRITON_RANGE`."""
    return _supported(_VERSION if version is None else version)


@functools.lru_cache(maxsize=8)
def _supported(version: str | None) -> bool:      # once a version: kernels_available runs per op call
    match = re.match(r"(\d+)\.(\d+)", version or "")
    if match is None:
        return False
    low, high = TRITON_RANGE
    return low <= (int(match[1]), int(match[2])) <= high


def kernels_switched_on() -> bool:
    """The compute path is ``kernels`` (:func:`siamesenorm.compute.compute_path`)."""
    return compute_path() == "kernels"


def kernels_available_on(device: torch.device) -> bool:
    """Triton is installed in a supported version (:data:`TRITON_RANGE`), the path is ``kernels``,
    and ``device`` is CUDA, or the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, tests)."""
    return _TRITON and triton_supported() and kernels_switched_on() and _kernel_device(device)


def _kernel_device(device: torch.device) -> bool:
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def kernels_available(t: Tensor) -> bool:
    return kernels_available_on(t.device)


def kernels_run_on(*tensors: Tensor | None) -> bool:
    """The one rule: the kernels run on ``tensors`` (``None`` skipped) where the path is ``kernels``
    and they are plain tensors (no DTensor or other subclass) on a device of
    :func:`kernels_available_on`. Where Triton is missing or unsupported on such a device, says so
    once. An op's own shape and dtype checks come on top."""
    given = [t for t in tensors if t is not None]
    if not given or any(type(t) is not Tensor for t in given):
        return False
    if kernels_available(given[0]):
        return True
    if not torch.compiler.is_compiling() and _kernel_device(given[0].device):
        announce_fallback()
    return False


def _why_not() -> str:
    if not _TRITON or triton_supported():
        return "fused Triton kernels need CUDA and triton"
    (a, b), (c, d) = TRITON_RANGE
    return f"fused Triton kernels are tested with Triton {a}.{b} to {c}.{d}, not {_VERSION}"


def announce_fallback() -> None:
    """Say once per process, on stderr, that the PyTorch path runs in place of the kernels."""
    global _announced
    if _announced or not kernels_switched_on():     # another path chosen: nothing to say
        return
    _announced = True
    print(f"siamesenorm: {_why_not()}; running the PyTorch path", file=sys.stderr)
