"""AttnRes's depth mix (arXiv 2603.15031) as one Triton kernel each way (``siamesenorm::depth_mix``)::

    x = sum_j softmax_j(u . RMSNorm(v_j)) v_j;   out = norm(x)   (optional RMSNorm or LayerNorm)

with ``u = key_gain * query``. Keeps only the sources, ``u`` and the norm's row statistics. Up to
32 sources and a width of 65536; beyond, and for float64, the PyTorch path runs.
"""

import torch
from torch import Tensor
from torch.nn import Parameter

from . import arguments, guard
from .availability import kernels_run_on

__all__ = ["MAX_SOURCES", "MAX_WIDTH", "depth_mix_kernel_runs", "fused_depth_mix"]

MAX_SOURCES = 32      # each count of sources compiles a kernel of its own
MAX_WIDTH = 65536     # a row is one Triton block; wider rows take the PyTorch path
_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_KINDS = ("none", "rmsnorm", "layernorm")


def _kernels():
    from . import _triton_depth_mix
    return _triton_depth_mix


def _check(sources: list[Tensor], u: Tensor, weight: Tensor | None, bias: Tensor | None, kind: str,
           limit: bool = True) -> None:
    """The arguments' types and shapes; ``limit``: the kernel's (at most ``MAX_SOURCES`` sources
    and a width of ``MAX_WIDTH``) too."""
    most = MAX_SOURCES if limit else float("inf")
    if not isinstance(sources, (list, tuple)) or not 0 < len(sources) <= most:
        count = len(sources) if isinstance(sources, (list, tuple)) else type(sources).__name__
        allowed = f"1 to {MAX_SOURCES}" if limit else "one or more"
        raise ValueError(f"depth_mix: {allowed} sources, not {count}")
    for i, v in enumerate(sources):
        arguments.tensor("depth_mix", f"sources[{i}]", v)
    shape = sources[0].shape
    if not 0 < shape[-1] <= (MAX_WIDTH if limit else shape[-1]):
        bound = f"0 < d <= {MAX_WIDTH}" if limit else "d > 0"
        raise ValueError(f"depth_mix: sources must be (..., d) with {bound}, not {tuple(shape)}")
    if any(v.shape != shape for v in sources):
        raise ValueError(f"depth_mix: the sources differ in shape: {[tuple(v.shape) for v in sources]}")
    arguments.tensor("depth_mix", "u", u)
    for name, t in (("u", u), ("weight", weight), ("bias", bias)):
        arguments.param("depth_mix", name, t, shape[-1])
    if kind not in _KINDS:
        raise ValueError(f"depth_mix: norm kind must be one of {_KINDS}, not {kind!r}")
    if kind != "layernorm" and bias is not None or kind == "none" and weight is not None:
        raise ValueError(f"depth_mix: norm kind {kind!r} takes no {'bias' if bias is not None else 'weight'}")


def _one_stride(*params: Tensor | None) -> list[Tensor | None]:
    return [None if p is None else p.contiguous() for p in params]


def _stats_shape(sources: list[Tensor], kind: str) -> tuple[int, ...]:
    return (0,) if kind == "none" else (2, sources[0].numel() // sources[0].shape[-1])


def _reference(sources: list[Tensor], u: Tensor, weight: Tensor | None, bias: Tensor | None, kind: str,
               eps: float, norm_eps: float, dtype: torch.dtype) -> Tensor:
    """The mix and its norm by PyTorch ops, in float32 inside."""
    values = torch.stack(sources).float()
    keys = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps)
    x = torch.einsum("n...,n...d->...d", (keys @ u.float()).softmax(0), values)
    d = (x.shape[-1],)
    weight, bias = (None if p is None else p.float() for p in (weight, bias))
    if kind == "layernorm":
        x = torch.nn.functional.layer_norm(x, d, weight, bias, norm_eps)
    elif kind == "rmsnorm":
        x = torch.nn.functional.rms_norm(x, d, weight, norm_eps)
    return x.to(dtype)


