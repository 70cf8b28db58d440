"""mHC's stream mix and write as one Triton kernel each way (``siamesenorm::mix_write``)::

    H_new[j] = sum_k res[j, k] H[k] + post[j] out        (per token: H^res H + H^post^T F)

Forward reads the state, the branch output and the token's maps once and writes the new state;
backward reads the gradient, the state and the branch output once and writes the gradients of all
four (``dH = res^T g``, ``dout = sum_j post[j] g[j]``, ``dres = g H^T`` and ``dpost = g out``, the
last two summed over the width in registers). Where plain ops take a matrix product, a multiply,
an add and, backward, a product and two reductions apiece.
"""

import torch
from torch import Tensor

from ..nn.mixing import mix_and_write
from .availability import announce_fallback, kernels_available

__all__ = ["MAX_N", "mix_write", "mix_write_kernel_runs"]

MAX_N = 8            # the most streams the kernel takes (a token's n x n matrix stays in registers)
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _kernels():
    from . import _triton_mix
    return _triton_mix


def _check(res: Tensor, h: Tensor, post: Tensor, out: Tensor) -> None:
    if h.dim() < 2 or not 0 < h.shape[-2] <= MAX_N or h.shape[-1] == 0:
        raise ValueError(f"mix_write: h must be (..., n, d) with 0 < n <= {MAX_N} and d > 0, "
                         f"not {tuple(h.shape)}")
    lead, (n, d) = h.shape[:-2], h.shape[-2:]
    for name, t, shape in (("res", res, (*lead, n, n)), ("post", post, (*lead, n)), ("out", out, (*lead, d))):
        if t.shape != shape:
            raise ValueError(f"mix_write: {name} must have shape {tuple(shape)}, not {tuple(t.shape)}")
    for t in (res, h, post, out):
        if not t.is_floating_point():
            raise ValueError(f"mix_write: the inputs must be floating point, not {t.dtype}")


@torch.library.custom_op("siamesenorm::mix_write", mutates_args=())
def _mix_write(res: Tensor, h: Tensor, post: Tensor, out: Tensor, dtype: torch.dtype) -> Tensor:
    """The new state in ``dtype`` (float32 inside); the inputs of one leading shape."""
    _check(res, h, post, out)
    return _kernels().mix_write_forward(res.contiguous(), h.contiguous(), post.contiguous(),
                                        out.contiguous(), dtype)


@_mix_write.register_fake
def _(res, h, post, out, dtype):
    _check(res, h, post, out)
    return h.new_empty(h.shape, dtype=dtype)


@torch.library.custom_op("siamesenorm::mix_write_backward", mutates_args=())
def _mix_write_backward(grad: Tensor, res: Tensor, h: Tensor, post: Tensor,
                        out: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dres, dh, dpost, dout)``, each in its input's dtype."""
    return _kernels().mix_write_backward(grad.contiguous(), res.contiguous(), h.contiguous(),
                                         post.contiguous(), out.contiguous())


@_mix_write_backward.register_fake
def _(grad, res, h, post, out):
    return tuple(t.new_empty(t.shape) for t in (res, h, post, out))


def _setup(ctx, inputs, output) -> None:
    res, h, post, out, _ = inputs
    ctx.save_for_backward(res, h, post, out)
    ctx.set_materialize_grads(False)


def _grad(ctx, grad):
    if grad is None:
        return None, None, None, None, None
    grads = torch.ops.siamesenorm.mix_write_backward(grad, *ctx.saved_tensors)
    return (*(g if need else None for g, need in zip(grads, ctx.needs_input_grad)), None)


_mix_write.register_autograd(_grad, setup_context=_setup)


def mix_write_kernel_runs(res: Tensor, h: Tensor, post: Tensor, out: Tensor) -> bool:
    """Whether :func:`mix_write` runs the kernel: the kernels are available for ``h``
    (:func:`~siamesenorm.kernels.kernels_available`), all four are plain tensors of float32, bf16
    or fp16 (float64 keeps its precision on the PyTorch path), ``h`` is ``(..., n, d)`` with
    ``n <= 8`` and ``d > 0``. On CUDA without Triton, says so once."""
    ts = (res, h, post, out)
    if not (all(type(t) is Tensor and t.dtype in _DTYPES for t in ts) and h.dim() >= 2
            and 0 < h.shape[-2] <= MAX_N and h.shape[-1] > 0):
        return False
    if kernels_available(h):
        return True
    if h.is_cuda and not torch.compiler.is_compiling():
        announce_fallback()
    return False


def mix_write(res: Tensor, h: Tensor, post: Tensor, out: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``res @ h + post[..., None] * out[..., None, :]`` per token: ``res`` (..., n, n), ``h``
    (..., n, d), ``post`` (..., n), ``out`` (..., d), leading shapes broadcast; the result in
    ``dtype`` (default: the four's promoted dtype). The kernel where :func:`mix_write_kernel_runs`,
    else :func:`siamesenorm.nn.mixing.mix_and_write` (one autograd node)."""
    if dtype is None:
        dtype = torch.promote_types(torch.promote_types(res.dtype, h.dtype),
                                    torch.promote_types(post.dtype, out.dtype))
    lead = torch.broadcast_shapes(res.shape[:-2], h.shape[:-2], post.shape[:-1], out.shape[:-1])
    res, h, post, out = (t if t.shape[:t.dim() - k] == lead else t.expand(*lead, *t.shape[t.dim() - k:])
                         for t, k in ((res, 2), (h, 2), (post, 1), (out, 1)))
    if mix_write_kernel_runs(res, h, post, out):
        return torch.ops.siamesenorm.mix_write(res, h, post, out, dtype)
    return mix_and_write(res.transpose(-1, -2), h, post, out).to(dtype)
