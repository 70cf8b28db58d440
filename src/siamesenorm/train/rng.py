"""Capture and restore every global random generator a training step may draw from."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager

import torch


def rng_state() -> dict:
    """Python's ``random``, torch's CPU and every CUDA generator; plain types and tensors only."""
    version, internal, gauss = random.getstate()
    state = {"python": [version, list(internal), gauss], "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` captured. CUDA states are restored only when this machine has
    the same number of CUDA devices (a GPU checkpoint resumed on CPU keeps the CPU part)."""
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)


@contextmanager
def preserved_rng() -> Iterator[None]:
    """Run a block (evaluation, a callback) without moving any global generator."""
    saved = rng_state()
    try:
        yield
    finally:
        set_rng_state(saved)
