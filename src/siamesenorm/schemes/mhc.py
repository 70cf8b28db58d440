"""mHC: hyper-connections whose residual mixing is kept doubly stochastic (arXiv 2512.24880), with
DeepSeek-V4's form of it and mHC-lite's exact one (arXiv 2601.05732) as options."""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping
from contextlib import nullcontext
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from ..errors import UserError
from ..functional.mixing import mix_and_write
from ..nn.fused import _autocast_on, fused_enabled, recomputed_inputs
from ..nn.norms import RMSNorm
from .base import Branch, Number, OneOf, Option, register_scheme
from .hyper import MAX_STREAMS, MultiStreamScheme

try:
    from ..kernels.mix import mix_entry, mix_entry_kernel_runs, mix_write, mix_write_kernel_runs
    from ..kernels.rms_project import rms_project, rms_project_kernel_runs
    from ..kernels.sinkhorn import sinkhorn as sinkhorn_function
    from ..kernels.sinkhorn import sinkhorn_kernel_runs
except ImportError:     # the exported modelling code (siamesenorm.hf.export) carries no kernels
    from ..functional.sinkhorn import sinkhorn as sinkhorn_function

    def sinkhorn_kernel_runs(logits: Tensor, iters: int) -> bool:
        return False

    def mix_write_kernel_runs(res: Tensor, h: Tensor, post: Tensor, out: Tensor) -> bool:
        return False

    def mix_entry_kernel_runs(h: Tensor, pre: Tensor, kind: str) -> bool:
        return False

    def rms_project_kernel_runs(x: Tensor, w: Tensor) -> bool:
        return False

    mix_entry = mix_write = rms_project = None


def sinkhorn(logits: Tensor, iters: int) -> Tensor:
    """Sinkhorn-Knopp: ``exp(logits)`` with rows then columns rescaled to sum 1, ``iters`` times
    (a Triton kernel where it runs)."""
    if sinkhorn_kernel_runs(logits, iters):
        return torch.ops.siamesenorm.sinkhorn(logits, iters)
    m = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iters):
        m = m / m.sum(-1, keepdim=True)
        m = m / m.sum(-2, keepdim=True)
    return m


# mHC-lite mixes n! permutation matrices: 120 at n = 5, and phi_res grows as n * d * n!.
MAX_LITE_STREAMS = 5


def deepseek_v4_sinkhorn(logits: Tensor, iters: int, eps: float) -> Tensor:
    """DeepSeek-V4's mix ``C`` (..., n, n), as transformers' ``DeepseekV4HyperConnection`` has it."""
    m = torch.softmax(logits, -1) + eps
    m = m / (m.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(-1, keepdim=True) + eps)
        m = m / (m.sum(-2, keepdim=True) + eps)
    return m


def permutation_matrices(n: int, device=None, dtype=None) -> Tensor:
    """The ``n!`` permutation matrices as (n!, n*n), the identity first; ``P_r[j, perm_r(j)] = 1``."""
    index = torch.tensor(list(itertools.permutations(range(n))), device=device)
    return torch.eye(n, device=device, dtype=dtype)[index].flatten(-2)


