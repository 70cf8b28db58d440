"""mHC's fast path (one projection matmul, the Sinkhorn function, per-token stream mixing) against
a float64 reference of the paper's equations (arXiv 2512.24880), values and gradients, and its two
pieces against their plain compositions."""

from __future__ import annotations

import pytest
import torch

import siamesenorm as sn
from helpers import make_branches, randomize_
from siamesenorm.compute import use_path
from siamesenorm.functional.mixing import mix_and_write, stream_mix
from siamesenorm.functional.sinkhorn import sinkhorn

F64 = torch.float64
DIM, LAYERS, EPS = 8, 2, 1e-3
TOL = {"atol": 1e-6, "rtol": 1e-6}


def plain_sinkhorn(logits, iters):
    R = torch.exp(logits)
    for _ in range(iters):
        R = R / R.sum(-1, keepdim=True)
        R = R / R.sum(-2, keepdim=True)
    return R


def ref_mhc(s, h, branches, kind):
    """x_{l+1} = H^res x_l + H^post^T F(LN(H^pre x_l)), the maps from RMSNorm(vec(x_l))."""
    n = s.n_streams
    H = torch.stack([h] * n, -2)
    for i, branch in enumerate(branches):
        v = H.flatten(-2)
        x = v / torch.sqrt((v * v).mean(-1, keepdim=True) + EPS) * s.stream_norm[i].weight
        pre = torch.sigmoid(s.alpha_pre[i] * (x @ s.phi_pre[i]) + s.b_pre[i])
        post = 2 * torch.sigmoid(s.alpha_post[i] * (x @ s.phi_post[i]) + s.b_post[i])
        R = plain_sinkhorn(s.alpha_res[i] * (x @ s.phi_res[i]).unflatten(-1, (n, n)) + s.b_res[i],
                           s.sinkhorn_iters)
        u = sum(pre[..., k, None] * H[..., k, :] for k in range(n))
        if kind == "layernorm":
            u = (u - u.mean(-1, keepdim=True)) / torch.sqrt(u.var(-1, unbiased=False, keepdim=True) + EPS)
            u = u * s.norm[i].weight + s.norm[i].bias
        else:
            u = u / torch.sqrt((u * u).mean(-1, keepdim=True) + EPS) * s.norm[i].weight
        o = branch(u)
        H = torch.stack([sum(R[..., j, k, None] * H[..., k, :] for k in range(n)) + post[..., j, None] * o
                         for j in range(n)], -2)
    return H


@pytest.mark.parametrize("path", ["lean", "reference"])
@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("n, iters", [(4, 20), (3, 2), (2, 1)])
def test_mhc_equals_the_paper_values_and_gradients(n, iters, kind, path):
    s = sn.build_scheme("mhc", DIM, LAYERS, n_streams=n, sinkhorn_iters=iters, norm=kind, eps=EPS,
                        dtype=F64)
    randomize_(s, scale=0.5)
    with torch.no_grad():                    # dynamic parts that weigh (few iterations: unconverged)
        s.alpha_pre.fill_(0.7)
        s.alpha_post.fill_(-0.5)
        s.alpha_res.fill_(0.9)
    h = torch.randn(2, 3, DIM, dtype=F64, generator=torch.Generator().manual_seed(3)).requires_grad_()
    branches = make_branches(2 * LAYERS, DIM, seed=9)
    with use_path("reference" if path == "reference" else "kernels"):
        state = s.enter(h)
        for i, branch in enumerate(branches):
            state = s.step(state, i, branch)
    want = ref_mhc(s, h, branches, kind)
    torch.testing.assert_close(state, want, **TOL)
    weight = torch.randn(state.shape, dtype=F64, generator=torch.Generator().manual_seed(4))
    params = [h, *s.parameters()]
    got = torch.autograd.grad((state * weight).sum(), params, allow_unused=True)
    ref = torch.autograd.grad((want * weight).sum(), params, allow_unused=True)
    assert sum(g is not None for g in got) == len(params) - len(list(s.final_norm.parameters()))
    for g, r in zip(got, ref, strict=True):
        assert (g is None) == (r is None)
        if g is not None:
            torch.testing.assert_close(g, r, **TOL)


@pytest.mark.parametrize("n, iters", [(4, 20), (4, 3), (3, 1), (1, 2)])
def test_sinkhorn_function_is_the_iterations_written_out(n, iters):
    logits = (torch.randn(2, 5, n, n, dtype=F64) * 2).requires_grad_()
    weight = torch.randn(2, 5, n, n, dtype=F64)
    got, want = sinkhorn(logits, iters), plain_sinkhorn(logits, iters)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    g, r = (torch.autograd.grad((t * weight).sum(), logits)[0] for t in (got, want))
    torch.testing.assert_close(g, r, atol=1e-12, rtol=0)
    assert torch.autograd.gradcheck(lambda x: sinkhorn(x, iters), (logits.detach()[:1].requires_grad_(),))


@pytest.mark.parametrize("a_shape", [(2, 3, 4, 5), (4, 5), (2, 1, 4, 1)])
def test_stream_mix_is_the_per_token_matmul(a_shape):
    a = torch.randn(a_shape, dtype=F64, requires_grad=True)
    h = torch.randn(2, 3, 4, 6, dtype=F64, requires_grad=True)
    got, want = stream_mix(a, h), a.transpose(-1, -2) @ h
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    weight = torch.randn(want.shape, dtype=F64)
    for g, r in zip(torch.autograd.grad((got * weight).sum(), (a, h)),
                    torch.autograd.grad((want * weight).sum(), (a, h)), strict=True):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=0)


def test_mix_and_write_is_mix_plus_outer_product():
    a = torch.randn(2, 3, 4, 4, dtype=F64, requires_grad=True)
    h = torch.randn(2, 3, 4, 6, dtype=F64, requires_grad=True)
    beta = torch.randn(2, 3, 4, dtype=F64, requires_grad=True)
    out = torch.randn(2, 3, 6, dtype=F64, requires_grad=True)
    got = mix_and_write(a, h, beta, out)
    want = a.transpose(-1, -2) @ h + beta.unsqueeze(-1) * out.unsqueeze(-2)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)
    weight = torch.randn(want.shape, dtype=F64)
    for g, r in zip(torch.autograd.grad((got * weight).sum(), (a, h, beta, out)),
                    torch.autograd.grad((want * weight).sum(), (a, h, beta, out)), strict=True):
        torch.testing.assert_close(g, r, atol=1e-12, rtol=0)
