"""Which path the models compute: ``SIAMESENORM_PATH`` and :func:`use_path` (docs/performance.md).

- ``reference``: the plain composition of modules, as the papers write it.
- ``lean``: the same math through autograd functions that keep less for backward.
- ``kernels`` (the default): the fused Triton kernels where they run, the lean path elsewhere.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .errors import UserError

__all__ = ["PATHS", "compiled_graph_kernels", "compute_path", "use_path"]

PATHS = ("reference", "lean", "kernels")
_OFF = ("0", "false", "no")


class _Local(threading.local):
    path: str | None = None             # None: the environment's
    compiled_graphs = False


_local = _Local()


@functools.lru_cache(maxsize=16)
def _parse(value: str | None, fused: str | None, kernels: str | None) -> str:
    if value is not None:
        path = value.strip().lower()
        if path not in PATHS:
            raise UserError(f"SIAMESENORM_PATH={value!r} is not one of {', '.join(PATHS)}")
        return path
    # The switches SIAMESENORM_PATH replaced, read for one release.
    for name, raw, path in (("SIAMESENORM_FUSED", fused, "reference"),
                            ("SIAMESENORM_KERNELS", kernels, "lean")):
        if raw is not None and raw.strip().lower() in _OFF:
            print(f"siamesenorm: {name}=0 is deprecated; use SIAMESENORM_PATH={path}", file=sys.stderr)
            return path
    return "kernels"


def compute_path() -> str:
    """The path in this thread: :func:`use_path`'s, else ``SIAMESENORM_PATH``'s (read at each call)."""
    if _local.path is not None:
        return _local.path
    env = os.environ
    return _parse(env.get("SIAMESENORM_PATH"), env.get("SIAMESENORM_FUSED"),
                  env.get("SIAMESENORM_KERNELS"))


def compiled_graph_kernels() -> bool:
    """Whether graphs traced now call the stream kernels (else Inductor fuses that work)."""
    return _local.compiled_graphs


@contextmanager
def use_path(path: str, *, compiled_graphs: bool = False) -> Iterator[None]:
    """Compute ``path`` in this thread within the block. ``compiled_graphs=True``: graphs that
    ``torch.compile`` traces within the block call SiameseNorm's and Pre-Norm's stream kernels
    too, instead of leaving that work to Inductor (read when a graph is traced)."""
    if path not in PATHS:
        raise ValueError(f"path must be one of {', '.join(PATHS)}, not {path!r}")
    before = _local.path, _local.compiled_graphs
    _local.path, _local.compiled_graphs = path, compiled_graphs
    try:
        yield
    finally:
        _local.path, _local.compiled_graphs = before


def lean_on() -> bool:
    """The lean functions run: not the reference path, and not while ``torch.compile`` traces
    (Inductor fuses the plain composition and chooses what to keep itself)."""
    return compute_path() != "reference" and not torch.compiler.is_compiling()
