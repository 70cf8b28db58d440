"""The fused ops as ``torch.library`` custom ops (``siamesenorm::...``) and their front functions.

- :func:`add_norm`: Pre-Norm's residual add and the next norm, ``s = h + z; n = norm(s)``.
- :func:`siamese_update_entry`: SiameseNorm's stream writes fused with the next entry
  (arXiv 2602.08064).

Each op has a fake (for ``torch.compile``) and a backward op; both run through a
:class:`~.guard.KernelOp`. Forward keeps the tensors a norm reads and its row statistics.
"""


import torch
import torch.nn.functional as F
from torch import Tensor

from . import arguments, guard
from .availability import kernels_run_on

__all__ = ["MAX_WIDTH", "add_norm", "add_rms_norm", "siamese_update_entry"]

MAX_WIDTH = 65536            # a row is one Triton block; wider rows take the PyTorch path
_KINDS = ("rmsnorm", "layernorm")
_X_MODES = ("norm", "gain", "none")


def _kernels():
    from . import _triton
    return _triton


def _use_kernels(t: Tensor, op: guard.KernelOp, *others: Tensor | None) -> bool:
    """The kernels for ``t`` (and ``others``: their dtypes too); float64 takes the PyTorch path."""
    return (op.on and arguments.kernel_dtypes(t, *others) and 0 < t.shape[-1] <= MAX_WIDTH
            and kernels_run_on(t))


def _norm(t: Tensor, weight: Tensor | None, bias: Tensor | None, kind: str, eps: float) -> Tensor:
    if kind == "layernorm":
        return F.layer_norm(t, (t.shape[-1],), weight, bias, eps)
    return F.rms_norm(t, (t.shape[-1],), weight, eps)


def _contiguous(t: Tensor | None) -> Tensor | None:
    """A gradient as the kernels read it; ``None`` for none (or that of an output left empty)."""
    return None if t is None or t.numel() == 0 else t.contiguous()


def _rows(t: Tensor) -> int:
    return t.numel() // t.shape[-1]


def _check_kind(kind: str, *biases: Tensor | None) -> None:
    if kind not in _KINDS:
        raise ValueError(f"norm kind must be one of {_KINDS}, not {kind!r}")
    if kind == "rmsnorm" and any(b is not None for b in biases):
        raise ValueError("RMSNorm has no bias")


def _param_contiguous(p: Tensor | None) -> Tensor | None:
    """A weight or bias as the kernels read it (one stride)."""
    return None if p is None else p.contiguous()


def _check_add_norm(h: Tensor, z: Tensor, weight: Tensor | None, bias: Tensor | None, kind: str) -> None:
    _check_kind(kind, bias)
    arguments.tensor("add_norm", "h", h)
    arguments.tensor("add_norm", "z", z)
    if h.shape != z.shape:
        raise ValueError(f"add_norm: h and z differ in shape: {tuple(h.shape)} and {tuple(z.shape)}")
    arguments.param("add_norm", "weight", weight, h.shape[-1])
    arguments.param("add_norm", "bias", bias, h.shape[-1])


# ---- s = h + z; n = norm(s) --------------------------------------------------------------------------
def _add_norm_reference(h: Tensor, z: Tensor, weight: Tensor | None, bias: Tensor | None, kind: str,
                        eps: float) -> tuple[Tensor, Tensor]:
    """``(s, n)`` by PyTorch ops, in the kernel's dtypes."""
    s = h + z
    return s, _norm(s, weight, bias, kind, eps).to(s.dtype)


def _add_norm_check(h: Tensor, z: Tensor, weight: Tensor | None, bias: Tensor | None, kind: str,
                    eps: float) -> float:
    d, dev = h.shape[-1], h.device
    args = guard.random_inputs(0, dev, ((4, d), h.dtype), ((4, d), z.dtype),
                               None if weight is None else ((d,), weight.dtype),
                               None if bias is None else ((d,), bias.dtype))
    if args[2] is not None:
        args[2] = 1 + 0.1 * args[2]
    return guard.compare(lambda *a: torch.ops.siamesenorm.add_norm(*a, kind, eps)[:2],
                         lambda *a: _add_norm_reference(*a, kind, eps), args)


def _add_norm_example(device: torch.device, dtype: torch.dtype) -> tuple:
    h, z, w = guard.random_inputs(1, device, ((3, 96), dtype), ((3, 96), dtype), ((96,), dtype))
    return h, z, w, None, "rmsnorm", 1e-6