@register_scheme
class ManifoldHyperConnections(MultiStreamScheme):
    """Manifold-constrained hyper-connections, mHC (DeepSeek-AI, arXiv 2512.24880).

    ``x_{l+1} = H^res x_l + H^post^T F(LN(H^pre x_l))`` over ``n_streams`` streams, the maps computed
    from ``RMSNorm(vec(x_l))``; ``H^res`` is made doubly stochastic by ``sinkhorn_iters`` Sinkhorn-Knopp
    steps. ``mixing="deepseek_v4"`` is DeepSeek-V4's released form, ``"lite"`` mHC-lite
    (arXiv 2601.05732); equations and initialisation: docs/schemes.md."""

    name = "mhc"
    role_norm_names = ("norm", "final_norm")
    summary = "H = SK(H_res) H + H_post^T F(LN(H_pre H)); out = LN(sum H)"
    paper = "DeepSeek-AI 2025, arXiv 2512.24880; mixing=lite: arXiv 2601.05732"
    options = {"n_streams": Option(4, Number(low=1, high=MAX_STREAMS, integer=True)),
               "sinkhorn_iters": Option(20, Number(low=1, high=1000, integer=True)),
               "mixing": Option("sinkhorn", OneOf(("sinkhorn", "deepseek_v4", "lite"))),
               "mix_eps": Option(1e-6, Number(low=0.0, high=1.0))}

    def __init__(self, dim: int, n_layers: int, **kwargs) -> None:
        super().__init__(dim, n_layers, **kwargs)
        n, s, kw = self.n_streams, self.n_sublayers, self._factory
        deepseek, lite = self.mixing == "deepseek_v4", self.mixing == "lite"
        n_res = math.factorial(n) if lite else n * n
        self.norm = self.make_branch_norms(s)
        self.final_norm = self.make_final_norm()
        self.stream_norm = nn.ModuleList(RMSNorm(n * dim, self.eps, affine=not deepseek, **kw)
                                         for _ in range(s))
        self.phi_pre = nn.Parameter(torch.empty(s, n * dim, n, **kw))
        self.phi_post = nn.Parameter(torch.empty(s, n * dim, n, **kw))
        self.phi_res = nn.Parameter(torch.empty(s, n * dim, n_res, **kw))
        self.alpha_pre = nn.Parameter(torch.empty(s, **kw))
        self.alpha_post = nn.Parameter(torch.empty(s, **kw))
        self.alpha_res = nn.Parameter(torch.empty(s, **kw))
        self.b_pre = nn.Parameter(torch.empty(s, n, **kw))
        self.b_post = nn.Parameter(torch.empty(s, n, **kw))
        self.b_res = nn.Parameter(torch.empty(s, n_res, **kw) if lite else torch.empty(s, n, n, **kw))
        if lite:    # constant 0/1 matrices, not in the state dict: reset_buffers derives them
            self.register_buffer("permutations", torch.empty(n_res, n * n, **kw), persistent=False)
        if deepseek:
            self.head_norm = RMSNorm(n * dim, self.eps, affine=False, **kw)
            self.head_phi = nn.Parameter(torch.empty(n * dim, n, **kw))
            self.head_alpha = nn.Parameter(torch.empty(1, **kw))
            self.head_b = nn.Parameter(torch.empty(n, **kw))
        self.reset_parameters()

    @classmethod
    def check_together(cls, options: Mapping[str, Any], dim: int | None = None) -> None:
        n = options.get("n_streams", 4)
        if options.get("mixing") == "lite" and n > MAX_LITE_STREAMS:
            raise UserError(f"scheme 'mhc': mixing='lite' mixes all n! permutation matrices and takes "
                            f"n_streams <= {MAX_LITE_STREAMS} (n_streams={n} needs {math.factorial(n)}); "
                            f"use fewer streams or mixing='sinkhorn'")

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Derive the constant buffers again, the parameters unchanged (after the meta device, or
        transformers' ``from_pretrained``, which leaves unsaved buffers empty)."""
        if self.mixing == "lite":
            p = self.permutations
            p.copy_(permutation_matrices(self.n_streams, p.device, p.dtype))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self.reset_buffers()
        n = self.n_streams
        with torch.no_grad():
            for p in (self.phi_pre, self.phi_post, self.phi_res, self.b_post):
                p.zero_()
            for p in (self.alpha_pre, self.alpha_post, self.alpha_res):
                p.fill_(0.01)
            self.b_pre.fill_(-2.0)
            for i in range(self.n_sublayers):
                self.b_pre[i, i % n] = 2.0
            if self.mixing == "lite":
                self.b_res.fill_(-8.0)
                self.b_res[:, 0] = 0.0                                 # the identity
            else:
                self.b_res.copy_(4.0 * torch.eye(n, device=self.b_res.device, dtype=self.b_res.dtype)
                                .expand_as(self.b_res))
            if self.mixing == "deepseek_v4":
                self.head_phi.zero_()
                self.head_alpha.fill_(0.01)
                self.head_b.zero_()

    # ---- the three maps --------------------------------------------------------------------------
    def _pre(self, logits: Tensor) -> Tensor:
        pre = torch.sigmoid(logits)
        return pre + self.mix_eps if self.mixing == "deepseek_v4" else pre

    def _res(self, z: Tensor, i: int, iterate) -> Tensor:
        """``H^res`` (..., n, n) from ``z = alpha_res * x' phi_res`` (without ``b_res``)."""
        n = self.n_streams
        if self.mixing == "lite":       # sum_r a_r P_r, elementwise: exact under autocast too
            coeff = torch.softmax(z + self.b_res[i], -1)
            return (coeff.unsqueeze(-1) * self.permutations).sum(-2).unflatten(-1, (n, n))
        logits = z.unflatten(-1, (n, n)) + self.b_res[i]
        if self.mixing == "deepseek_v4":
            return deepseek_v4_sinkhorn(logits, self.sinkhorn_iters, self.mix_eps).transpose(-1, -2)
        return iterate(logits, self.sinkhorn_iters)

    def _in_map_precision(self, fn, state: Tensor, i: int) -> tuple[Tensor, Tensor, Tensor]:
        """``fn(state, i)``; for ``deepseek_v4`` in float32 at least, ``H^post`` and ``H^res`` cast back to
        the state's dtype."""
        if self.mixing != "deepseek_v4":
            return fn(state, i)
        work = torch.promote_types(state.dtype, torch.float32)
        with torch.autocast(state.device.type, enabled=False) if _autocast_on(state) else nullcontext():
            pre, post, res = fn(state.to(work), i, work)
        return pre, post.to(state.dtype), res.to(state.dtype)

    def exit(self, state: Tensor) -> Tensor:
        if self.mixing != "deepseek_v4":
            return super().exit(state)
        work = torch.promote_types(state.dtype, torch.float32)
        x = self.head_norm(state.to(work).flatten(-2))
        pre = self._pre(self.head_alpha.to(work) * (x @ self.head_phi.to(work)) + self.head_b.to(work))
        total = (pre.unsqueeze(-1) * state).sum(-2).to(state.dtype)
        return total if self.final_norm is None else self.final_norm(total)

    def maps(self, state: Tensor, i: int) -> tuple[Tensor, Tensor, Tensor]:
        """``H^pre`` (..., n), ``H^post`` (..., n) and ``H^res`` (..., n, n) of sublayer i."""
        if torch.compiler.is_compiling():
            return self._in_map_precision(partial(self._fast_maps, iterate=sinkhorn), state, i)
        return self._in_map_precision(self._maps, state, i)

    def _maps(self, state: Tensor, i: int, work: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor]:
        def p(t: Tensor) -> Tensor:         # a parameter, in the maps' dtype
            return t if work is None else t.to(work)

        x = self.stream_norm[i](state.flatten(-2))
        pre = self._pre(p(self.alpha_pre[i]) * (x @ p(self.phi_pre[i])) + p(self.b_pre[i]))
        post = 2 * torch.sigmoid(p(self.alpha_post[i]) * (x @ p(self.phi_post[i])) + p(self.b_post[i]))
        z = p(self.alpha_res[i]) * (x @ p(self.phi_res[i]))
        return pre, post, self._res(z, i, sinkhorn)

    def fast_maps(self, state: Tensor, i: int) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`maps` with the three projections as one matmul (the stream norm's weight folded in) and
        Sinkhorn as one kernel or autograd function."""
        return self._in_map_precision(self._fast_maps, state, i)

    def _fast_maps(self, state: Tensor, i: int, work: torch.dtype | None = None,
                   iterate=sinkhorn_function) -> tuple[Tensor, Tensor, Tensor]:
        def p(t: Tensor) -> Tensor:         # a parameter, in the maps' dtype
            return t if work is None else t.to(work)

        n, norm = self.n_streams, self.stream_norm[i]
        flat = state.flatten(-2)
        phi = torch.cat([p(self.phi_pre[i]), p(self.phi_post[i]), p(self.phi_res[i])], -1)
        if norm.weight is not None:
            phi = phi * norm.weight.unsqueeze(-1)
        rstd = None
        if rms_project_kernel_runs(flat, phi):                      # x' phi: (..., 2n + n*n)
            dot = (torch.get_autocast_dtype(state.device.type) if _autocast_on(state)
                   else torch.promote_types(flat.dtype, phi.dtype))  # the dtype of flat @ phi below
            proj = rms_project(flat, phi, norm.eps, dot).to(torch.promote_types(dot, flat.dtype))
        else:
            square = torch.linalg.vector_norm(flat, 2, -1, keepdim=True).square() / flat.shape[-1]
            rstd = torch.rsqrt(square + norm.eps)
            proj = flat @ phi                                        # x' phi / rstd

        def scaled(lo: int, hi: int | None, alpha: Tensor) -> Tensor:
            return proj[..., lo:hi] * (p(alpha) if rstd is None else p(alpha) * rstd)

        pre = self._pre(scaled(0, n, self.alpha_pre[i]) + p(self.b_pre[i]))
        post = 2 * torch.sigmoid(scaled(n, 2 * n, self.alpha_post[i]) + p(self.b_post[i]))
        return pre, post, self._res(scaled(2 * n, None, self.alpha_res[i]), i, iterate)

    def _kernel_entry(self, state: Tensor, pre: Tensor, i: int, reference: bool) -> Tensor | None:
        """``LN_i(sum_k pre_k H_k)`` by one Triton kernel where it runs (else ``None``), in the dtype the
        PyTorch ops would give."""
        norm = self.norm[i]
        kind = getattr(norm, "kind", None)
        if not mix_entry_kernel_runs(state, pre, kind):
            return None
        autocast = _autocast_on(state)
        if state.is_cuda and autocast:
            dtype = torch.float32
        elif reference and self.mixing != "deepseek_v4":
            dtype = (torch.get_autocast_dtype(state.device.type) if autocast
                     else torch.promote_types(pre.dtype, state.dtype))
        else:
            dtype = state.dtype
        return mix_entry(state, pre, norm.weight, getattr(norm, "bias", None), kind=kind, eps=norm.eps,
                         dtype=dtype)

    def _entry(self, state: Tensor, i: int) -> tuple[Tensor, Tensor, Tensor]:
        """The branch input ``LN_i(sum_k pre_k H_k)``, ``H^post`` and ``H^res``."""
        pre, post, res = self.maps(state, i)
        inp = self._kernel_entry(state, pre, i, reference=True)
        if inp is not None:
            return inp, post, res
        if self.mixing == "deepseek_v4":                         # pre in float32, as DeepSeek's
            inp = (pre.unsqueeze(-1) * state).sum(-2).to(state.dtype)
        else:
            inp = (pre.unsqueeze(-2) @ state).squeeze(-2)        # sum_k pre_k H_k
        return self.norm[i](inp), post, res

    def _fast_entry(self, state: Tensor, i: int) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`_entry` from :meth:`fast_maps`, the norm's input recomputed in backward."""
        pre, post, res = self.fast_maps(state, i)
        inp = self._kernel_entry(state, pre, i, reference=False)
        if inp is not None:
            return inp, post, res

        def mixed() -> Tensor:
            return (pre.unsqueeze(-1) * state).sum(-2).to(state.dtype)   # sum_k pre_k H_k

        inp = mixed()
        with recomputed_inputs({id(inp): mixed}):
            return self.norm[i](inp), post, res

    def step(self, state: Tensor, i: int, branch: Branch) -> Tensor:
        # ``H^res H + H^post^T F`` is one Triton kernel each way where it runs (also under
        # ``torch.compile``), written in the dtype each path's PyTorch ops give.
        if not fused_enabled():                                      # the reference path
            inp, post, res = self._entry(state, i)
            out = branch(inp)
            if mix_write_kernel_runs(res, state, post, out):
                product = (torch.get_autocast_dtype(state.device.type) if _autocast_on(state)
                           else torch.promote_types(res.dtype, state.dtype))     # res @ state's
                dtype = torch.promote_types(product, torch.promote_types(post.dtype, out.dtype))
                return mix_write(res, state, post, out, dtype)
            return res @ state + post.unsqueeze(-1) * out.unsqueeze(-2)
        # Lean path: keeps H and the maps' per-token outputs; recomputes the branch norm's input.
        inp, post, res = self._fast_entry(state, i)
        out = branch(inp)
        if mix_write_kernel_runs(res, state, post, out):
            return mix_write(res, state, post, out, torch.promote_types(post.dtype, out.dtype))
        return mix_and_write(res.transpose(-1, -2), state, post, out)
