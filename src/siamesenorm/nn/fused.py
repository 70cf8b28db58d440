"""Memory-lean norms: what a norm keeps for backward is its input and per-row statistics.

Each function here computes the plain composition of modules (the reference) with an autograd
function that recomputes the normalised tensor in backward (the lean path), and, where the Triton
kernels run, one fused kernel each way (:func:`siamesenorm.compute.use_path` chooses;
docs/performance.md). Under autocast the norms compute as PyTorch's do.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd import Function
from torch.utils.checkpoint import checkpoint

from ..compute import compiled_graph_kernels, lean_on

try:
    from ..kernels import add_norm, siamese_update_entry
    from ..kernels.availability import kernels_run_on
except ImportError:     # the exported modelling code (siamesenorm.hf.export) carries no kernels
    add_norm = siamese_update_entry = kernels_run_on = None

__all__ = ["add_then_norm", "defers_add", "defers_update", "derf", "dyt", "fused_enabled",
           "lean_region", "norm_value", "recomputed_inputs", "rms_norm", "stream_entry",
           "stream_update", "stream_update_entry"]

_aten = torch.ops.aten
_LOW = (torch.float16, torch.bfloat16)
# The point-wise stand-ins for a norm (no row statistics; the Triton kernels do not compute them).
POINTWISE_KINDS = ("dyt", "derf")


def fused_enabled() -> bool:
    """Whether the lean functions run here (:func:`siamesenorm.compute.lean_on`)."""
    return lean_on()


def _kernels_run_on(*tensors: Tensor | None) -> bool:
    """The kernels of the stream ops run here; a graph being traced leaves that work to Inductor
    (it moves the same bytes) unless ``use_path("kernels", compiled_graphs=True)``."""
    if torch.compiler.is_compiling() and not compiled_graph_kernels():
        return False
    return kernels_run_on is not None and kernels_run_on(*tensors)


def _wants_grad(*tensors: Tensor | None) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _autocast_on(t: Tensor) -> bool:
    """Whether autocast is on for ``t``'s device (never on the meta device)."""
    return t.device.type in ("cpu", "cuda", "xpu", "mps", "hpu") and \
        torch.is_autocast_enabled(t.device.type)


def _autocast_fp32(t: Tensor) -> bool:
    """Whether autocast computes PyTorch's norms of ``t`` in float32 (CUDA's policy; CPU autocast
    leaves them in the input's dtype)."""
    return t.device.type == "cuda" and torch.is_autocast_enabled("cuda")


def _norm_kind(module: nn.Module) -> str:
    kind = getattr(module, "kind", None)      # siamesenorm.nn.norms' classes (which import this)
    if kind in ("layernorm", "rmsnorm", *POINTWISE_KINDS):
        return kind
    raise TypeError(f"not a siamesenorm norm: {type(module).__name__}")


# ---- one norm, forward and backward, from its input and row statistics ---------------------------
def _upcast(t: Tensor) -> Tensor:
    """``t`` in the dtype norms compute in: float32 for half inputs, its own otherwise."""
    return t.float() if t.dtype in _LOW else t


def _rms_rstd(xf: Tensor, eps: float) -> Tensor:
    """``1 / sqrt(mean(x^2) + eps)`` per row (one pass over ``x``)."""
    norm = torch.linalg.vector_norm(xf, 2, -1, keepdim=True)
    return norm.square_().div_(xf.shape[-1]).add_(eps).rsqrt_()


def _cast(t: Tensor, dtype: torch.dtype) -> Tensor:
    return t if t.dtype == dtype else t.to(dtype)


def _rms_apply(xf: Tensor, rstd: Tensor, weight: Tensor | None) -> Tensor:
    out = xf * rstd
    return out if weight is None else out.mul_(weight)


def _rms_forward(x: Tensor, weight: Tensor | None, eps: float) -> tuple[Tensor, Tensor]:
    """RMSNorm of ``x`` over the last dimension and its ``rstd`` (float32 for half inputs)."""
    if x.is_cuda:
        return _aten._fused_rms_norm(x, [x.shape[-1]], weight, eps)
    xf = _upcast(x)
    rstd = _rms_rstd(xf, eps)
    return _cast(_rms_apply(xf, rstd, weight), x.dtype), rstd


