"""Shared test helpers: deterministic random branches, a plain loop over a scheme, and a
``pytest.raises`` for errors that are not a user's configuration."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from torch import Tensor

from siamesenorm.errors import ConfigError


def make_branches(n: int, dim: int, *, seed: int = 0, dtype=torch.float64) -> list:
    """``n`` fixed random non-linear sublayers ``u -> tanh(u W1) W2``, different for each i."""
    g = torch.Generator().manual_seed(seed)
    branches = []
    for _ in range(n):
        w1 = torch.randn(dim, dim, generator=g, dtype=dtype) / dim**0.5
        w2 = torch.randn(dim, dim, generator=g, dtype=dtype) / dim**0.5
        branches.append(lambda u, w1=w1, w2=w2: torch.tanh(u @ w1) @ w2)
    return branches


def run_scheme(scheme, h: Tensor, branches) -> Tensor:
    state = scheme.enter(h)
    for i in range(scheme.n_sublayers):
        state = scheme.step(state, i, branches[i])
    return scheme.exit(state)


def randomize_(module: torch.nn.Module, *, seed: int = 1, scale: float = 0.3) -> None:
    """Give every parameter a random value around its initial one, so no norm is an identity."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))


@contextmanager
def raises_value_error(match: str) -> Iterator[pytest.ExceptionInfo]:
    """``pytest.raises(ValueError, match=...)`` that also fails on a ConfigError, which is kept
    for a user's configuration (tensor shapes and values given to a model are not)."""
    with pytest.raises(ValueError, match=match) as info:
        yield info
    assert not isinstance(info.value, ConfigError), info.value


# The start of a script (``python -c``) that runs where siamesenorm cannot be imported: ``sys.argv[1]``
# is the source folder to drop from the path (an editable install's).
HIDE_SIAMESENORM = r'''
import importlib.abc, json, sys

class NoSiameseNorm(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "siamesenorm" or name.startswith("siamesenorm."):
            raise ImportError(f"{name} is hidden in this test")

sys.meta_path.insert(0, NoSiameseNorm())
sys.path = [p for p in sys.path if not p.startswith(sys.argv[1])]
'''