def _check_kernels(sources: list[Tensor], u: Tensor, weight: Tensor | None, bias: Tensor | None, kind: str,
                   eps: float, norm_eps: float, dtype: torch.dtype) -> float:
    d = u.shape[-1]
    small = guard.random_inputs(0, u.device, *(((4, d), v.dtype) for v in sources), ((d,), u.dtype),
                                None if weight is None else ((d,), weight.dtype),
                                None if bias is None else ((d,), bias.dtype))
    n = len(sources)
    args = [small[:n], *small[n:]]
    if args[2] is not None:
        args[2] = 1 + 0.1 * args[2]
    return guard.compare(lambda *a: torch.ops.siamesenorm.depth_mix(*a, kind, eps, norm_eps, dtype)[:1],
                         lambda *a: [_reference(*a, kind, eps, norm_eps, dtype)], args,
                         guard.tolerance(args, dtype))


def _example(device: torch.device, dtype: torch.dtype) -> tuple:
    *sources, u, w = guard.random_inputs(7, device, *[((5, 96), dtype)] * 3, ((96,), dtype), ((96,), dtype))
    return sources, u, w, None, "rmsnorm", 1e-6, 1e-6, dtype


DEPTH_MIX = guard.KernelOp("depth_mix", _check_kernels, _example)