def _rms_backward(g: Tensor, x: Tensor, rstd: Tensor, weight: Tensor | None,
                  needs: tuple[bool, bool]) -> tuple[Tensor | None, Tensor | None]:
    """Gradients of input and weight: ``dx = rstd (h - x^ mean(h x^))`` with ``x^ = x rstd``, ``h =
    g w``. On the CPU, LayerNorm's fused backward with a zero mean plus ``rstd mean(h)``: about
    half the time of separate kernels."""
    if x.is_cuda:
        return _aten._fused_rms_norm_backward(g, x, [x.shape[-1]], rstd, weight,
                                              [needs[0], needs[1] and weight is not None])
    d = x.shape[-1]
    mask = [needs[0], needs[1] and weight is not None, False]
    if not any(mask):
        return None, None
    gf, xf, wf = _upcast(g), _upcast(x), None if weight is None else _upcast(weight)
    rstd = rstd.contiguous()        # the kernel reads mean and rstd as dense rows
    dx, dw, _ = _aten.native_layer_norm_backward(gf, xf, [d], torch.zeros_like(rstd),
                                                 rstd, wf, None, mask)
    if dx is not None:
        mean_h = (gf.sum(-1) if wf is None else torch.mv(gf.reshape(-1, d), wf)).view(rstd.shape)
        dx = _cast(dx.addcmul_(mean_h, rstd, value=1.0 / d), x.dtype)
    return dx, None if dw is None else _cast(dw, weight.dtype)


@dataclass(frozen=True)
class _Norm:
    """One norm of a fused function: kind and epsilon (DyT's ``a`` is its alpha, Derf's
    ``(alpha, shift)``; these have no row statistics)."""

    kind: str
    eps: float

    def forward(self, x: Tensor, w: Tensor | None, b: Tensor | None,
                a: Tensor | None = None) -> tuple[Tensor, tuple]:
        """The norm of ``x`` and its row statistics."""
        if self.kind == "dyt":   # its "statistics": tanh(alpha x), for a backward that recomputes
            t = torch.tanh(a * x)
            out = t if w is None else t * w
            return (out if b is None else out + b), (t,)
        if self.kind == "derf":
            return _derf_value(x, a[:1], a[1:], w, b), ()
        if self.kind == "layernorm":
            out, mean, rstd = _aten.native_layer_norm(x, [x.shape[-1]], w, b, self.eps)
            return out, (mean, rstd)
        out, rstd = _rms_forward(x, w, self.eps)
        return out, (rstd,)

    def added(self, base: Tensor, x: Tensor, w: Tensor | None, b: Tensor | None,
              a: Tensor | None = None) -> tuple:
        """``base + norm(x)`` and the statistics of ``x`` (RMSNorm: one fused multiply-add)."""
        if self.kind != "rmsnorm" or x.is_cuda:
            out, stats = self.forward(x, w, b, a)
            return base + out, stats
        xf = _upcast(x)
        rstd = _rms_rstd(xf, self.eps)
        scaled = xf * rstd
        out = scaled.add_(base) if w is None else torch.addcmul(base, scaled, w)
        return _cast(out, torch.promote_types(base.dtype, x.dtype)), (rstd,)

    def backward(self, g: Tensor, x: Tensor, stats: tuple, w: Tensor | None, b: Tensor | None,
                 needs: tuple[bool, ...], a: Tensor | None = None) -> tuple[Tensor | None, ...]:
        """``(dx, dw, db, da)`` for the gradients ``needs`` asks for (x, w, b and DyT's alpha)."""
        if self.kind == "dyt":
            dx, da, dw, db = _dyt_backward(g, x, a, w, None if b is None else b.dtype,
                                           (needs[0], len(needs) > 3 and needs[3], needs[1], needs[2]),
                                           stats[0] if stats else None)
            return dx, dw, db, da
        if self.kind == "derf":
            want_a = len(needs) > 3 and needs[3]
            dx, d_alpha, d_shift, dw, db = _derf_backward(
                g, x, a[:1], a[1:], w, None if b is None else b.dtype,
                (needs[0], want_a, want_a, needs[1], needs[2]))
            return dx, dw, db, torch.cat([d_alpha, d_shift]) if want_a else None
        if self.kind == "layernorm":
            mask = [needs[0], needs[1] and w is not None, needs[2] and b is not None]
            if not any(mask):
                return None, None, None, None
            return (*_aten.native_layer_norm_backward(g, x, [x.shape[-1]], *stats, w, b, mask), None)
        dx, dw = _rms_backward(g, x, stats[0], w, needs[:2])
        return dx, dw, None, None


