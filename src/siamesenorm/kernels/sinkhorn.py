"""Sinkhorn-Knopp as one Triton kernel each way (``siamesenorm::sinkhorn``), for mHC's residual
maps (arXiv 2512.24880): every iteration of a token's ``n x n`` matrix in registers, where the
plain iterations are ``4 * iters`` kernels. Forward keeps only the logits; backward runs the
iterations again and differentiates them by hand, as :mod:`siamesenorm.functional.sinkhorn` does.
"""

import torch
from torch import Tensor

from ..functional.sinkhorn import sinkhorn as sinkhorn_function
from . import arguments, guard
from .availability import kernels_run_on

__all__ = ["MAX_ITERS", "MAX_N", "sinkhorn", "sinkhorn_kernel_runs"]

MAX_N = 8            # the largest n x n the kernel takes (a token's matrix stays in registers)
MAX_ITERS = 64       # backward unrolls the iterations: more take the PyTorch path
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernels():
    from . import _triton_sinkhorn
    return _triton_sinkhorn


def _check(logits: Tensor, iters: int) -> None:
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2] or logits.shape[-1] > MAX_N:
        raise ValueError(f"sinkhorn: logits must be (..., n, n) with n <= {MAX_N}, not {tuple(logits.shape)}")
    if not logits.is_floating_point():
        raise ValueError(f"sinkhorn: logits must be floating point, not {logits.dtype}")
    if not 0 <= iters <= MAX_ITERS:
        raise ValueError(f"sinkhorn: iters must be in [0, {MAX_ITERS}], not {iters}")


def _iterations(logits: Tensor, iters: int) -> Tensor:
    """The iterations written out in plain differentiable ops, in float32 (or float64) inside."""
    m = logits.to(torch.promote_types(logits.dtype, torch.float32))
    m = torch.exp(m - m.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iters):
        m = m / m.sum(-1, keepdim=True)
        m = m / m.sum(-2, keepdim=True)
    return m


def _reference(logits: Tensor, iters: int) -> Tensor:
    return sinkhorn_function(logits, iters).to(logits.dtype).contiguous()


def _check_kernels(logits: Tensor, iters: int) -> float:
    (small,) = guard.random_inputs(0, logits.device, ((4, *logits.shape[-2:]), logits.dtype))
    return guard.compare(lambda t: [torch.ops.siamesenorm.sinkhorn(t, iters)],
                         lambda t: [_reference(t, iters)], [small])


def _example(device: torch.device, dtype: torch.dtype) -> tuple:
    return guard.random_inputs(3, device, ((6, 4, 4), dtype))[0], 20


SINKHORN = guard.KernelOp("sinkhorn", _check_kernels, _example)


@torch.library.custom_op("siamesenorm::sinkhorn", mutates_args=())
def _sinkhorn(logits: Tensor, iters: int) -> Tensor:
    """The doubly stochastic matrices, contiguous, in ``logits``' dtype (float32 inside)."""
    _check(logits, iters)
    return SINKHORN.run(lambda: _kernels().sinkhorn_forward(logits, iters), lambda: _reference(logits, iters),
                        (guard.config_key(logits.shape[-1], logits, iters), (logits, iters), logits.device))


@_sinkhorn.register_fake
def _(logits, iters):
    _check(logits, iters)
    return logits.new_empty(logits.shape)


@torch.library.custom_op("siamesenorm::sinkhorn_backward", mutates_args=())
def _sinkhorn_backward(grad: Tensor, logits: Tensor, iters: int) -> Tensor:
    """The logits' gradient (in their dtype), from the output's gradient and the logits."""
    _check(logits, iters)

    def fallback() -> Tensor:
        (d,) = guard.reference_grads(lambda t: [_iterations(t, iters)], [logits], [grad])
        return d.to(logits.dtype)
    return SINKHORN.run(lambda: _kernels().sinkhorn_backward(grad, logits, iters), fallback,
                        device=logits.device)


@_sinkhorn_backward.register_fake
def _(grad, logits, iters):
    return logits.new_empty(logits.shape)


def _setup(ctx, inputs, output) -> None:
    logits, iters = inputs
    ctx.save_for_backward(logits)
    ctx.iters = iters
    ctx.set_materialize_grads(False)


def _grad(ctx, grad):
    if grad is None:
        return None, None
    (logits,) = ctx.saved_tensors
    return torch.ops.siamesenorm.sinkhorn_backward(grad.contiguous(), logits, ctx.iters), None


_sinkhorn.register_autograd(_grad, setup_context=_setup)


def sinkhorn_kernel_runs(logits: Tensor, iters: int) -> bool:
    """Whether :func:`sinkhorn` runs the kernel on ``logits``: the kernels are available for it
    (:func:`~siamesenorm.kernels.kernels_available`), it is a plain tensor of float32, bf16 or
    fp16 (float64 keeps its precision on the PyTorch path) of shape ``(..., n, n)``, ``n <= 8``,
    and ``iters <= 64``. On CUDA without Triton, says so once."""
    if not (type(logits) is Tensor and logits.dtype in _DTYPES and logits.dim() >= 2
            and logits.shape[-1] == logits.shape[-2] <= MAX_N and 0 <= iters <= MAX_ITERS):
        return False
    return SINKHORN.on and kernels_run_on(logits)


def _check_arguments(logits: Tensor, iters: int) -> None:
    arguments.tensor("sinkhorn", "logits", logits, 2)
    if logits.shape[-1] != logits.shape[-2]:
        raise ValueError(f"sinkhorn: logits must be (..., n, n), not {tuple(logits.shape)}")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 0:
        raise ValueError(f"sinkhorn: iters must be an int >= 0, not {iters!r}")


def sinkhorn(logits: Tensor, iters: int) -> Tensor:
    """``exp(logits)`` over the last two axes (``(..., n, n)``) with rows then columns rescaled to
    sum 1, ``iters`` times, and the exact gradient of those iterations: the kernel where
    :func:`sinkhorn_kernel_runs`, else :func:`siamesenorm.functional.sinkhorn.sinkhorn`."""
    _check_arguments(logits, iters)
    if sinkhorn_kernel_runs(logits, iters):
        return torch.ops.siamesenorm.sinkhorn(logits, iters)
    return sinkhorn_function(logits, iters)