ADD_NORM = guard.KernelOp("add_norm", _add_norm_check, _add_norm_example)


@torch.library.custom_op("siamesenorm::add_norm", mutates_args=())
def _add_norm(h: Tensor, z: Tensor, weight: Tensor | None, bias: Tensor | None, kind: str,
              eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """``(s, n, stats)``: ``stats`` is ``(2, rows)`` float32, the mean (0 for RMSNorm) and rstd
    (zeros on the PyTorch path, whose backward does not read them)."""
    _check_add_norm(h, z, weight, bias, kind)
    weight, bias = _param_contiguous(weight), _param_contiguous(bias)

    def fallback():
        return *_add_norm_reference(h, z, weight, bias, kind, eps), h.new_zeros((2, _rows(h)),
                                                                                 dtype=torch.float32)
    return ADD_NORM.run(lambda: _kernels().add_norm_forward(h, z, weight, bias, kind == "layernorm", eps),
                        fallback, (guard.config_key(h.shape[-1], h, z, weight, bias, kind),
                                   (h, z, weight, bias, kind, eps), h.device))


@_add_norm.register_fake
def _(h, z, weight, bias, kind, eps):
    _check_add_norm(h, z, weight, bias, kind)
    s = h.new_empty(h.shape, dtype=torch.promote_types(h.dtype, z.dtype))
    return s, torch.empty_like(s), h.new_empty((2, _rows(h)), dtype=torch.float32)


def _param_grad(g: Tensor | None, p: Tensor | None, need: bool, like: Tensor) -> Tensor:
    """A parameter's gradient as the kernels return it: in its dtype, empty float32 where none."""
    if p is not None and need and g is not None:
        return g.to(p.dtype)
    return like.new_empty(0, dtype=torch.float32)


@torch.library.custom_op("siamesenorm::add_norm_backward", mutates_args=())
def _add_norm_backward(gs: Tensor | None, gn: Tensor, s: Tensor, weight: Tensor | None,
                       bias: Tensor | None, stats: Tensor, kind: str, eps: float, need_w: bool,
                       need_b: bool) -> tuple[Tensor, Tensor, Tensor]:
    """``(ds, dw, db)`` (``ds`` in ``s``'s dtype; ``dw``, ``db`` empty where not computed)."""
    weight, bias = _param_contiguous(weight), _param_contiguous(bias)

    def fallback():
        ds, dw, db = guard.reference_grads(lambda s, w, b: [_norm(s, w, b, kind, eps)], [s, weight, bias],
                                           [gn])
        ds = ds if gs is None else ds + gs
        return ds.to(s.dtype), _param_grad(dw, weight, need_w, s), _param_grad(db, bias, need_b, s)
    return ADD_NORM.run(lambda: _kernels().add_norm_backward(gs, gn, s, weight, bias, stats,
                                                             kind == "layernorm", need_w, need_b), fallback,
                        device=s.device)


@_add_norm_backward.register_fake
def _(gs, gn, s, weight, bias, stats, kind, eps, need_w, need_b):
    def grad(p: Tensor | None, need: bool) -> Tensor:
        return torch.empty_like(p) if p is not None and need else s.new_empty(0, dtype=torch.float32)

    return torch.empty_like(s), grad(weight, need_w), grad(bias, need_b)


def _add_norm_setup(ctx, inputs, output) -> None:
    h, z, weight, bias, kind, eps = inputs
    s, _, stats = output
    ctx.save_for_backward(s, weight, bias, stats)
    ctx.kind, ctx.eps, ctx.dtypes = kind, eps, (h.dtype, z.dtype)
    ctx.mark_non_differentiable(stats)
    ctx.set_materialize_grads(False)


def _add_norm_grad(ctx, gs, gn, _):
    s, weight, bias, stats = ctx.saved_tensors
    need = ctx.needs_input_grad
    dw = db = None
    if gn is None:
        ds = gs
    else:
        ds, dw, db = torch.ops.siamesenorm.add_norm_backward(
            _contiguous(gs), gn.contiguous(), s, weight, bias, stats, ctx.kind, ctx.eps, need[2], need[3])
        dw = dw if weight is not None and need[2] else None
        db = db if bias is not None and need[3] else None
    if ds is None:
        return None, None, dw, db, None, None
    dh, dz = (ds.to(t) if n else None for t, n in zip(ctx.dtypes, need[:2]))
    return dh, dz, dw, db, None, None


_add_norm.register_autograd(_add_norm_grad, setup_context=_add_norm_setup)


def add_norm(h: Tensor, z: Tensor, weight: Tensor | None = None, bias: Tensor | None = None, *,
             kind: str = "rmsnorm", eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """``(s, n)`` with ``s = h + z`` and ``n = norm(s)`` over the last dimension (``kind``:
    ``"rmsnorm"``, weight optional, or ``"layernorm"``, weight and bias optional). ``s`` and ``n``
    have the dtype of ``h + z``; the kernel computes in float32 and keeps ``s`` and the row
    statistics for backward."""
    _check_add_norm(h, z, weight, bias, kind)
    arguments.eps("add_norm", "eps", eps)
    if _use_kernels(h, ADD_NORM, z, weight, bias):
        s, n, _ = torch.ops.siamesenorm.add_norm(h, z, weight, bias, kind, float(eps))
        return s, n
    s = h + z
    return s, _norm(s, weight, bias, kind, eps)


def add_rms_norm(h: Tensor, z: Tensor, weight: Tensor | None = None,
                 eps: float = 1e-6) -> tuple[Tensor, Tensor]:
    """``(s, rms_norm(s))`` with ``s = h + z``: :func:`add_norm` with RMSNorm."""
    return add_norm(h, z, weight, kind="rmsnorm", eps=eps)


# ---- SiameseNorm: the update of two streams and the entry of the next sublayer -------------------------
def _check_update_entry(x: Tensor, y: Tensor | None, o: Tensor | None, xw: Tensor | None, xb: Tensor | None,
                        yw: Tensor | None, yb: Tensor | None, iw: Tensor | None, ib: Tensor | None, kind: str,
                        x_mode: str, y_norm: bool, in_norm: bool) -> None:
    op = "siamese_update_entry"
    _check_kind(kind, xb, yb, ib)
    if x_mode not in _X_MODES:
        raise ValueError(f"x_mode must be one of {_X_MODES}, not {x_mode!r}")
    if x_mode == "gain" and (xw is None or xb is not None):
        raise ValueError('x_mode "gain" takes x_weight (the gain) and no x_bias')
    if x_mode == "none" and (xw is not None or xb is not None):
        raise ValueError('x_mode "none" takes no x_weight or x_bias')
    if not y_norm and (yw is not None or yb is not None):
        raise ValueError("y_weight and y_bias need y_norm")
    if not in_norm and (iw is not None or ib is not None):
        raise ValueError("in_weight and in_bias need in_norm")
    if y is None and (y_norm or o is not None):
        raise ValueError("y is needed with y_norm or o")
    arguments.tensor(op, "x", x)
    for name, t in (("y", y), ("o", o)):
        if t is not None and arguments.tensor(op, name, t).shape != x.shape:
            raise ValueError(f"{op}: {name} has shape {tuple(t.shape)}, x {tuple(x.shape)}")
    for name, p in (("x_weight", xw), ("x_bias", xb), ("y_weight", yw), ("y_bias", yb), ("in_weight", iw),
                    ("in_bias", ib)):
        arguments.param(op, name, p, x.shape[-1])


def _entry_from_sums(x1: Tensor, y1: Tensor | None, xw: Tensor | None, xb: Tensor | None,
                     yw: Tensor | None, yb: Tensor | None, iw: Tensor | None, ib: Tensor | None, kind: str,
                     eps: float, x_mode: str, y_norm: bool, in_norm: bool) -> tuple[Tensor, Tensor]:
    """``(x', b)`` by PyTorch ops from what the norms read (``x1``, ``y1``): the equations of
    :func:`siamese_update_entry` after the update."""
    xo = _norm(x1, xw, xb, kind, eps) if x_mode == "norm" else x1
    u = x1 * xw if x_mode == "gain" else xo
    if y_norm:
        u = u + _norm(y1, yw, yb, kind, eps)
    return xo, (_norm(u, iw, ib, kind, eps) if in_norm else u)


def _entry_reference(x: Tensor, y: Tensor, o: Tensor | None, scale: float, params: list[Tensor | None],
                     kind: str, eps: float, x_mode: str, y_norm: bool, in_norm: bool,
                     b_dtype: torch.dtype | None) -> tuple[Tensor, Tensor, Tensor]:
    """``(x', y1, b)`` by PyTorch ops, in the kernel's dtypes (``x'`` is ``x1`` outside "norm" mode)."""
    if o is not None:
        x, y = torch.add(x, o, alpha=scale), y + o
    xo, b = _entry_from_sums(x, y, *params, kind, eps, x_mode, y_norm, in_norm)
    return xo.to(x.dtype), y, b.to(b_dtype or torch.promote_types(x.dtype, y.dtype))


def _entry_check(x, y, o, scale, xw, xb, yw, yb, iw, ib, kind, eps, x_mode, y_norm, in_norm,
                 b_dtype=None) -> float:
    d, dev = x.shape[-1], x.device
    spec = [None if t is None else (((4, d) if t.dim() > 1 else (d,)), t.dtype)
            for t in (x, y, o, xw, xb, yw, yb, iw, ib)]
    args = guard.random_inputs(0, dev, *spec)
    for i in (3, 5, 7):         # weights (and the gain) near one
        if args[i] is not None:
            args[i] = 1 + 0.1 * args[i]
    has_o = o is not None

    def kernel(x, y, o, *p):
        xo, y1, b, _, _ = torch.ops.siamesenorm.update_entry(x, y, o, scale, *p, kind, eps, x_mode, y_norm,
                                                             in_norm, b_dtype)
        return [t for t, keep in ((xo, x_mode == "norm" or has_o), (y1, has_o), (b, True)) if keep]

    def reference(x, y, o, *p):
        xo, y1, b = _entry_reference(x, y, o, scale, list(p), kind, eps, x_mode, y_norm, in_norm, b_dtype)
        return [t for t, keep in ((xo, x_mode == "norm" or has_o), (y1, has_o), (b, True)) if keep]
    return guard.compare(kernel, reference, args, guard.tolerance(args, b_dtype))


def _entry_example(device: torch.device, dtype: torch.dtype) -> tuple:
    x, y, o, w = guard.random_inputs(2, device, *[((3, 96), dtype)] * 3, ((96,), dtype))
    return (x, y, o, 0.5, w, None, w, None, w, None, "rmsnorm", 1e-6, "norm", True, True, None)


UPDATE_ENTRY = guard.KernelOp("update_entry", _entry_check, _entry_example)


@torch.library.custom_op("siamesenorm::update_entry", mutates_args=())
def _update_entry(x: Tensor, y: Tensor, o: Tensor | None, scale: float, x_weight: Tensor | None,
                  x_bias: Tensor | None, y_weight: Tensor | None, y_bias: Tensor | None,
                  in_weight: Tensor | None, in_bias: Tensor | None, kind: str, eps: float,
                  x_mode: str, y_norm: bool, in_norm: bool,
                  b_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``(x', y1, b, x1, stats)``: ``x'`` is empty when it is ``x`` itself (no ``o``, no X norm),
    ``y1`` without ``o``; ``x1`` (``x + scale o``) is written only with ``o`` and the X norm, for
    backward; ``stats`` is ``(6, rows)`` float32: mean and rstd of the X, Y and input norms (zeros
    on the PyTorch path, whose backward does not read them)."""
    _check_update_entry(x, y, o, x_weight, x_bias, y_weight, y_bias, in_weight, in_bias, kind, x_mode, y_norm,
                        in_norm)
    params = [_param_contiguous(p) for p in (x_weight, x_bias, y_weight, y_bias, in_weight, in_bias)]
    has_o = o is not None

    def fallback():
        xo, y1, b = _entry_reference(x, y, o, scale, params, kind, eps, x_mode, y_norm, in_norm, b_dtype)
        empty = x.new_empty(0, dtype=xo.dtype)
        return (xo if x_mode == "norm" or has_o else empty, y1 if has_o else y.new_empty(0, dtype=y1.dtype),
                b, xo.new_empty(0) if not (has_o and x_mode == "norm") else torch.add(x, o, alpha=scale),
                x.new_zeros((6, _rows(x)), dtype=torch.float32))
    return UPDATE_ENTRY.run(
        lambda: _kernels().entry_forward(x, y, o, scale, params, kind == "layernorm", eps, x_mode, y_norm,
                                         in_norm, b_dtype), fallback,
        (guard.config_key(x.shape[-1], x, y, o, *params, kind, x_mode, y_norm, in_norm, b_dtype),
         (x, y, o, scale, *params, kind, eps, x_mode, y_norm, in_norm, b_dtype), x.device))


@_update_entry.register_fake
def _(x, y, o, scale, x_weight, x_bias, y_weight, y_bias, in_weight, in_bias, kind, eps, x_mode, y_norm,
      in_norm, b_dtype=None):
    _check_update_entry(x, y, o, x_weight, x_bias, y_weight, y_bias, in_weight, in_bias, kind, x_mode, y_norm,
                        in_norm)
    has_o = o is not None
    x_dtype = x.dtype if o is None else torch.promote_types(x.dtype, o.dtype)
    y_dtype = y.dtype if o is None else torch.promote_types(y.dtype, o.dtype)

    def new(full: bool, dtype: torch.dtype) -> Tensor:
        return x.new_empty(x.shape if full else (0,), dtype=dtype)

    return (new(x_mode == "norm" or has_o, x_dtype), new(has_o, y_dtype),
            new(True, b_dtype or torch.promote_types(x_dtype, y_dtype)),
            new(has_o and x_mode == "norm", x_dtype),
            x.new_empty((6, _rows(x)), dtype=torch.float32))


@torch.library.custom_op("siamesenorm::update_entry_backward", mutates_args=())
def _update_entry_backward(g_xo: Tensor | None, g_y1: Tensor | None, g_b: Tensor, x1: Tensor,
                           y1: Tensor | None, x_weight: Tensor | None, x_bias: Tensor | None,
                           y_weight: Tensor | None, y_bias: Tensor | None,
                           in_weight: Tensor | None, in_bias: Tensor | None, stats: Tensor,
                           has_o: bool, scale: float, kind: str, eps: float, x_mode: str, y_norm: bool,
                           in_norm: bool) -> list[Tensor]:
    """``[dx, dy, do, d_xw, d_xb, d_yw, d_yb, d_iw, d_ib]``, the first three in ``x1``'s dtype;
    empty where there is no such gradient."""
    params = [_param_contiguous(p) for p in (x_weight, x_bias, y_weight, y_bias, in_weight, in_bias)]

    def fallback():
        dx, dy, *d_params = guard.reference_grads(
            lambda x1, y1, *p: _entry_from_sums(x1, y1, *p, kind, eps, x_mode, y_norm, in_norm),
            [x1, y1 if y_norm else None, *params], [g_xo, g_b])
        if g_y1 is not None:
            dy = g_y1 if dy is None else dy + g_y1
        if dy is None:
            dy = torch.zeros_like(x1)
        empty = x1.new_empty(0)
        return [dx.to(x1.dtype), dy.to(x1.dtype) if y_norm or has_o else empty,
                (scale * dx + dy).to(x1.dtype) if has_o else empty,
                *(_param_grad(g, p, True, x1) for g, p in zip(d_params, params))]
    return UPDATE_ENTRY.run(
        lambda: list(_kernels().entry_backward(g_xo, g_y1, g_b, x1, y1, params, stats, has_o, scale,
                                               kind == "layernorm", x_mode, y_norm, in_norm)), fallback,
        device=x1.device)


@_update_entry_backward.register_fake
def _(g_xo, g_y1, g_b, x1, y1, x_weight, x_bias, y_weight, y_bias, in_weight, in_bias, stats, has_o, scale,
      kind, eps, x_mode, y_norm, in_norm):
    def new(full: bool) -> Tensor:
        return x1.new_empty(x1.shape if full else (0,))

    params = [x_weight, x_bias, y_weight, y_bias, in_weight, in_bias]
    return [new(True), new(y_norm or has_o), new(has_o),
            *(torch.empty_like(p) if p is not None else x1.new_empty(0, dtype=torch.float32)
              for p in params)]


def _entry_setup(ctx, inputs, output) -> None:
    x, y, o, scale, xw, xb, yw, yb, iw, ib, kind, eps, x_mode, y_norm, in_norm, _ = inputs
    xo, y1, b, x1, stats = output
    has_o = o is not None
    # What the norms read: x1 = x + scale o (x itself without o), y1 = y + o (y itself).
    x1_kept = (x1 if x_mode == "norm" else xo) if has_o else x
    y1_kept = (y1 if has_o else y) if y_norm else None
    ctx.save_for_backward(x1_kept, y1_kept, xw, xb, yw, yb, iw, ib, stats)
    ctx.flags = (has_o, scale, kind, eps, x_mode, y_norm, in_norm)
    ctx.dtypes = (x.dtype, y.dtype, None if o is None else o.dtype)
    ctx.b_meta = (b.shape, b.dtype)
    ctx.mark_non_differentiable(x1, stats)
    ctx.set_materialize_grads(False)


def _entry_grad(ctx, g_xo, g_y1, g_b, _x1, _stats):
    x1, y1, *params, stats = ctx.saved_tensors
    has_o, scale, kind, eps, x_mode, y_norm, in_norm = ctx.flags
    none = (None,) * 16
    g_xo, g_y1, g_b = _contiguous(g_xo), _contiguous(g_y1), _contiguous(g_b)
    if g_xo is None and g_y1 is None and g_b is None:
        return none
    if g_b is None:
        g_b = x1.new_zeros(ctx.b_meta[0], dtype=ctx.b_meta[1])
    dx, dy, do, *d_params = torch.ops.siamesenorm.update_entry_backward(
        g_xo, g_y1, g_b, x1, y1, *params, stats, has_o, scale, kind, eps,
        x_mode, y_norm, in_norm)
    need = ctx.needs_input_grad
    x_dtype, y_dtype, o_dtype = ctx.dtypes
    dx = dx.to(x_dtype) if need[0] else None
    dy = dy.to(y_dtype) if need[1] and (y_norm or has_o) else None
    do = do.to(o_dtype) if has_o and need[2] else None
    d_params = [d if p is not None and n else None for d, p, n in zip(d_params, params, need[4:10])]
    return (dx, dy, do, None, *d_params, None, None, None, None, None, None)


_update_entry.register_autograd(_entry_grad, setup_context=_entry_setup)


def siamese_update_entry(x: Tensor, y: Tensor | None, o: Tensor | None = None, scale: float = 1.0, *,
                         x_mode: str = "norm", x_weight: Tensor | None = None,
                         x_bias: Tensor | None = None, y_norm: bool = True, y_weight: Tensor | None = None,
                         y_bias: Tensor | None = None, in_norm: bool = True,
                         in_weight: Tensor | None = None, in_bias: Tensor | None = None,
                         kind: str = "rmsnorm", eps: float = 1e-6,
                         out_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor | None, Tensor]:
    """SiameseNorm between two matmuls; returns ``(x', y1, b)``::

        x1, y1 = x + scale * o, y + o        (x, y themselves without o)
        x'     = LN^X(x1)                    (x_mode "norm"; x1 itself for "gain" and "none")
        r      = x' | x1 * x_weight | x1     (x_mode "norm" | "gain" | "none")
        u      = r + LN^Y(y1)                (r without y_norm)
        b      = LN^in(u)                    (u without in_norm)

    All norms share ``kind`` and ``eps``; weights and biases are optional. ``u`` is never stored:
    backward recomputes it. ``out_dtype``: the dtype of ``b``, if not the streams'.
    """
    _check_update_entry(x, y, o, x_weight, x_bias, y_weight, y_bias, in_weight, in_bias, kind, x_mode, y_norm,
                        in_norm)
    arguments.eps("siamese_update_entry", "eps", eps)
    arguments.floating_dtype("siamese_update_entry", "out_dtype", out_dtype)
    if isinstance(scale, Tensor) and scale.dim() != 0:
        raise ValueError(f"siamese_update_entry: scale must be a number or a 0-dim tensor, not shape "
                         f"{tuple(scale.shape)}")
    params = (x_weight, x_bias, y_weight, y_bias, in_weight, in_bias)
    if not isinstance(scale, Tensor) and _use_kernels(x, UPDATE_ENTRY, y, o, *params):   # a tensor scale:
        xo, y1, b, _, _ = torch.ops.siamesenorm.update_entry(                            # its gradient

            x, y if y is not None else x, o, float(scale), x_weight, x_bias, y_weight, y_bias, in_weight,
            in_bias, kind, float(eps), x_mode, y_norm, in_norm, out_dtype)
        return (xo if x_mode == "norm" or o is not None else x), (y1 if o is not None else y), b
    if o is not None:
        x, y = (x + scale * o if isinstance(scale, Tensor) else torch.add(x, o, alpha=scale)), y + o
    xo, b = _entry_from_sums(x, y, x_weight, x_bias, y_weight, y_bias, in_weight, in_bias, kind, eps, x_mode,
                             y_norm, in_norm)
    return xo, y, (b if out_dtype is None else b.to(out_dtype))
