"""Triton kernels and their launchers (imported only where they run: on CUDA, or under Triton's
interpreter on the CPU, which ``TRITON_INTERPRET=1`` selects when this module is first imported).

Every kernel reads rows of width ``D`` (contiguous, ``D <= BLOCK``, the tail masked), computes in
float32 and writes in the output's dtype. Row statistics live in a float32 ``(k, M)`` tensor: for
each norm its mean (zero for RMSNorm) and ``rstd``. Backward kernels walk a range of rows per
program and write per-program partial sums of the weight and bias gradients to ``(P, D)`` float32
buffers that the launcher sums. A loop's trip count is a constexpr (``ROWS`` rows a program, a power
of two; the rows past ``M`` skipped): a runtime bound in ``range`` compiles, but Triton 3.6's
interpreter cannot turn it into a Python int.
"""

import torch
import triton
import triton.language as tl
from torch import Tensor


# ---- pieces shared by the kernels --------------------------------------------------------------------
@triton.jit
def _normalise(v, mask, D, eps, IS_LN: tl.constexpr):
    """``(v - mean) * rstd`` (zero in the masked tail), the mean (0 for RMSNorm) and ``rstd``."""
    if IS_LN:
        mean = tl.sum(v, axis=0) / D
        c = tl.where(mask, v - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(c * c, axis=0) / D + eps)
    else:
        c = v
        rstd = 1.0 / tl.sqrt(tl.sum(c * c, axis=0) / D + eps)
        mean = rstd * 0.0
    return c * rstd, mean, rstd


