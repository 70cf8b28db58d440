"""The RMS-normalised projection ``z = rstd(x) (x @ w)`` as one Triton kernel each way
(``siamesenorm::rms_project``): mHC's maps (arXiv 2512.24880) project ``RMSNorm(vec H) phi``.
``x`` is read once forward and its normalised copy never written; ``w`` has up to 256 columns.
"""

import torch
from torch import Tensor
from torch.nn import Parameter

from . import arguments, guard
from .availability import kernels_run_on

__all__ = ["MAX_COLUMNS", "rms_project", "rms_project_kernel_runs"]

MAX_COLUMNS = 256     # a block of rows keeps its (rows x columns) product in registers
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernels():
    from . import _triton_rms_project
    return _triton_rms_project


def _check(x: Tensor, w: Tensor) -> None:
    if x.dim() < 1 or w.dim() != 2 or w.shape[0] != x.shape[-1] or not 0 < w.shape[1] <= MAX_COLUMNS:
        raise ValueError(f"rms_project: x must be (..., K) and w (K, M) with 0 < M <= {MAX_COLUMNS}, "
                         f"not {tuple(x.shape)} and {tuple(w.shape)}")


def _reference(x: Tensor, w: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """``(z, rstd)`` by PyTorch ops in float32 (the product exact)."""
    x32 = x.float()
    rstd = torch.rsqrt(x32.square().mean(-1) + eps)
    return (x32 @ w.float()) * rstd.unsqueeze(-1), rstd


def _check_kernels(x: Tensor, w: Tensor, eps: float, tf32: bool) -> float:
    args = guard.random_inputs(0, x.device, ((4, x.shape[-1]), x.dtype), (tuple(w.shape), w.dtype))
    return guard.compare(lambda *a: torch.ops.siamesenorm.rms_project(*a, eps, tf32)[:1],
                         lambda *a: _reference(*a, eps)[:1], args,
                         max(guard.tolerance(args), 1e-2 if tf32 else 0))


def _example(device: torch.device, dtype: torch.dtype) -> tuple:
    return (*guard.random_inputs(6, device, ((5, 4 * 96), dtype), ((4 * 96, 24), dtype)), 1e-6,
            dtype != torch.float32)


RMS_PROJECT = guard.KernelOp("rms_project", _check_kernels, _example)


@torch.library.custom_op("siamesenorm::rms_project", mutates_args=())
def _rms_project(x: Tensor, w: Tensor, eps: float, tf32: bool) -> tuple[Tensor, Tensor]:
    """``(z, rstd)`` in float32, ``(..., M)`` and ``(...)``; the product in TF32 or exact float32."""
    _check(x, w)

    def kernel() -> tuple[Tensor, Tensor]:
        z, rstd = _kernels().rms_project_forward(x.reshape(-1, x.shape[-1]).contiguous(), w.contiguous(),
                                                 eps, tf32)
        return z.reshape(*x.shape[:-1], w.shape[1]), rstd.reshape(x.shape[:-1])
    return RMS_PROJECT.run(kernel, lambda: _reference(x, w, eps),
                           (guard.config_key(x.shape[-1], w.shape[1], x, w, tf32), (x, w, eps, tf32),
                            x.device))


@_rms_project.register_fake
def _(x, w, eps, tf32):
    _check(x, w)
    return (x.new_empty((*x.shape[:-1], w.shape[1]), dtype=torch.float32),
            x.new_empty(x.shape[:-1], dtype=torch.float32))


@torch.library.custom_op("siamesenorm::rms_project_backward", mutates_args=())
def _rms_project_backward(dz: Tensor, x: Tensor, w: Tensor, z: Tensor, rstd: Tensor, eps: float, tf32: bool,
                          need_x: bool, need_w: bool) -> tuple[Tensor, Tensor]:
    """``(dx, dw)`` in ``x``'s and ``w``'s dtypes, each empty where not asked for (``dw`` then
    float32, as :mod:`._triton`'s absent partial sums)."""
    k, m = w.shape

    def kernel() -> tuple[Tensor, Tensor]:
        dx, dw = _kernels().rms_project_backward(
            dz.reshape(-1, m).contiguous(), x.reshape(-1, k).contiguous(), w.contiguous(),
            z.reshape(-1, m).contiguous(), rstd.reshape(-1), tf32, need_x, need_w)
        return dx.reshape(x.shape) if need_x else dx, dw

    def fallback() -> tuple[Tensor, Tensor]:
        dx, dw = guard.reference_grads(lambda x, w: _reference(x, w, eps)[:1], [x, w], [dz])
        return (dx.to(x.dtype) if need_x else x.new_empty(0),
                dw.to(w.dtype) if need_w else w.new_empty(0, dtype=torch.float32))
    return RMS_PROJECT.run(kernel, fallback, device=x.device)


@_rms_project_backward.register_fake
def _(dz, x, w, z, rstd, eps, tf32, need_x, need_w):
    return (torch.empty_like(x) if need_x else x.new_empty(0),
            torch.empty_like(w) if need_w else w.new_empty(0, dtype=torch.float32))


def _setup(ctx, inputs, output) -> None:
    x, w, eps, tf32 = inputs
    ctx.save_for_backward(x, w, *output)
    ctx.eps, ctx.tf32 = eps, tf32
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _grad(ctx, dz, _rstd):
    if dz is None:
        return None, None, None, None
    x, w, z, rstd = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[:2]
    dx, dw = torch.ops.siamesenorm.rms_project_backward(dz, x, w, z, rstd, ctx.eps, ctx.tf32, bool(need_x),
                                                        bool(need_w))
    return dx if need_x else None, dw if need_w else None, None, None


_rms_project.register_autograd(_grad, setup_context=_setup)


def rms_project_kernel_runs(x: Tensor, w: Tensor) -> bool:
    """Whether :func:`rms_project` runs the kernel: the kernels are available for ``x``
    (:func:`~siamesenorm.kernels.kernels_available`), ``x`` is a plain tensor and ``w`` a plain
    tensor or parameter (DTensors are not), both float32, bf16 or fp16, ``x`` ``(..., K)`` and
    ``w`` ``(K, M)`` with ``0 < M <= 256``. On CUDA without Triton, says so once."""
    if not (type(x) is Tensor and type(w) in (Tensor, Parameter) and x.dtype in _DTYPES and w.dtype in _DTYPES
            and x.dim() >= 1 and w.dim() == 2 and w.shape[0] == x.shape[-1] > 0
            and 0 < w.shape[1] <= MAX_COLUMNS):
        return False
    return RMS_PROJECT.on and kernels_run_on(x)


def rms_project(x: Tensor, w: Tensor, eps: float, dot: torch.dtype | None = None) -> Tensor:
    """``rstd(x) (x @ w)`` over the last axis of ``x``, in float32 (float64 for float64 inputs).
    ``dot``: the dtype plain ops would take the product in (default: the inputs' promoted dtype;
    pass autocast's under autocast, whose casts a custom op does not see). The kernel where
    :func:`rms_project_kernel_runs`, in float32 inside, its product exact for ``dot`` float32 and
    in TF32 (more precise than bf16 or fp16) otherwise; else plain ops."""
    arguments.tensor("rms_project", "x", x)
    arguments.tensor("rms_project", "w", w, 2)
    if w.dim() != 2 or w.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_project: w must be ({x.shape[-1]}, M) for x of shape {tuple(x.shape)}, "
                         f"not {tuple(w.shape)}")
    arguments.eps("rms_project", "eps", eps)
    arguments.floating_dtype("rms_project", "dot", dot)
    if dot is None:
        dot = torch.promote_types(x.dtype, w.dtype)
    if rms_project_kernel_runs(x, w) and dot != torch.float64:
        return torch.ops.siamesenorm.rms_project(x, w, float(eps), dot != torch.float32)[0]
    work = torch.promote_types(x.dtype, torch.float32)
    rstd = torch.rsqrt(x.to(work).square().mean(-1, keepdim=True) + eps)
    return (x.to(dot) @ w.to(dot)).to(work) * rstd