def _params(module: nn.Module | None) -> tuple[Tensor | None, Tensor | None]:
    if module is None:
        return None, None
    return module.weight, getattr(module, "bias", None)


def _alpha(module: nn.Module | None) -> Tensor | None:
    """DyT's alpha, Derf's ``(alpha, shift)`` as one tensor, or ``None`` (no module, or a norm
    that has none)."""
    kind = None if module is None else _norm_kind(module)
    if kind == "derf":
        return torch.cat([module.alpha, module.shift])
    return module.alpha if kind == "dyt" else None


def _float32(t: Tensor | None) -> Tensor | None:
    return t.float() if t is not None and t.dtype in _LOW else t


# ---- RMSNorm ------------------------------------------------------------------------------------
class _RMSNorm(Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
        out, rstd = _rms_forward(x, weight, eps)
        ctx.save_for_backward(x, rstd, weight)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        x, rstd, weight = ctx.saved_tensors
        dx, dw = _rms_backward(g, x, rstd, weight, ctx.needs_input_grad[:2])
        return dx, dw, None


def rms_norm(x: Tensor, weight: Tensor | None, eps: float) -> Tensor:
    """``x / sqrt(mean(x^2) + eps) * weight`` over the last dimension, keeping only ``x`` and the
    row statistic for backward (``F.rms_norm`` where no gradient is needed or the lean path is off)."""
    if x.is_cuda or not (fused_enabled() and _wants_grad(x, weight)):
        # On CUDA PyTorch's own fused kernel already keeps only x and rstd.
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    if _autocast_on(x):
        cast = _float32 if _autocast_fp32(x) else (lambda t: t)
        with torch.autocast(x.device.type, enabled=False):
            return _RMSNorm.apply(cast(x), cast(weight), eps)
    return _RMSNorm.apply(x, weight, eps)


# ---- DyT ------------------------------------------------------------------------------------------
def _dyt_value(x: Tensor, alpha: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
    """``weight * tanh(alpha * x) + bias`` (the same ops on every path, so values agree bit for bit)."""
    out = torch.tanh(alpha * x)
    if weight is not None:
        out = out * weight
    return out if bias is None else out + bias


def _row_sum(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` summed over every dimension but the last, in ``dtype``."""
    return _cast(t.reshape(-1, t.shape[-1]).sum(0), dtype)


def _dyt_backward(g: Tensor, x: Tensor, alpha: Tensor, weight: Tensor | None,
                  bias_dtype: torch.dtype | None, needs: tuple[bool, bool, bool, bool],
                  t: Tensor | None = None) -> tuple:
    """``(dx, d alpha, dw, db)`` of ``weight * tanh(alpha x) + bias`` (``needs``: which, in that
    order; ``t``: ``tanh(alpha x)`` if already recomputed). With ``s = g w (1 - t^2)``:
    ``dx = alpha s``, ``d alpha = sum(s x)``, ``dw = sum_rows g t``, ``db = sum_rows g``."""
    t = torch.tanh(alpha * x) if t is None else t
    gw = g if weight is None else g * weight
    s = gw * (1 - t * t)
    dx = _cast(s * alpha, x.dtype) if needs[0] else None
    d_alpha = _cast((s * x).sum().reshape(alpha.shape), alpha.dtype) if needs[1] else None
    dw = _row_sum(g * t, weight.dtype) if weight is not None and needs[2] else None
    db = _row_sum(g, bias_dtype) if bias_dtype is not None and needs[3] else None
    return dx, d_alpha, dw, db


class _DyT(Function):
    @staticmethod
    def forward(ctx, x: Tensor, alpha: Tensor, weight: Tensor | None, bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, alpha, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return _dyt_value(x, alpha, weight, bias)

    @staticmethod
    def backward(ctx, g: Tensor):
        x, alpha, weight = ctx.saved_tensors
        return _dyt_backward(g, x, alpha, weight, ctx.bias_dtype, ctx.needs_input_grad)


def dyt(x: Tensor, alpha: Tensor, weight: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    """``weight * tanh(alpha * x) + bias`` over the last dimension, keeping only ``x`` (and the
    parameters) for backward; the plain composition of ops where no gradient is needed or the
    lean path is off."""
    if fused_enabled() and _wants_grad(x, alpha, weight, bias):
        return _DyT.apply(x, alpha, weight, bias)
    return _dyt_value(x, alpha, weight, bias)


# ---- Derf -----------------------------------------------------------------------------------------
_TWO_OVER_SQRT_PI = 1.1283791670955126


def _derf_value(x: Tensor, alpha: Tensor, shift: Tensor, weight: Tensor | None,
                bias: Tensor | None) -> Tensor:
    """``weight * erf(alpha * x + shift) + bias`` (the same ops on every path, bit for bit)."""
    out = torch.erf(alpha * x + shift)
    if weight is not None:
        out = out * weight
    return out if bias is None else out + bias


def _derf_backward(g: Tensor, x: Tensor, alpha: Tensor, shift: Tensor, weight: Tensor | None,
                   bias_dtype: torch.dtype | None, needs: tuple[bool, ...]) -> tuple:
    """``(dx, d alpha, d shift, dw, db)`` of ``weight * erf(alpha x + shift) + bias`` (``needs``:
    which, in that order). With ``z = alpha x + shift`` and ``e = g w (2 / sqrt(pi)) exp(-z^2)``:
    ``dx = alpha e``, ``d alpha = sum(e x)``, ``d shift = sum(e)``, ``dw = sum_rows g erf(z)``,
    ``db = sum_rows g``."""
    z = alpha * x + shift
    gw = g if weight is None else g * weight
    e = gw * torch.exp(-z * z) * _TWO_OVER_SQRT_PI
    dx = _cast(e * alpha, x.dtype) if needs[0] else None
    d_alpha = _cast((e * x).sum().reshape(alpha.shape), alpha.dtype) if needs[1] else None
    d_shift = _cast(e.sum().reshape(shift.shape), shift.dtype) if needs[2] else None
    dw = _row_sum(g * torch.erf(z), weight.dtype) if weight is not None and needs[3] else None
    db = _row_sum(g, bias_dtype) if bias_dtype is not None and needs[4] else None
    return dx, d_alpha, d_shift, dw, db


class _Derf(Function):
    @staticmethod
    def forward(ctx, x: Tensor, alpha: Tensor, shift: Tensor, weight: Tensor | None,
                bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, alpha, shift, weight)
        ctx.bias_dtype = None if bias is None else bias.dtype
        return _derf_value(x, alpha, shift, weight, bias)

    @staticmethod
    def backward(ctx, g: Tensor):
        x, alpha, shift, weight = ctx.saved_tensors
        return _derf_backward(g, x, alpha, shift, weight, ctx.bias_dtype, ctx.needs_input_grad)


def derf(x: Tensor, alpha: Tensor, shift: Tensor, weight: Tensor | None = None,
         bias: Tensor | None = None) -> Tensor:
    """``weight * erf(alpha * x + shift) + bias`` over the last dimension (Derf, arXiv
    2512.10938), keeping only ``x`` (and the parameters) for backward; the plain composition of
    ops where no gradient is needed or the lean path is off."""
    if fused_enabled() and _wants_grad(x, alpha, shift, weight, bias):
        return _Derf.apply(x, alpha, shift, weight, bias)
    return _derf_value(x, alpha, shift, weight, bias)


def norm_value(module: nn.Module, x: Tensor) -> Tensor:
    """The output of norm ``module`` on ``x`` without autograd, computed by the same kernels as
    the module's lean forward, so a recomputation matches the forward bit for bit."""
    w, b = _params(module)
    kind = _norm_kind(module)
    with torch.no_grad():
        if kind == "dyt":
            return _dyt_value(x, module.alpha, w, b)
        if kind == "derf":
            return _derf_value(x, module.alpha, module.shift, w, b)
        return _Norm(kind, module.eps).forward(x, w, b)[0]


# ---- the entry of a two-stream sublayer -----------------------------------------------------------
@dataclass(frozen=True)
class _EntrySpec:
    x: str                   # "norm": X <- LN^X(X); "gain": the branch reads X * gamma; "none"
    norm: _Norm
    y: bool                  # Y contributes LN^Y(Y)
    inp: bool                # the sum goes through LN^in


def _entry_forward(spec: _EntrySpec, x: Tensor, y: Tensor | None, xw, xb, yw, yb, saved: tuple = (),
           xa: Tensor | None = None, ya: Tensor | None = None):
    """``x'``, ``u = x' + LN^Y(y)`` and the row statistics of ``LN^X`` and ``LN^Y`` (``saved``:
    those of the forward, reused when backward recomputes)."""
    n, xs, ys = spec.norm, (), ()
    rms = n.kind == "rmsnorm" and not x.is_cuda
    if saved and rms:
        xs, ys = saved[:1] if spec.x == "norm" else (), saved[-1:] if spec.y else ()
    if spec.x == "norm":
        xo = _cast(_rms_apply(_upcast(x), xs[0], xw), x.dtype) if xs else None
        if xo is None:
            xo, xs = n.forward(x, xw, xb, xa)
    elif spec.x == "gain":
        xo = x * xw
    else:
        xo = x
    u = xo
    if spec.y and ys:
        u = torch.addcmul(xo, _upcast(y) * ys[0], yw) if yw is not None else (_upcast(y) * ys[0]).add_(xo)
        u = _cast(u, torch.promote_types(xo.dtype, y.dtype))
    elif spec.y:
        u, ys = n.added(xo, y, yw, yb, ya)
    return xo, u, xs, ys


# The inputs of _StreamEntry.forward after ctx, by name (for needs_input_grad).
_ENTRY_INPUTS = ("spec", "x", "y", "xw", "xb", "yw", "yb", "iw", "ib", "xa", "ya", "ia")


def _of(need: dict[str, bool], *names: str) -> tuple[bool, ...]:
    return tuple(need[name] for name in names)


class _StreamEntry(Function):
    """``x' = LN^X(x)`` (or ``x * gamma``), ``u = x' + LN^Y(y)``, ``b = LN^in(u)``; returns
    ``(x', b)``, or ``(b,)`` when X is not normalised. Keeps ``x``, ``y`` and ``LN^in``'s row
    statistics; backward recomputes the rest."""

    @staticmethod
    def forward(ctx, spec: _EntrySpec, x, y, xw, xb, yw, yb, iw, ib, xa, ya, ia):
        xo, u, xs, ys = _entry_forward(spec, x, y, xw, xb, yw, yb, (), xa, ya)
        b, us = spec.norm.forward(u, iw, ib, ia) if spec.inp else (u, ())
        if spec.norm.kind in POINTWISE_KINDS:   # keep no tanh / erf: recomputed with x' and u
            xs = ys = us = ()
        ctx.spec, ctx.split, ctx.n_in = spec, len(xs), len(us)
        stats = (*us, *xs, *ys)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, y, xw, xb, yw, yb, iw, ib, xa, ya, ia, *stats)
        return (xo, b) if spec.x == "norm" else (b,)

    @staticmethod
    def backward(ctx, *grads):
        spec, n = ctx.spec, ctx.spec.norm
        x, y, xw, xb, yw, yb, iw, ib, xa, ya, ia, *stats = ctx.saved_tensors
        g_xo, g_b = grads if spec.x == "norm" else (None, grads[0])
        if g_b is None:
            if g_xo is None:
                return (None,) * 12
            g_b = torch.zeros_like(g_xo)
        need = dict(zip(_ENTRY_INPUTS, ctx.needs_input_grad))
        d_iw = d_ib = d_yw = d_yb = d_xw = d_xb = dy = d_xa = d_ya = d_ia = None
        du = g_b
        us, rest = tuple(stats[:ctx.n_in]), tuple(stats[ctx.n_in:])
        xs, ys = rest[:ctx.split], rest[ctx.split:]
        if spec.inp:
            _, u, xs, ys = _entry_forward(spec, x, y, xw, xb, yw, yb, rest, xa, ya)
            du, d_iw, d_ib, d_ia = n.backward(g_b, u, us, iw, ib, (True, *_of(need, "iw", "ib", "ia")), ia)
            del u
        if spec.y:
            dy, d_yw, d_yb, d_ya = n.backward(du, y, ys, yw, yb, _of(need, "y", "yw", "yb", "ya"), ya)
        d_xo = du if g_xo is None else du + g_xo
        if spec.x == "norm":
            dx, d_xw, d_xb, d_xa = n.backward(d_xo, x, xs, xw, xb, _of(need, "x", "xw", "xb", "xa"), xa)
        elif spec.x == "gain":
            dx = d_xo * xw if need["x"] else None
            if need["xw"]:
                d_xw = (d_xo * x).reshape(-1, x.shape[-1]).sum(0)
        else:
            dx = d_xo
        return None, dx, dy, d_xw, d_xb, d_yw, d_yb, d_iw, d_ib, d_xa, d_ya, d_ia


def _plain_entry(x: Tensor, y: Tensor | None, x_norm, x_gain, y_norm, in_norm):
    xo = x_norm(x) if x_norm is not None else x
    read = xo if x_gain is None else x * x_gain
    u = read if y_norm is None else read + y_norm(y)
    return xo, (u if in_norm is None else in_norm(u))


def stream_entry(x: Tensor, y: Tensor | None = None, *, x_norm: nn.Module | None = None,
                 x_gain: Tensor | None = None, y_norm: nn.Module | None = None,
                 in_norm: nn.Module | None = None) -> tuple[Tensor, Tensor]:
    """The input of a sublayer that reads two streams::

        x' = x_norm(x)              (or x itself without x_norm)
        u  = r + y_norm(y)          (r = x', or x * x_gain; r alone without y_norm)
        b  = in_norm(u)             (or u without in_norm)

    Returns ``(x', b)``. On the lean path one function that keeps only ``x``, ``y`` and row
    statistics."""
    if x_norm is not None and x_gain is not None:
        raise ValueError("stream_entry takes x_norm or x_gain, not both")
    norms = [m for m in (x_norm, y_norm, in_norm) if m is not None]
    kinds = {_norm_kind(m) for m in norms}
    eps = {m.eps for m in norms}
    params = [t for m in norms for t in (*_params(m), _alpha(m)) if t is not None]
    if x_gain is not None:
        params.append(x_gain)
    one_norm = len(kinds) == 1 and len(eps) == 1 and (y_norm is not None or in_norm is not None)
    spec = _entry_spec(kinds, eps, x_norm, x_gain, y_norm, in_norm) if one_norm else None
    if spec is not None and spec.norm.kind not in POINTWISE_KINDS and _kernels_run_on(x, y):
        xo, _, b = _kernel_entry(spec, x, y, x_norm, x_gain, y_norm, in_norm)
        return xo, b
    if spec is None or not (fused_enabled() and _wants_grad(x, y, *params)):
        return _plain_entry(x, y, x_norm, x_gain, y_norm, in_norm)
    if y is x:  # the first sublayer (X = Y = h): one input per argument, as torch.compile wants
        y = x.view_as(x)
    args = [x, y if y_norm is not None else None,
            *(_params(x_norm) if x_norm is not None else (x_gain, None)),
            *_params(y_norm), *_params(in_norm), _alpha(x_norm), _alpha(y_norm), _alpha(in_norm)]
    if _autocast_on(x):
        cast = _float32 if _autocast_fp32(x) else (lambda t: t)
        with torch.autocast(x.device.type, enabled=False):
            out = _StreamEntry.apply(spec, *map(cast, args))
    else:
        out = _StreamEntry.apply(spec, *args)
    return (out[0], out[1]) if spec.x == "norm" else (x, out[0])


# ---- the fused Triton kernel of the entry (siamesenorm.kernels), on CUDA ---------------------------
def _kernel_entry(spec: _EntrySpec, x: Tensor, y: Tensor | None, x_norm, x_gain, y_norm, in_norm,
                  out: Tensor | None = None, c: float = 1.0) -> tuple[Tensor, Tensor | None, Tensor]:
    """``(x', y1, b)``: :func:`stream_entry` (with ``out``: after the stream writes of
    :func:`stream_update`) as one Triton kernel each way (``siamesenorm::update_entry``), the norms in
    float32 under CUDA autocast as PyTorch's are (``out`` is read in its own dtype)."""
    xw, xb = _params(x_norm) if x_norm is not None else (x_gain, None)
    (yw, yb), (iw, ib) = _params(y_norm), _params(in_norm)
    tensors = [x, y if spec.y or out is not None else None, xw, xb, yw, yb, iw, ib]
    if _autocast_on(x):
        cast = _float32 if _autocast_fp32(x) else (lambda t: t)
        tensors = [cast(t) for t in tensors]
    x, y, xw, xb, yw, yb, iw, ib = tensors
    with torch.autocast(x.device.type, enabled=False):
        return siamese_update_entry(
            x, y, out, 1.0 / c, x_mode=spec.x, x_weight=xw, x_bias=xb, y_norm=spec.y, y_weight=yw,
            y_bias=yb, in_norm=spec.inp, in_weight=iw, in_bias=ib, kind=spec.norm.kind,
            eps=spec.norm.eps)


def _entry_spec(kinds: set, eps: set, x_norm, x_gain, y_norm, in_norm) -> _EntrySpec:
    return _EntrySpec(x="norm" if x_norm is not None else ("gain" if x_gain is not None else "none"),
                      norm=_Norm(next(iter(kinds)), float(next(iter(eps)))), y=y_norm is not None,
                      inp=in_norm is not None)


def defers_update(x: Tensor, y: Tensor | None, norm_kind: str) -> bool:
    """Whether a sublayer's writes into two streams should wait for the next entry,
    :func:`stream_update_entry`, whose Triton kernel fuses them: where the kernels run, with RMSNorm
    or LayerNorm, and float32 streams under autocast (the kernel writes them in float32)."""
    return (y is not None and norm_kind not in POINTWISE_KINDS and _kernels_run_on(x, y)
            and not (_autocast_on(x) and (x.dtype in _LOW or y.dtype in _LOW)))


def stream_update_entry(x: Tensor, y: Tensor, out: Tensor, c: float, *, x_norm: nn.Module | None = None,
                        x_gain: Tensor | None = None, y_norm: nn.Module | None = None,
                        in_norm: nn.Module | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """The stream writes of one sublayer and the entry of the next: ``x, y = stream_update(x, y,
    out, c)``, then ``x', b = stream_entry(x, y, ...)``; returns ``(x', y, b)``. Where
    :func:`defers_update` holds it is one Triton kernel each way (the sums ``x + out / c`` and
    ``y + out`` are never read back from memory); elsewhere exactly those two functions."""
    norms = [m for m in (x_norm, y_norm, in_norm) if m is not None]
    kinds, eps = {_norm_kind(m) for m in norms}, {m.eps for m in norms}
    if len(kinds) == 1 and len(eps) == 1 and defers_update(x, y, next(iter(kinds))):
        spec = _entry_spec(kinds, eps, x_norm, x_gain, y_norm, in_norm)
        return _kernel_entry(spec, x, y, x_norm, x_gain, y_norm, in_norm, out, c)
    x, y = stream_update(x, y, out, c)
    xo, b = stream_entry(x, y, x_norm=x_norm, x_gain=x_gain, y_norm=y_norm, in_norm=in_norm)
    return xo, y, b


def defers_add(h: Tensor, norm_kind: str) -> bool:
    """Whether a residual add should wait for the next norm, :func:`add_then_norm`, whose Triton
    kernel fuses both: as :func:`defers_update`, for one stream."""
    return (norm_kind not in POINTWISE_KINDS and _kernels_run_on(h)
            and not (_autocast_on(h) and h.dtype in _LOW))


def add_then_norm(h: Tensor, out: Tensor, norm: nn.Module | None) -> tuple[Tensor, Tensor]:
    """``(h + out, norm(h + out))`` (``norm`` ``None``: the sum twice): one Triton kernel each way
    (:func:`siamesenorm.kernels.add_norm`) where :func:`defers_add` holds, the two ops otherwise."""
    if norm is not None and defers_add(h, _norm_kind(norm)):
        weight, bias = _params(norm)
        with torch.autocast(h.device.type, enabled=False):
            return add_norm(h, out, weight, bias, kind=_norm_kind(norm), eps=norm.eps)
    h = h + out
    return h, (h if norm is None else norm(h))


def _outer_hooks() -> bool:
    """Whether a ``saved_tensors_hooks`` context (a checkpoint, CPU offloading) is active."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return top is None or top(False) is not None


def lean_region(fn: Callable[..., object], *args: object) -> object:
    """``fn(*args)`` as a non-reentrant checkpoint: backward keeps only ``args`` and recomputes the
    rest (cheap work around a sublayer). Plain where no gradient is needed, on the reference path,
    under an outer checkpoint and under ``torch.compile``."""
    if (torch.compiler.is_compiling() or not (fused_enabled() and torch.is_grad_enabled())
            or _outer_hooks()):
        return fn(*args)
    return checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=False)


class _StreamUpdate(Function):
    """``(x + s out, y + out)`` as one node: nothing saved, ``d out = dy + s dx`` in one pass."""

    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor, out: Tensor, scale: float):
        ctx.scale = scale
        return torch.add(x, out, alpha=scale), y + out

    @staticmethod
    def backward(ctx, gx: Tensor, gy: Tensor):
        return gx, gy, torch.add(gy, gx, alpha=ctx.scale), None


def stream_update(x: Tensor, y: Tensor | None, out: Tensor, c: float) -> tuple:
    """A sublayer's writes into two streams: ``(x + out / c, y + out)`` (``y`` may be ``None``).
    On the lean path one autograd node computes ``x + (1 / c) out`` (rounding may differ from
    ``out / c`` in the last bit)."""
    if y is None:
        return x + out / c, None
    if fused_enabled() and _wants_grad(x, y, out):
        return _StreamUpdate.apply(x, y, out, 1.0 / c)
    return x + out / c, y + out


# ---- dropping saved tensors that can be recomputed -------------------------------------------------
@contextmanager
def recomputed_inputs(recipes: dict[int, Callable[[], Tensor]]) -> Iterator[None]:
    """Within the block, a saved tensor whose ``id`` is a key of ``recipes`` is dropped and
    recomputed by ``recipes[id]()`` in backward (which must give it exactly). Does nothing under
    an outer ``saved_tensors_hooks`` or ``torch.compile``."""
    if not recipes or torch.compiler.is_compiling() or _outer_hooks():
        yield
        return

    def pack(t: Tensor):
        recipe = recipes.get(id(t))
        return t if recipe is None else _Recipe(recipe)

    def unpack(packed):
        if isinstance(packed, _Recipe):
            with torch.no_grad():
                return packed.fn()
        return packed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield


class _Recipe:
    __slots__ = ("fn",)

    def __init__(self, fn: Callable[[], Tensor]) -> None:
        self.fn = fn
