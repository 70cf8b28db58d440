"""A kernel never ends a run: first-use checks, and the PyTorch path when a kernel fails.

The first call of an op for a configuration checks its kernels against the PyTorch path on a few
random rows, forward and backward, in a thread of its own (autograd is off inside an op). A failed
check, or a launch that raises later, turns the op off for the process with one line on stderr;
that call and every later one compute the PyTorch path. Out of memory is re-raised.
docs/performance.md, "Kernels that never end a run".
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .availability import kernels_available_on, kernels_switched_on, triton_version

__all__ = ["KernelCheck", "KernelMismatch", "KernelOp", "kernel_ops", "self_check"]

_local = threading.local()
_lock = threading.RLock()
_OPS: dict[str, KernelOp] = {}


class KernelMismatch(RuntimeError):
    """A kernel's value or gradient differs from the PyTorch path's beyond the dtype's tolerance."""


@dataclass
class KernelCheck:
    """One op's first-use check on one device and dtype (:func:`self_check`)."""
    op: str
    dtype: torch.dtype
    ok: bool
    reason: str
    seconds: float
    max_error: float


def _checking() -> bool:
    return getattr(_local, "checking", False)


@contextmanager
def _checking_here() -> Iterator[None]:
    _local.checking = True
    try:
        yield
    finally:
        _local.checking = False


def in_thread(fn: Callable[[], Any], device: torch.device) -> Any:
    """``fn()`` in a fresh thread with autograd on, on ``device`` and its current CUDA stream;
    what it raises is raised here."""
    result: list[Any] = []
    error: list[BaseException] = []
    stream = torch.cuda.current_stream(device) if device.type == "cuda" else None

    def target() -> None:
        try:
            with torch.enable_grad():
                if stream is None:
                    result.append(fn())
                else:
                    with torch.cuda.device(device), torch.cuda.stream(stream):
                        result.append(fn())
        except BaseException as e:          # noqa: B036 -- handed to the caller's thread
            error.append(e)

    thread = threading.Thread(target=target, name="siamesenorm-kernel-check")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    text = text if len(text) <= 240 else text[:237] + "..."
    return f"{type(e).__name__}: {text}"


def tolerance(*things: Any) -> float:
    """Relative tolerance: 1e-3, or 5e-2 where any tensor or dtype among ``things`` (lists too) is
    bf16 or fp16 (rounding, not a bug)."""
    def dtypes(a: Any) -> list[torch.dtype]:
        if isinstance(a, (Tensor, torch.dtype)):
            return [a if isinstance(a, torch.dtype) else a.dtype]
        return [d for x in a for d in dtypes(x)] if isinstance(a, (list, tuple)) else []
    return 5e-2 if any(d in (torch.bfloat16, torch.float16) for d in dtypes(things)) else 1e-3