@triton.jit
def _load_row(ptr, off, mask):
    return tl.load(ptr + off, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _param(ptr, cols, mask, PRESENT: tl.constexpr, fill):
    """A weight or bias row in float32, or ``fill`` everywhere when the norm has none."""
    if PRESENT:
        return tl.load(ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return tl.where(mask, fill, 0.0)


@triton.jit
def _recompute(v, mask, stats_ptr, k, M, row, IS_LN: tl.constexpr):
    """The normalised row of ``v`` from its saved mean (row ``k``) and rstd (row ``k + 1``)."""
    rstd = tl.load(stats_ptr + (k + 1) * M + row)
    if IS_LN:
        mean = tl.load(stats_ptr + k * M + row)
        return tl.where(mask, (v - mean) * rstd, 0.0), rstd
    return v * rstd, rstd


@triton.jit
def _norm_grad(g, vhat, rstd, w, mask, D, IS_LN: tl.constexpr):
    """The input gradient of a norm, ``rstd (g w - mean(g w) - vhat mean(g w vhat))`` (LayerNorm;
    RMSNorm without the mean of ``g w``), zero in the masked tail."""
    gw = g * w
    dot = tl.sum(gw * vhat, axis=0) / D
    if IS_LN:
        out = rstd * (gw - tl.sum(gw, axis=0) / D - vhat * dot)
    else:
        out = rstd * (gw - vhat * dot)
    return tl.where(mask, out, 0.0)


# ---- s = h + z; n = norm(s) --------------------------------------------------------------------------
@triton.jit
def _add_norm_fwd(h_ptr, z_ptr, w_ptr, b_ptr, s_ptr, n_ptr, stats_ptr, M, D, eps,
                  IS_LN: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    off = row * D + cols
    s = (_load_row(h_ptr, off, mask) + _load_row(z_ptr, off, mask)).to(s_ptr.dtype.element_ty)
    tl.store(s_ptr + off, s, mask=mask)
    shat, mean, rstd = _normalise(s.to(tl.float32), mask, D, eps, IS_LN)
    n = shat * _param(w_ptr, cols, mask, HAS_W, 1.0) + _param(b_ptr, cols, mask, HAS_B, 0.0)
    tl.store(n_ptr + off, n.to(n_ptr.dtype.element_ty), mask=mask)
    tl.store(stats_ptr + row, mean)
    tl.store(stats_ptr + M + row, rstd)


@triton.jit
def _add_norm_bwd(gs_ptr, gn_ptr, s_ptr, w_ptr, stats_ptr, ds_ptr, dw_ptr, db_ptr, M, D,
                  IS_LN: tl.constexpr, HAS_GS: tl.constexpr, HAS_W: tl.constexpr, NEED_W: tl.constexpr,
                  NEED_B: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    w = _param(w_ptr, cols, mask, HAS_W, 1.0)
    dw = tl.zeros((BLOCK,), tl.float32)
    db = tl.zeros((BLOCK,), tl.float32)
    start = pid.to(tl.int64) * ROWS
    for i in range(ROWS):
        row = start + i
        if row < M:
            off = row * D + cols
            shat, rstd = _recompute(_load_row(s_ptr, off, mask), mask, stats_ptr, 0, M, row, IS_LN)
            g = _load_row(gn_ptr, off, mask)
            ds = _norm_grad(g, shat, rstd, w, mask, D, IS_LN)
            if HAS_GS:
                ds += _load_row(gs_ptr, off, mask)
            tl.store(ds_ptr + off, ds.to(ds_ptr.dtype.element_ty), mask=mask)
            if NEED_W:
                dw += g * shat
            if NEED_B:
                db += g
    if NEED_W:
        tl.store(dw_ptr + pid.to(tl.int64) * D + cols, dw, mask=mask)
    if NEED_B:
        tl.store(db_ptr + pid.to(tl.int64) * D + cols, db, mask=mask)


# ---- SiameseNorm's update and entry ------------------------------------------------------------------
@triton.jit
def _entry_fwd(x_ptr, y_ptr, o_ptr, xw_ptr, xb_ptr, yw_ptr, yb_ptr, iw_ptr, ib_ptr,
               xo_ptr, y1_ptr, b_ptr, x1_ptr, stats_ptr, M, D, scale, eps,
               IS_LN: tl.constexpr, X_MODE: tl.constexpr, HAS_O: tl.constexpr,
               HAS_XW: tl.constexpr, HAS_XB: tl.constexpr, Y_NORM: tl.constexpr, HAS_YW: tl.constexpr,
               HAS_YB: tl.constexpr, IN_NORM: tl.constexpr, HAS_IW: tl.constexpr, HAS_IB: tl.constexpr,
               BLOCK: tl.constexpr):
    """X_MODE: 0 norm, 1 gain (``xw`` is gamma), 2 none. Stats rows: X, Y, in (mean, rstd each)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    off = row * D + cols
    x1 = _load_row(x_ptr, off, mask)
    if HAS_O:
        o = _load_row(o_ptr, off, mask)
        x1 = (x1 + scale * o).to(xo_ptr.dtype.element_ty)
        if X_MODE == 0:
            tl.store(x1_ptr + off, x1, mask=mask)
        else:
            tl.store(xo_ptr + off, x1, mask=mask)
        x1 = x1.to(tl.float32)
    if X_MODE == 0:
        xhat, mean, rstd = _normalise(x1, mask, D, eps, IS_LN)
        r = xhat * _param(xw_ptr, cols, mask, HAS_XW, 1.0) + _param(xb_ptr, cols, mask, HAS_XB, 0.0)
        tl.store(xo_ptr + off, r.to(xo_ptr.dtype.element_ty), mask=mask)
        tl.store(stats_ptr + row, mean)
        tl.store(stats_ptr + M + row, rstd)
    elif X_MODE == 1:
        r = x1 * _param(xw_ptr, cols, mask, True, 1.0)
    else:
        r = x1
    u = r
    if Y_NORM or HAS_O:
        y1 = _load_row(y_ptr, off, mask)
        if HAS_O:
            y1 = (y1 + o).to(y1_ptr.dtype.element_ty)
            tl.store(y1_ptr + off, y1, mask=mask)
            y1 = y1.to(tl.float32)
        if Y_NORM:
            yhat, mean, rstd = _normalise(y1, mask, D, eps, IS_LN)
            u += yhat * _param(yw_ptr, cols, mask, HAS_YW, 1.0) + _param(yb_ptr, cols, mask, HAS_YB, 0.0)
            tl.store(stats_ptr + 2 * M + row, mean)
            tl.store(stats_ptr + 3 * M + row, rstd)
    if IN_NORM:
        uhat, mean, rstd = _normalise(u, mask, D, eps, IS_LN)
        u = uhat * _param(iw_ptr, cols, mask, HAS_IW, 1.0) + _param(ib_ptr, cols, mask, HAS_IB, 0.0)
        tl.store(stats_ptr + 4 * M + row, mean)
        tl.store(stats_ptr + 5 * M + row, rstd)
    tl.store(b_ptr + off, u.to(b_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _entry_bwd(gxo_ptr, gy1_ptr, gb_ptr, x1_ptr, y1_ptr, xw_ptr, xb_ptr, yw_ptr, yb_ptr, iw_ptr, ib_ptr,
               stats_ptr, dx_ptr, dy_ptr, do_ptr, dxw_ptr, dxb_ptr, dyw_ptr, dyb_ptr, diw_ptr, dib_ptr,
               M, D, scale,
               IS_LN: tl.constexpr, X_MODE: tl.constexpr, HAS_O: tl.constexpr,
               HAS_GXO: tl.constexpr, HAS_GY1: tl.constexpr,
               HAS_XW: tl.constexpr, HAS_XB: tl.constexpr, Y_NORM: tl.constexpr, HAS_YW: tl.constexpr,
               HAS_YB: tl.constexpr, IN_NORM: tl.constexpr, HAS_IW: tl.constexpr, HAS_IB: tl.constexpr,
               WRITE_DY: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    """Recomputes ``u`` from ``x1``, ``y1`` and the saved statistics, then runs the chain back:
    ``b`` -> ``u`` -> (``LN^Y(y1)``, ``r``) -> ``x1``, ``y1`` -> ``x``, ``y``, ``o``."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < D
    xw = _param(xw_ptr, cols, mask, HAS_XW, 1.0)
    xb = _param(xb_ptr, cols, mask, HAS_XB, 0.0)
    yw = _param(yw_ptr, cols, mask, HAS_YW, 1.0)
    yb = _param(yb_ptr, cols, mask, HAS_YB, 0.0)
    iw = _param(iw_ptr, cols, mask, HAS_IW, 1.0)
    d_xw = tl.zeros((BLOCK,), tl.float32)
    d_xb = tl.zeros((BLOCK,), tl.float32)
    d_yw = tl.zeros((BLOCK,), tl.float32)
    d_yb = tl.zeros((BLOCK,), tl.float32)
    d_iw = tl.zeros((BLOCK,), tl.float32)
    d_ib = tl.zeros((BLOCK,), tl.float32)
    start = pid.to(tl.int64) * ROWS
    for i in range(ROWS):
        row = start + i
        if row < M:
            off = row * D + cols
            x1 = _load_row(x1_ptr, off, mask)
            if X_MODE == 0:
                xhat, x_rstd = _recompute(x1, mask, stats_ptr, 0, M, row, IS_LN)
                r = xhat * xw + xb
            elif X_MODE == 1:
                r = x1 * xw
            else:
                r = x1
            u = r
            if Y_NORM:
                yhat, y_rstd = _recompute(_load_row(y1_ptr, off, mask), mask, stats_ptr, 2, M, row, IS_LN)
                u += yhat * yw + yb
            du = _load_row(gb_ptr, off, mask)
            if IN_NORM:
                uhat, u_rstd = _recompute(u, mask, stats_ptr, 4, M, row, IS_LN)
                if HAS_IW:
                    d_iw += du * uhat
                if HAS_IB:
                    d_ib += du
                du = _norm_grad(du, uhat, u_rstd, iw, mask, D, IS_LN)
            dy = tl.zeros((BLOCK,), tl.float32)
            if Y_NORM:
                if HAS_YW:
                    d_yw += du * yhat
                if HAS_YB:
                    d_yb += du
                dy = _norm_grad(du, yhat, y_rstd, yw, mask, D, IS_LN)
            if HAS_GY1:
                dy += _load_row(gy1_ptr, off, mask)
            if X_MODE == 0:
                if HAS_GXO:
                    du += _load_row(gxo_ptr, off, mask)
                if HAS_XW:
                    d_xw += du * xhat
                if HAS_XB:
                    d_xb += du
                dx = _norm_grad(du, xhat, x_rstd, xw, mask, D, IS_LN)
            elif X_MODE == 1:
                d_xw += du * x1
                dx = du * xw
                if HAS_GXO:
                    dx += _load_row(gxo_ptr, off, mask)
            else:
                dx = du
                if HAS_GXO:
                    dx += _load_row(gxo_ptr, off, mask)
            tl.store(dx_ptr + off, dx.to(dx_ptr.dtype.element_ty), mask=mask)
            if WRITE_DY:
                tl.store(dy_ptr + off, dy.to(dy_ptr.dtype.element_ty), mask=mask)
            if HAS_O:
                tl.store(do_ptr + off, (scale * dx + dy).to(do_ptr.dtype.element_ty), mask=mask)
    part = pid.to(tl.int64) * D + cols
    if HAS_XW:
        tl.store(dxw_ptr + part, d_xw, mask=mask)
    if HAS_XB:
        tl.store(dxb_ptr + part, d_xb, mask=mask)
    if HAS_YW:
        tl.store(dyw_ptr + part, d_yw, mask=mask)
    if HAS_YB:
        tl.store(dyb_ptr + part, d_yb, mask=mask)
    if HAS_IW:
        tl.store(diw_ptr + part, d_iw, mask=mask)
    if HAS_IB:
        tl.store(dib_ptr + part, d_ib, mask=mask)


# ---- launchers ---------------------------------------------------------------------------------------
def _block(d: int) -> tuple[int, int]:
    """``BLOCK`` (the next power of two >= ``d``) and a number of warps for it."""
    block = triton.next_power_of_2(d)
    return block, min(max(block // 256, 1), 16)


def _wanted(t: Tensor) -> int:
    """How many programs a backward kernel's grid aims at on ``t``'s device: a few per SM on CUDA."""
    return 4 * torch.cuda.get_device_properties(t.device).multi_processor_count if t.is_cuda else 4


def _programs(t: Tensor, rows: int) -> tuple[int, int]:
    """Programs of a backward kernel and the rows each walks (:func:`_wanted` of them at most), a
    power of two: a constexpr of the kernel, so a few compiles cover every row count."""
    per = triton.next_power_of_2(triton.cdiv(rows, max(1, min(rows, _wanted(t)))))
    return triton.cdiv(rows, per), per


def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1]).contiguous()


def _partials(n: int, programs: int, d: int, like: Tensor) -> Tensor:
    return torch.empty((n, programs, d), dtype=torch.float32, device=like.device)


def _reduce(part: Tensor | None, like: Tensor | None, device: torch.device) -> Tensor:
    """A partial-sum buffer summed over programs, in ``like``'s dtype (empty where absent)."""
    if part is None or like is None:
        return torch.empty(0, device=device)
    return part.sum(0).to(like.dtype)


def add_norm_forward(h: Tensor, z: Tensor, weight: Tensor | None, bias: Tensor | None, layernorm: bool,
                     eps: float) -> tuple[Tensor, Tensor, Tensor]:
    d = h.shape[-1]
    dtype = torch.promote_types(h.dtype, z.dtype)
    s = torch.empty(h.shape, dtype=dtype, device=h.device)
    n = torch.empty_like(s)
    m = s.numel() // d if d else 0
    stats = torch.zeros((2, m), dtype=torch.float32, device=h.device)
    if m:
        block, warps = _block(d)
        _add_norm_fwd[(m,)](_rows(h), _rows(z), weight if weight is not None else s,
                            bias if bias is not None else s, s, n, stats, m, d, eps,
                            IS_LN=layernorm, HAS_W=weight is not None, HAS_B=bias is not None,
                            BLOCK=block, num_warps=warps)
    return s, n, stats


def add_norm_backward(gs: Tensor | None, gn: Tensor, s: Tensor, weight: Tensor | None, bias: Tensor | None,
                      stats: Tensor, layernorm: bool, need_w: bool,
                      need_b: bool) -> tuple[Tensor, Tensor, Tensor]:
    d = s.shape[-1]
    m = s.numel() // d if d else 0
    ds = torch.empty_like(s)
    need_w, need_b = need_w and weight is not None, need_b and bias is not None
    programs, per = _programs(s, max(m, 1))
    part = _partials(int(need_w) + int(need_b), programs, d, s)
    dw, db = (part[0] if need_w else None), (part[int(need_w)] if need_b else None)
    if m:
        block, warps = _block(d)
        _add_norm_bwd[(programs,)](_rows(gs) if gs is not None else s, _rows(gn), s,
                                   weight if weight is not None else s, stats, ds,
                                   dw if dw is not None else s, db if db is not None else s, m, d,
                                   IS_LN=layernorm, HAS_GS=gs is not None, HAS_W=weight is not None,
                                   NEED_W=need_w, NEED_B=need_b, ROWS=per, BLOCK=block, num_warps=warps)
    else:
        part.zero_()
    return ds, _reduce(dw, weight, s.device), _reduce(db, bias, s.device)


_X_MODES = {"norm": 0, "gain": 1, "none": 2}


def entry_forward(x: Tensor, y: Tensor, o: Tensor | None, scale: float, params: list[Tensor | None],
                  layernorm: bool, eps: float, x_mode: str, y_norm: bool, in_norm: bool,
                  b_dtype: torch.dtype | None = None):
    """``(xo, y1, b, x1, stats)``; see :func:`siamesenorm.kernels.ops.siamese_update_entry`."""
    d = x.shape[-1]
    has_o = o is not None
    x_dtype = x.dtype if o is None else torch.promote_types(x.dtype, o.dtype)
    y_dtype = y.dtype if o is None else torch.promote_types(y.dtype, o.dtype)
    dev = x.device

    def new(shape: bool, dtype: torch.dtype) -> Tensor:
        return torch.empty(x.shape if shape else (0,), dtype=dtype, device=dev)

    xo = new(x_mode == "norm" or has_o, x_dtype)
    y1 = new(has_o, y_dtype)
    b = new(True, b_dtype or torch.promote_types(x_dtype, y_dtype))
    x1 = new(has_o and x_mode == "norm", x_dtype)
    m = b.numel() // d if d else 0
    stats = torch.zeros((6, m), dtype=torch.float32, device=dev)
    if m:
        block, warps = _block(d)
        xw, xb, yw, yb, iw, ib = params
        _entry_fwd[(m,)](_rows(x), _rows(y), _rows(o) if has_o else b,
                         *(p if p is not None else b for p in params),
                         xo if xo.numel() else b, y1 if has_o else b, b, x1 if x1.numel() else b, stats,
                         m, d, float(scale), eps,
                         IS_LN=layernorm, X_MODE=_X_MODES[x_mode], HAS_O=has_o,
                         HAS_XW=xw is not None, HAS_XB=xb is not None, Y_NORM=y_norm,
                         HAS_YW=yw is not None, HAS_YB=yb is not None, IN_NORM=in_norm,
                         HAS_IW=iw is not None, HAS_IB=ib is not None, BLOCK=block, num_warps=warps)
    return xo, y1, b, x1, stats


def entry_backward(g_xo: Tensor | None, g_y1: Tensor | None, g_b: Tensor, x1: Tensor, y1: Tensor | None,
                   params: list[Tensor | None], stats: Tensor, has_o: bool, scale: float,
                   layernorm: bool, x_mode: str, y_norm: bool, in_norm: bool):
    """``(dx, dy, do, d_xw, d_xb, d_yw, d_yb, d_iw, d_ib)``, the first three in ``x1``'s dtype:
    ``dy`` is empty when ``y`` gets no gradient, ``do`` without ``o``, a parameter's gradient where
    it is absent. ``y1`` is needed with the Y norm only."""
    d = x1.shape[-1]
    m = x1.numel() // d if d else 0
    write_dy = y_norm or has_o
    dx = torch.empty(x1.shape, dtype=x1.dtype, device=x1.device)
    dy = torch.empty_like(dx) if write_dy else x1.new_empty(0)
    do = torch.empty_like(dx) if has_o else x1.new_empty(0)
    present = [p is not None for p in params]
    programs, per = _programs(x1, max(m, 1))
    part = _partials(sum(present), programs, d, x1)
    slots, k = [], 0
    for here in present:
        slots.append(part[k] if here else None)
        k += here
    if m:
        block, warps = _block(d)
        xw, xb, yw, yb, iw, ib = params
        _entry_bwd[(programs,)](_rows(g_xo) if g_xo is not None else dx,
                                _rows(g_y1) if g_y1 is not None else dx, _rows(g_b), _rows(x1),
                                _rows(y1) if y_norm else dx,
                                *(p if p is not None else dx for p in params), stats,
                                dx, dy if write_dy else dx, do if has_o else dx,
                                *(s if s is not None else dx for s in slots), m, d, float(scale),
                                IS_LN=layernorm, X_MODE=_X_MODES[x_mode], HAS_O=has_o,
                                HAS_GXO=g_xo is not None, HAS_GY1=g_y1 is not None,
                                HAS_XW=xw is not None, HAS_XB=xb is not None, Y_NORM=y_norm,
                                HAS_YW=yw is not None, HAS_YB=yb is not None, IN_NORM=in_norm,
                                HAS_IW=iw is not None, HAS_IB=ib is not None, WRITE_DY=write_dy,
                                ROWS=per, BLOCK=block, num_warps=warps)
    else:
        part.zero_()
    return (dx, dy, do, *(_reduce(s, p, x1.device) for s, p in zip(slots, params)))
