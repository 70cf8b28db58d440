"""mHC's per-token stream work (arXiv 2512.24880) as one Triton kernel each way, twice: the stream
mix and write (``siamesenorm::mix_write``) and the entry (``siamesenorm::mix_entry``)::

    H_new[j] = sum_k res[j, k] H[k] + post[j] out        (per token: H^res H + H^post^T F)
    b        = norm(sum_k pre[k] H[k])                   (the branch input: LN(H^pre H))

Each reads the state once each way; the entry keeps only the norm's row statistics.
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from ..functional.mixing import mix_and_write
from . import arguments, guard
from .availability import kernels_run_on

__all__ = ["MAX_N", "mix_entry", "mix_entry_kernel_runs", "mix_write", "mix_write_kernel_runs"]

MAX_N = 8            # the most streams the kernel takes (a token's n x n matrix stays in registers)
MAX_WIDTH = 65536    # the entry's row is one Triton block; wider rows take the PyTorch path
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_KINDS = ("rmsnorm", "layernorm")


def _kernels():
    from . import _triton_mix
    return _triton_mix


def _entry_kernels():
    from . import _triton_mix_entry
    return _triton_mix_entry


def _check(res: Tensor, h: Tensor, post: Tensor, out: Tensor, lead: bool = True, limit: bool = True) -> None:
    """The four's dtypes and shapes; ``lead``: their leading shapes too (else only the trailing
    ones: the front broadcasts them after); ``limit``: at most ``MAX_N`` streams (the kernel's)."""
    for name, t, dims in (("res", res, 2), ("h", h, 2), ("post", post, 1), ("out", out, 1)):
        arguments.tensor("mix_write", name, t, dims)
    n, d = h.shape[-2:]
    if not 0 < n <= (MAX_N if limit else n) or d == 0:
        raise ValueError(f"mix_write: h must be (..., n, d) with 0 < n{f' <= {MAX_N}' if limit else ''} and "
                         f"d > 0, not {tuple(h.shape)}")
    first = h.shape[:-2] if lead else ()
    for name, t, shape in (("res", res, (*first, n, n)), ("post", post, (*first, n)),
                           ("out", out, (*first, d))):
        if (t.shape if lead else t.shape[t.dim() - len(shape):]) != shape:
            want = str(tuple(shape)) if lead else "(..., " + ", ".join(map(str, shape)) + ")"
            raise ValueError(f"mix_write: {name} must have shape {want}, not {tuple(t.shape)}")


def _broadcast(op: str, *pairs: tuple[Tensor, int]) -> list[Tensor]:
    """The tensors expanded to one leading shape (each keeps its last ``k`` dimensions)."""
    try:
        lead = torch.broadcast_shapes(*(t.shape[:t.dim() - k] for t, k in pairs))
    except RuntimeError:
        raise ValueError(f"{op}: the leading shapes do not broadcast: "
                         f"{[tuple(t.shape[:t.dim() - k]) for t, k in pairs]}") from None
    return [t if t.shape[:t.dim() - k] == lead else t.expand(*lead, *t.shape[t.dim() - k:]) for t, k in pairs]


def _write_plain(res: Tensor, h: Tensor, post: Tensor, out: Tensor) -> list[Tensor]:
    """``res @ h + post (x) out`` in plain differentiable ops (for ``torch.func``), promoted dtype."""
    dtype = torch.promote_types(torch.promote_types(res.dtype, h.dtype), torch.promote_types(post.dtype,
                                                                                          out.dtype))
    res, h, post, out = (t.to(dtype) for t in (res, h, post, out))
    return [res @ h + post.unsqueeze(-1) * out.unsqueeze(-2)]


def _write_reference(res: Tensor, h: Tensor, post: Tensor, out: Tensor, dtype: torch.dtype) -> Tensor:
    return mix_and_write(res.transpose(-1, -2), h, post, out).to(dtype)


def _write_check(res: Tensor, h: Tensor, post: Tensor, out: Tensor, dtype: torch.dtype) -> float:
    n, d = h.shape[-2:]
    args = guard.random_inputs(0, h.device, ((4, n, n), res.dtype), ((4, n, d), h.dtype),
                               ((4, n), post.dtype), ((4, d), out.dtype))
    return guard.compare(lambda *a: [torch.ops.siamesenorm.mix_write(*a, dtype)],
                         lambda *a: [_write_reference(*a, dtype)], args, guard.tolerance(args, dtype))


def _write_example(device: torch.device, dtype: torch.dtype) -> tuple:
    return (*guard.random_inputs(4, device, ((3, 4, 4), dtype), ((3, 4, 96), dtype), ((3, 4), dtype),
                                 ((3, 96), dtype)), dtype)


MIX_WRITE = guard.KernelOp("mix_write", _write_check, _write_example)


@torch.library.custom_op("siamesenorm::mix_write", mutates_args=())
def _mix_write(res: Tensor, h: Tensor, post: Tensor, out: Tensor, dtype: torch.dtype) -> Tensor:
    """The new state in ``dtype`` (float32 inside); the inputs of one leading shape."""
    _check(res, h, post, out)
    return MIX_WRITE.run(
        lambda: _kernels().mix_write_forward(res.contiguous(), h.contiguous(), post.contiguous(),
                                             out.contiguous(), dtype),
        lambda: _write_reference(res, h, post, out, dtype).contiguous(),
        (guard.config_key(h.shape[-1], h.shape[-2], res, h, post, out, dtype), (res, h, post, out, dtype),
         h.device))


@_mix_write.register_fake
def _(res, h, post, out, dtype):
    _check(res, h, post, out)
    return h.new_empty(h.shape, dtype=dtype)


@torch.library.custom_op("siamesenorm::mix_write_backward", mutates_args=())
def _mix_write_backward(grad: Tensor, res: Tensor, h: Tensor, post: Tensor,
                        out: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dres, dh, dpost, dout)``, each in its input's dtype."""
    def fallback():
        inputs = [res, h, post, out]
        grads = guard.reference_grads(_write_plain, inputs, [grad])
        return tuple(g.to(t.dtype) for g, t in zip(grads, inputs))
    tensors = (grad, res, h, post, out)
    return MIX_WRITE.run(lambda: _kernels().mix_write_backward(*(t.contiguous() for t in tensors)), fallback,
                         device=h.device)


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
    return MIX_WRITE.on and kernels_run_on(h)


def mix_write(res: Tensor, h: Tensor, post: Tensor, out: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """``res @ h + post[..., None] * out[..., None, :]`` per token: ``res`` (..., n, n), ``h``
    (..., n, d), ``post`` (..., n), ``out`` (..., d), leading shapes broadcast; the result in
    ``dtype`` (default: the four's promoted dtype). The kernel where :func:`mix_write_kernel_runs`,
    else :func:`siamesenorm.functional.mixing.mix_and_write` (one autograd node)."""
    _check(res, h, post, out, lead=False, limit=False)
    arguments.floating_dtype("mix_write", "dtype", dtype)
    if dtype is None:
        dtype = torch.promote_types(torch.promote_types(res.dtype, h.dtype),
                                    torch.promote_types(post.dtype, out.dtype))
    res, h, post, out = _broadcast("mix_write", (res, 2), (h, 2), (post, 1), (out, 1))
    if mix_write_kernel_runs(res, h, post, out):
        return torch.ops.siamesenorm.mix_write(res, h, post, out, dtype)
    return _write_reference(res, h, post, out, dtype)


# ---- b = norm(sum_k pre_k H_k) -----------------------------------------------------------------------
def _check_entry(h: Tensor, pre: Tensor, weight: Tensor | None, bias: Tensor | None, kind: str,
                 lead: bool = True, limit: bool = True) -> None:
    """As :func:`_check` for :func:`mix_entry`'s arguments, and the norm's ``kind``, weight and bias."""
    if kind not in _KINDS:
        raise ValueError(f"mix_entry: norm kind must be one of {_KINDS}, not {kind!r}")
    if kind == "rmsnorm" and bias is not None:
        raise ValueError("mix_entry: RMSNorm has no bias")
    arguments.tensor("mix_entry", "h", h, 2)
    arguments.tensor("mix_entry", "pre", pre, 1)
    n, d = h.shape[-2:]
    if not (0 < n <= (MAX_N if limit else n) and 0 < d <= (MAX_WIDTH if limit else d)):
        bounds = f"0 < n <= {MAX_N} and 0 < d <= {MAX_WIDTH}" if limit else "n > 0 and d > 0"
        raise ValueError(f"mix_entry: h must be (..., n, d) with {bounds}, not {tuple(h.shape)}")
    if (pre.shape if lead else pre.shape[-1:]) != (h.shape[:-1] if lead else (n,)):
        want = tuple(h.shape[:-1]) if lead else f"(..., {n})"
        raise ValueError(f"mix_entry: pre must have shape {want}, not {tuple(pre.shape)}")
    arguments.param("mix_entry", "weight", weight, d)
    arguments.param("mix_entry", "bias", bias, d)


def _entry_reference(h: Tensor, pre: Tensor, weight: Tensor | None, bias: Tensor | None, kind: str,
                     eps: float, dtype: torch.dtype) -> Tensor:
    u = (pre.unsqueeze(-1) * h).sum(-2)
    d = (u.shape[-1],)
    out = F.layer_norm(u, d, weight, bias, eps) if kind == "layernorm" else F.rms_norm(u, d, weight, eps)
    return out.to(dtype)


def _entry_check(h: Tensor, pre: Tensor, weight: Tensor | None, bias: Tensor | None, kind: str, eps: float,
                 dtype: torch.dtype) -> float:
    n, d = h.shape[-2:]
    args = guard.random_inputs(0, h.device, ((4, n, d), h.dtype), ((4, n), pre.dtype),
                               None if weight is None else ((d,), weight.dtype),
                               None if bias is None else ((d,), bias.dtype))
    if args[2] is not None:
        args[2] = 1 + 0.1 * args[2]
    return guard.compare(lambda *a: [torch.ops.siamesenorm.mix_entry(*a, kind, eps, dtype)[0]],
                         lambda *a: [_entry_reference(*a, kind, eps, dtype)], args,
                         guard.tolerance(args, dtype))


def _entry_example(device: torch.device, dtype: torch.dtype) -> tuple:
    h, pre, w = guard.random_inputs(5, device, ((3, 4, 96), dtype), ((3, 4), dtype), ((96,), dtype))
    return h, pre, w, None, "rmsnorm", 1e-6, dtype


MIX_ENTRY = guard.KernelOp("mix_entry", _entry_check, _entry_example)


@torch.library.custom_op("siamesenorm::mix_entry", mutates_args=())
def _mix_entry(h: Tensor, pre: Tensor, weight: Tensor | None, bias: Tensor | None, kind: str, eps: float,
               dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(b, stats)``: the branch input in ``dtype`` and ``(2, tokens)`` float32 row statistics
    (mean, 0 for RMSNorm, and rstd; zeros on the PyTorch path, whose backward does not read them)."""
    _check_entry(h, pre, weight, bias, kind)
    params = [None if p is None else p.contiguous() for p in (weight, bias)]     # one stride
    return MIX_ENTRY.run(
        lambda: _entry_kernels().mix_entry_forward(h.contiguous(), pre.contiguous(), *params,
                                                   kind == "layernorm", eps, dtype),
        lambda: (_entry_reference(h, pre, weight, bias, kind, eps, dtype).contiguous(),
                 h.new_zeros((2, pre.numel() // pre.shape[-1]), dtype=torch.float32)),
        (guard.config_key(h.shape[-1], h.shape[-2], h, pre, weight, bias, kind, dtype),
         (h, pre, weight, bias, kind, eps, dtype), h.device))


@_mix_entry.register_fake
def _(h, pre, weight, bias, kind, eps, dtype):
    _check_entry(h, pre, weight, bias, kind)
    return (h.new_empty((*h.shape[:-2], h.shape[-1]), dtype=dtype),
            h.new_empty((2, pre.numel() // pre.shape[-1]), dtype=torch.float32))


@torch.library.custom_op("siamesenorm::mix_entry_backward", mutates_args=())
def _mix_entry_backward(grad: Tensor, h: Tensor, pre: Tensor, weight: Tensor | None, bias: Tensor | None,
                        stats: Tensor, kind: str, eps: float, need_w: bool,
                        need_b: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(dh, dpre, dw, db)`` in their inputs' dtypes (``dw``, ``db`` empty where not computed)."""
    params = [None if p is None else p.contiguous() for p in (weight, bias)]

    def fallback():
        dh, dpre, dw, db = guard.reference_grads(
            lambda *a: [_entry_reference(*a, kind, eps, grad.dtype)], [h, pre, weight, bias], [grad])

        def param(g: Tensor | None, p: Tensor | None, need: bool) -> Tensor:
            return g.to(p.dtype) if p is not None and need else h.new_empty(0, dtype=torch.float32)
        return dh.to(h.dtype), dpre.to(pre.dtype), param(dw, weight, need_w), param(db, bias, need_b)
    return MIX_ENTRY.run(
        lambda: _entry_kernels().mix_entry_backward(grad.contiguous(), h.contiguous(), pre.contiguous(),
                                                    *params, stats, kind == "layernorm", need_w, need_b),
        fallback, device=h.device)


@_mix_entry_backward.register_fake
def _(grad, h, pre, weight, bias, stats, kind, eps, need_w, need_b):
    def param_grad(p: Tensor | None, need: bool) -> Tensor:
        return torch.empty_like(p) if p is not None and need else h.new_empty(0, dtype=torch.float32)

    return torch.empty_like(h), torch.empty_like(pre), param_grad(weight, need_w), param_grad(bias, need_b)


def _entry_setup(ctx, inputs, output) -> None:
    h, pre, weight, bias, kind, eps, _ = inputs
    ctx.save_for_backward(h, pre, weight, bias, output[1])
    ctx.kind, ctx.eps = kind, eps
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _entry_grad(ctx, grad, _stats):
    if grad is None:
        return (None,) * 7
    h, pre, weight, bias, stats = ctx.saved_tensors
    need = ctx.needs_input_grad
    dh, dpre, dw, db = torch.ops.siamesenorm.mix_entry_backward(
        grad, h, pre, weight, bias, stats, ctx.kind, ctx.eps, need[2], need[3])
    return (dh if need[0] else None, dpre if need[1] else None,
            dw if weight is not None and need[2] else None, db if bias is not None and need[3] else None,
            None, None, None)


_mix_entry.register_autograd(_entry_grad, setup_context=_entry_setup)


def mix_entry_kernel_runs(h: Tensor, pre: Tensor, kind: str) -> bool:
    """Whether :func:`mix_entry` runs the kernel: as :func:`mix_write_kernel_runs` for ``h`` and
    ``pre``, with RMSNorm or LayerNorm (``kind``) and a width up to 65536."""
    if not (kind in _KINDS and all(type(t) is Tensor and t.dtype in _DTYPES for t in (h, pre))
            and h.dim() >= 2 and 0 < h.shape[-2] <= MAX_N and 0 < h.shape[-1] <= MAX_WIDTH):
        return False
    return MIX_ENTRY.on and kernels_run_on(h)


def mix_entry(h: Tensor, pre: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, *,
              kind: str = "rmsnorm", eps: float = 1e-6, dtype: torch.dtype | None = None) -> Tensor:
    """``norm(sum_k pre[..., k] h[..., k, :])``: ``h`` (..., n, d), ``pre`` (..., n), leading shapes
    broadcast; ``kind`` ``"rmsnorm"`` (weight optional) or ``"layernorm"`` (weight and bias
    optional); the result in ``dtype`` (default: ``h``'s and ``pre``'s promoted dtype). The kernel
    (float32 inside, the sum never stored) where :func:`mix_entry_kernel_runs`, else PyTorch ops."""
    _check_entry(h, pre, weight, bias, kind, lead=False, limit=False)
    arguments.eps("mix_entry", "eps", eps)
    arguments.floating_dtype("mix_entry", "dtype", dtype)
    if dtype is None:
        dtype = torch.promote_types(h.dtype, pre.dtype)
    h, pre = _broadcast("mix_entry", (h, 2), (pre, 1))
    if mix_entry_kernel_runs(h, pre, kind) and arguments.kernel_dtypes(weight, bias):
        return torch.ops.siamesenorm.mix_entry(h, pre, weight, bias, kind, float(eps), dtype)[0]
    return _entry_reference(h, pre, weight, bias, kind, eps, dtype)