def compare(kernel: Callable[..., Sequence[Tensor]], reference: Callable[..., Sequence[Tensor]],
            args: Sequence[Any], tol: float | None = None, seed: int = 0) -> float:
    """Run ``kernel`` and ``reference`` on ``args`` and the gradients of their floating-point
    tensors under one random cotangent; raise :class:`KernelMismatch` where one differs by more
    than ``tol`` times (1 + its largest reference magnitude). Returns the largest such error."""
    tol = tolerance(args) if tol is None else tol

    def leaves(a: Any) -> Any:
        if isinstance(a, Tensor):
            return a.detach().clone().requires_grad_(a.is_floating_point())
        if isinstance(a, (list, tuple)):
            return type(a)(leaves(x) for x in a)
        return a

    def flat(a: Any) -> list[Tensor]:
        if isinstance(a, Tensor):
            return [a] if a.requires_grad else []
        if isinstance(a, (list, tuple)):
            return [t for x in a for t in flat(x)]
        return []

    worst = 0.0
    runs = []
    for fn in (kernel, reference):
        inputs = [leaves(a) for a in args]
        outputs = list(fn(*inputs))
        runs.append((inputs, outputs))
    r_in, r_out = runs[1]
    gen = torch.Generator(device=r_out[0].device).manual_seed(seed + 1)
    cotangents = [torch.randn(o.shape, generator=gen, device=o.device, dtype=torch.float32) for o in r_out]
    found = []
    for inputs, outputs in runs:
        wrt = flat(inputs)
        loss = sum((o.float() * c).sum() for o, c in zip(outputs, cotangents))
        grads = torch.autograd.grad(loss, wrt, allow_unused=True)
        found.append([o.detach() for o in outputs] + [g if g is not None else torch.zeros_like(t)
                                                        for g, t in zip(grads, wrt)])
    names = [f"output {i}" for i in range(len(r_out))] + [f"gradient {i}" for i in range(len(flat(r_in)))]
    for name, got, want in zip(names, *found, strict=True):
        got, want = got.double(), want.double()
        if got.shape != want.shape:
            raise KernelMismatch(f"{name} has shape {tuple(got.shape)}, the PyTorch path's "
                                 f"{tuple(want.shape)}")
        scale = 1.0 + float(want.abs().max()) if want.numel() else 1.0
        err = float((got - want).abs().max()) / scale if want.numel() else 0.0
        if not err <= tol:                  # NaN fails too
            raise KernelMismatch(f"{name} differs from the PyTorch path by {err:.3g} (tolerance {tol:g})")
        worst = max(worst, err)
    return worst


class KernelOp:
    """One fused op's guard: its check (``check(*op_args)``: the largest relative error, raising
    where the kernels differ), its state in this process, and the fallback to PyTorch.
    ``example(device, dtype)`` gives forward arguments for :func:`self_check`."""

    def __init__(self, name: str, check: Callable[..., float],
                 example: Callable[[torch.device, torch.dtype], tuple]):
        self.name, self._check, self._example = name, check, example
        self.off_reason: str | None = None
        self._checked: set[tuple] = set()
        self._pending: set[tuple] = set()
        _OPS[name] = self

    @property
    def on(self) -> bool:
        return self.off_reason is None

    def turn_off(self, reason: str) -> None:
        """Off for this process, said once on stderr (unless another path was chosen)."""
        with _lock:
            if self.off_reason is not None:
                return
            self.off_reason = reason
        if kernels_switched_on():
            print(f"siamesenorm: the {self.name} kernel is off for this run (Triton {triton_version()}, "
                  f"torch {torch.__version__}): {reason}; running the PyTorch path instead "
                  f"(SIAMESENORM_PATH=lean silences this)", file=sys.stderr, flush=True)

    def reset(self) -> None:
        """On and unchecked again (for tests)."""
        with _lock:
            self.off_reason = None
            self._checked.clear()
            self._pending.clear()

    def check(self, key: tuple, args: tuple, device: torch.device) -> float | None:
        """Check ``key``'s configuration once; returns the error found, or None when checked before,
        being checked, or turned off by it."""
        with _lock:
            if key in self._checked or key in self._pending or self.off_reason is not None:
                return None
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                return None                 # nothing else may launch while a CUDA graph records
            if torch._C._current_graph_task_id() != -1:
                return None                 # inside a backward pass (a recomputed forward): later
            self._pending.add(key)

        try:
            err = self.compare(args, device)
            with _lock:
                self._checked.add(key)
            return err
        except torch.OutOfMemoryError:
            raise
        except Exception as e:
            self.turn_off(f"its first-use check failed: {_one_line(e)}")
            return None
        finally:
            with _lock:
                self._pending.discard(key)

    def run(self, kernel: Callable[[], Any], fallback: Callable[[], Any],
            check: tuple[tuple, tuple, torch.device] | None = None,
            device: torch.device | None = None) -> Any:
        """``kernel()``, or ``fallback()`` where the op is off, the device runs no kernels or the
        kernel raises (which turns the op off). ``check``: ``(key, forward arguments, device)``,
        checked first where ``key`` was not."""
        if _checking() or check is not None and check[0] in self._pending:
            return kernel()         # the check's own calls (its backward may run in another thread)
        if not kernels_available_on(check[2] if check is not None else device):
            return fallback()
        if self.off_reason is None and check is not None and check[0] not in self._checked:
            self.check(*check)
        if self.off_reason is not None:
            return fallback()
        try:
            return kernel()
        except torch.OutOfMemoryError:
            raise
        except Exception as e:
            self.turn_off(f"a launch failed: {_one_line(e)}")
            return fallback()

    def compare(self, args: tuple, device: torch.device) -> float:
        """The check on ``args`` (forward arguments), in a thread; raises where it fails."""
        def run() -> float:
            with _checking_here():
                return self._check(*args)
        return in_thread(run, device)

    def example(self, device: torch.device, dtype: torch.dtype) -> tuple:
        return self._example(device, dtype)