@torch.library.custom_op("siamesenorm::depth_mix", mutates_args=())
def _depth_mix(sources: list[Tensor], u: Tensor, weight: Tensor | None, bias: Tensor | None, kind: str,
               eps: float, norm_eps: float, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(out, stats)``: ``out`` in ``dtype`` (float32 inside), ``stats`` the norm's ``(2, tokens)``
    float32 mean (0 for RMSNorm) and rstd, empty without a norm (zeros on the PyTorch path, whose
    backward does not read them). ``eps``: the key norm's."""
    _check(sources, u, weight, bias, kind)
    return DEPTH_MIX.run(
        lambda: _kernels().depth_mix_forward([v.contiguous() for v in sources], u.contiguous(),
                                             *_one_stride(weight, bias), kind, eps, norm_eps, dtype),
        lambda: (_reference(sources, u, weight, bias, kind, eps, norm_eps, dtype).contiguous(),
                 u.new_zeros(_stats_shape(sources, kind), dtype=torch.float32)),
        (guard.config_key(u.shape[-1], sources, u, weight, bias, kind, dtype),
         (sources, u, weight, bias, kind, eps, norm_eps, dtype), u.device))


@_depth_mix.register_fake
def _(sources, u, weight, bias, kind, eps, norm_eps, dtype):
    _check(sources, u, weight, bias, kind)
    return (sources[0].new_empty(sources[0].shape, dtype=dtype),
            u.new_empty(_stats_shape(sources, kind), dtype=torch.float32))


@torch.library.custom_op("siamesenorm::depth_mix_backward", mutates_args=())
def _depth_mix_backward(grad: Tensor, sources: list[Tensor], u: Tensor, weight: Tensor | None,
                        bias: Tensor | None, stats: Tensor, kind: str, eps: float, norm_eps: float,
                        need_w: bool, need_b: bool) -> list[Tensor]:
    """``[dv_0, ..., dv_{n-1}, du, dw, db]`` in their inputs' dtypes (``dw``, ``db`` empty where not
    computed)."""
    n = len(sources)

    def fallback() -> list[Tensor]:
        *dv, du, dw, db = guard.reference_grads(
            lambda *a: [_reference(list(a[:n]), *a[n:], kind, eps, norm_eps, grad.dtype)],
            [*sources, u, weight, bias], [grad])

        def param(g: Tensor | None, p: Tensor | None, need: bool) -> Tensor:
            return g.to(p.dtype) if p is not None and need else u.new_empty(0, dtype=torch.float32)
        return [*(g.to(v.dtype) for g, v in zip(dv, sources)), du.to(u.dtype), param(dw, weight, need_w),
                param(db, bias, need_b)]
    return DEPTH_MIX.run(
        lambda: _kernels().depth_mix_backward(grad.contiguous(), [v.contiguous() for v in sources],
                                              u.contiguous(), *_one_stride(weight, bias), stats, kind, eps,
                                              need_w, need_b),
        fallback, device=u.device)


@_depth_mix_backward.register_fake
def _(grad, sources, u, weight, bias, stats, kind, eps, norm_eps, need_w, need_b):
    def param_grad(p: Tensor | None, need: bool) -> Tensor:
        return torch.empty_like(p) if p is not None and need else u.new_empty(0, dtype=torch.float32)

    return [*(torch.empty_like(v) for v in sources), torch.empty_like(u), param_grad(weight, need_w),
            param_grad(bias, need_b)]


def _setup(ctx, inputs, output) -> None:
    sources, u, weight, bias, kind, eps, norm_eps, _ = inputs
    ctx.save_for_backward(u, weight, bias, output[1], *sources)
    ctx.kind, ctx.eps, ctx.norm_eps = kind, eps, norm_eps
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _grad(ctx, grad, _stats):
    if grad is None:
        return (None,) * 8
    u, weight, bias, stats, *sources = ctx.saved_tensors
    need = ctx.needs_input_grad
    *dsources, du, dw, db = torch.ops.siamesenorm.depth_mix_backward(
        grad, sources, u, weight, bias, stats, ctx.kind, ctx.eps, ctx.norm_eps, bool(need[2]), bool(need[3]))
    return (dsources, du if need[1] else None, dw if weight is not None and need[2] else None,
            db if bias is not None and need[3] else None, None, None, None, None)


_depth_mix.register_autograd(_grad, setup_context=_setup)


def depth_mix_kernel_runs(sources: tuple[Tensor, ...], u: Tensor, kind: str) -> bool:
    """Whether :func:`fused_depth_mix` runs the kernel: the kernels are available for the sources
    (:func:`~siamesenorm.kernels.kernels_available`), all are plain tensors (``u`` may be a
    parameter; DTensors are not) of float32, bf16 or fp16 of one shape ``(..., d)`` with
    ``0 < d <= 65536``, 1 to 32 of them, and the norm ``kind`` is ``"none"``, ``"rmsnorm"`` or
    ``"layernorm"``. On CUDA without Triton, says so once."""
    first = sources[0] if sources else None
    if not (kind in _KINDS and first is not None and 0 < len(sources) <= MAX_SOURCES and first.dim() >= 1
            and 0 < first.shape[-1] <= MAX_WIDTH and type(u) in (Tensor, Parameter) and u.dtype in _DTYPES
            and all(type(v) is Tensor and v.dtype in _DTYPES and v.shape == first.shape for v in sources)):
        return False
    return DEPTH_MIX.on and kernels_run_on(first)


def fused_depth_mix(sources: tuple[Tensor, ...], u: Tensor, weight: Tensor | None = None,
                    bias: Tensor | None = None, *, kind: str = "none", eps: float = 1e-6,
                    norm_eps: float = 1e-6, dtype: torch.dtype | None = None) -> Tensor:
    """``norm(sum_j softmax_j(u . v_j / rms(v_j)) v_j)`` over the sources ``v_j`` (``rms`` with
    ``eps``; ``kind`` the norm, ``"none"`` for none, with ``norm_eps``), in ``dtype`` (default: the
    sources' promoted dtype): the kernel where :func:`depth_mix_kernel_runs`, else plain ops."""
    _check(sources, u, weight, bias, kind, limit=False)
    arguments.eps("depth_mix", "eps", eps)
    arguments.eps("depth_mix", "norm_eps", norm_eps)
    arguments.floating_dtype("depth_mix", "dtype", dtype)
    if dtype is None:
        dtype = sources[0].dtype
        for v in sources[1:]:
            dtype = torch.promote_types(dtype, v.dtype)
    if depth_mix_kernel_runs(sources, u, kind) and arguments.kernel_dtypes(weight, bias):
        return torch.ops.siamesenorm.depth_mix(list(sources), u, weight, bias, kind, float(eps),
                                               float(norm_eps), dtype)[0]
    return _reference(list(sources), u, weight, bias, kind, eps, norm_eps, dtype)
