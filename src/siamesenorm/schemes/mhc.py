"""mHC: hyper-connections whose residual mixing is kept doubly stochastic (arXiv 2512.24880)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..nn.fused import fused_enabled, recomputed_inputs
from ..nn.mixing import mix_and_write
from ..nn.norms import RMSNorm
from .base import Branch, Number, Option, register_scheme
from .hyper import MAX_STREAMS, MultiStreamScheme

try:
    from ..kernels.sinkhorn import sinkhorn as sinkhorn_function
    from ..kernels.sinkhorn import sinkhorn_kernel_runs
except ImportError:     # the exported modelling code (siamesenorm.hf.export) carries no kernels
    from ..nn.sinkhorn import sinkhorn as sinkhorn_function

    def sinkhorn_kernel_runs(logits: Tensor, iters: int) -> bool:
        return False


def sinkhorn(logits: Tensor, iters: int) -> Tensor:
    """Sinkhorn-Knopp: ``exp(logits)`` with rows then columns rescaled to sum 1, ``iters`` times
    (the reference), or its Triton kernel where that runs (also under ``torch.compile``: one call
    in place of ``4 * iters`` kernels); the lean path runs :func:`siamesenorm.kernels.sinkhorn`."""
    if sinkhorn_kernel_runs(logits, iters):
        return torch.ops.siamesenorm.sinkhorn(logits, iters)
    m = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iters):
        m = m / m.sum(-1, keepdim=True)
        m = m / m.sum(-2, keepdim=True)
    return m


@register_scheme
class ManifoldHyperConnections(MultiStreamScheme):
    r"""Manifold-constrained hyper-connections, mHC (DeepSeek-AI, arXiv 2512.24880).

    ``x_{l+1} = H^res x_l + H^post^T F(H^pre x_l)`` over ``n = n_streams`` streams, the three maps
    computed from the normalised flattened state ``x' = RMSNorm(vec(x_l))``::

        H^pre  = sigmoid(a_pre * x' phi_pre + b_pre)          (1 x n)
        H^post = 2 sigmoid(a_post * x' phi_post + b_post)     (1 x n)
        H^res  = SinkhornKnopp(a_res * mat(x' phi_res) + b_res)   (n x n, doubly stochastic)

    with ``sinkhorn_iters`` Sinkhorn-Knopp iterations. The sublayer is Pre-Norm: ``F(LN(H^pre x))``;
    the output is ``LN_final(sum_k H_k)``. Initialisation (ours; the paper's exact values were not
    available): ``phi = 0``, ``a = 0.01``,
    ``b_pre`` = +2 on stream ``i mod n`` and -2 elsewhere (breaks the symmetry between streams, as
    HC's ``e_{i mod n}`` does), ``b_post = 0`` (``H^post = 1``), ``b_res`` = 4 on the diagonal
    (near-identity mixing). Parameters: ``norm[i]``, ``stream_norm[i]``, ``phi_pre``,
    ``phi_post``, ``phi_res``, ``alpha_pre``, ``alpha_post``, ``alpha_res``, ``b_pre``,
    ``b_post``, ``b_res``, ``final_norm``. ``branch_affine=False`` makes ``norm[i]`` non-affine
    (``stream_norm`` feeds the maps and stays affine); ``final_norm=False``: exit returns
    ``sum_k H_k``.
    """

    name = "mhc"
    role_norm_names = ("norm", "final_norm")
    summary = "H = SK(H_res) H + H_post^T F(LN(H_pre H)); out = LN(sum H)"
    paper = "DeepSeek-AI 2025, arXiv 2512.24880"
    options = {"n_streams": Option(4, Number(low=1, high=MAX_STREAMS, integer=True)),
               "sinkhorn_iters": Option(20, Number(low=1, high=1000, integer=True))}

    def __init__(self, dim: int, n_layers: int, **kwargs) -> None:
        super().__init__(dim, n_layers, **kwargs)
        n, s, kw = self.n_streams, self.n_sublayers, self._factory
        self.norm = self.make_branch_norms(s)
        self.final_norm = self.make_final_norm()
        self.stream_norm = nn.ModuleList(RMSNorm(n * dim, self.eps, **kw) for _ in range(s))
        self.phi_pre = nn.Parameter(torch.empty(s, n * dim, n, **kw))
        self.phi_post = nn.Parameter(torch.empty(s, n * dim, n, **kw))
        self.phi_res = nn.Parameter(torch.empty(s, n * dim, n * n, **kw))
        self.alpha_pre = nn.Parameter(torch.empty(s, **kw))
        self.alpha_post = nn.Parameter(torch.empty(s, **kw))
        self.alpha_res = nn.Parameter(torch.empty(s, **kw))
        self.b_pre = nn.Parameter(torch.empty(s, n, **kw))
        self.b_post = nn.Parameter(torch.empty(s, n, **kw))
        self.b_res = nn.Parameter(torch.empty(s, n, n, **kw))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        n = self.n_streams
        with torch.no_grad():
            for p in (self.phi_pre, self.phi_post, self.phi_res, self.b_post):
                p.zero_()
            for p in (self.alpha_pre, self.alpha_post, self.alpha_res):
                p.fill_(0.01)
            self.b_pre.fill_(-2.0)
            for i in range(self.n_sublayers):
                self.b_pre[i, i % n] = 2.0
            self.b_res.copy_(4.0 * torch.eye(n, device=self.b_res.device, dtype=self.b_res.dtype)
                            .expand_as(self.b_res))

    def maps(self, state: Tensor, i: int) -> tuple[Tensor, Tensor, Tensor]:
        """``H^pre`` (..., n), ``H^post`` (..., n) and ``H^res`` (..., n, n) of sublayer i."""
        n = self.n_streams
        x = self.stream_norm[i](state.flatten(-2))
        pre = torch.sigmoid(self.alpha_pre[i] * (x @ self.phi_pre[i]) + self.b_pre[i])
        post = 2 * torch.sigmoid(self.alpha_post[i] * (x @ self.phi_post[i]) + self.b_post[i])
        res_logits = self.alpha_res[i] * (x @ self.phi_res[i]).unflatten(-1, (n, n)) + self.b_res[i]
        return pre, post, sinkhorn(res_logits, self.sinkhorn_iters)

    def fast_maps(self, state: Tensor, i: int) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`maps` computed faster: the three projections as one matmul with the stream
        norm's weight folded in (``x' phi = rstd * (vec(x) (w * phi))``, so ``x'`` is never
        formed), and Sinkhorn as one Triton kernel or autograd function
        (:func:`siamesenorm.kernels.sinkhorn`)."""
        n, norm = self.n_streams, self.stream_norm[i]
        flat = state.flatten(-2)
        phi = torch.cat([self.phi_pre[i], self.phi_post[i], self.phi_res[i]], -1)
        if norm.weight is not None:
            phi = phi * norm.weight.unsqueeze(-1)
        square = torch.linalg.vector_norm(flat, 2, -1, keepdim=True).square() / flat.shape[-1]
        rstd = torch.rsqrt(square + norm.eps)
        proj = flat @ phi                                            # x' phi / rstd: (..., 2n + n*n)
        pre = torch.sigmoid(proj[..., :n] * (self.alpha_pre[i] * rstd) + self.b_pre[i])
        post = 2 * torch.sigmoid(proj[..., n:2 * n] * (self.alpha_post[i] * rstd) + self.b_post[i])
        res_logits = (proj[..., 2 * n:] * (self.alpha_res[i] * rstd)).unflatten(-1, (n, n)) + self.b_res[i]
        return pre, post, sinkhorn_function(res_logits, self.sinkhorn_iters)

    def _entry(self, state: Tensor, i: int) -> tuple[Tensor, Tensor, Tensor]:
        """The branch input ``LN_i(sum_k pre_k H_k)``, ``H^post`` and ``H^res`` (reference)."""
        pre, post, res = self.maps(state, i)
        inp = (pre.unsqueeze(-2) @ state).squeeze(-2)            # sum_k pre_k H_k
        return self.norm[i](inp), post, res

    def _fast_entry(self, state: Tensor, i: int) -> tuple[Tensor, Tensor, Tensor]:
        """:meth:`_entry` from :meth:`fast_maps`; the norm's input is not kept but recomputed from
        ``pre`` and ``H`` in backward (the maps' per-token outputs are kept instead)."""
        pre, post, res = self.fast_maps(state, i)

        def mixed() -> Tensor:
            return (pre.unsqueeze(-1) * state).sum(-2)              # sum_k pre_k H_k

        inp = mixed()
        with recomputed_inputs({id(inp): mixed}):
            return self.norm[i](inp), post, res

    def step(self, state: Tensor, i: int, branch: Branch) -> Tensor:
        if not fused_enabled():                                      # the reference path
            inp, post, res = self._entry(state, i)
            return res @ state + post.unsqueeze(-1) * branch(inp).unsqueeze(-2)
        # Lean path: keeps H and the maps' per-token outputs; recomputes the branch norm's input.
        inp, post, res = self._fast_entry(state, i)
        return mix_and_write(res.transpose(-1, -2), state, post, branch(inp))