def kernel_ops() -> dict[str, KernelOp]:
    """Every fused op's guard, by name (each op's module registers it; the package imports them all)."""
    return dict(_OPS)


def self_check(device: str | torch.device,
               dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16)) -> list[KernelCheck]:
    """Each op's first-use check on ``device`` per dtype, reported rather than raised (the ops'
    state is left as it was)."""
    from .availability import kernels_available
    device = torch.device(device)
    results = []
    for name, op in kernel_ops().items():
        for dtype in dtypes:
            start = time.perf_counter()
            probe = torch.empty(0, device=device)
            if not kernels_available(probe):
                results.append(KernelCheck(name, dtype, False, "the kernels cannot run here (Triton, "
                                           "CUDA or TRITON_INTERPRET=1 missing, or another "
                                           "SIAMESENORM_PATH)",
                                           0.0, float("nan")))
                continue
            try:
                err = op.compare(op.example(device, dtype), device)
                results.append(KernelCheck(name, dtype, True, "", time.perf_counter() - start, err))
            except Exception as e:
                results.append(KernelCheck(name, dtype, False, _one_line(e), time.perf_counter() - start,
                                           float("nan")))
    return results


def reference_grads(fn: Callable[..., Sequence[Tensor]], inputs: Sequence[Tensor | None],
                    cotangents: Sequence[Tensor | None]) -> list[Tensor | None]:
    """A backward op's PyTorch path: the gradients of ``fn(*inputs)`` under ``cotangents`` with
    respect to each floating-point tensor of ``inputs`` (``None`` elsewhere), by
    ``torch.func.vjp`` in this thread (a backward op may run on autograd's device thread)."""
    where = [i for i, t in enumerate(inputs) if t is not None and t.is_floating_point()]

    def function(*xs: Tensor) -> tuple[Tensor, ...]:
        full = list(inputs)
        for i, x in zip(where, xs):
            full[i] = x
        return tuple(fn(*full))

    outputs, vjp = torch.func.vjp(function, *(inputs[i].detach() for i in where))
    grads = vjp(tuple(torch.zeros_like(o) if c is None else c.to(o.dtype)
                      for o, c in zip(outputs, cotangents)))
    out: list[Tensor | None] = [None] * len(inputs)
    for i, g in zip(where, grads):
        out[i] = g if g._base is None else g.clone()            # an op's outputs never alias
    return out


def random_inputs(seed: int, device: torch.device, *specs: tuple[tuple[int, ...], torch.dtype] | None,
                  scale: float = 1.0) -> list[Tensor | None]:
    """Random normal tensors of the given (shape, dtype) specs (None stays None), from ``seed``."""
    gen = torch.Generator(device=device).manual_seed(seed)
    return [None if spec is None else (scale * torch.randn(spec[0], generator=gen, device=device)).to(spec[1])
            for spec in specs]


def config_key(width: int, *items: Any) -> tuple:
    """A configuration's key: what its kernels compile for, never its number of rows (tensors by
    device and dtype, None as None, flags as they are)."""
    def one(a: Any) -> Any:
        if isinstance(a, (list, tuple)):
            return tuple(one(x) for x in a)
        return (str(a.device), a.dtype) if isinstance(a, Tensor) else a
    return (width, *(one(a) for a in items))
