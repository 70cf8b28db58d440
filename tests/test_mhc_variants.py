"""mHC's ``mixing`` options: DeepSeek-V4's released form (``deepseek_v4``, checked against
transformers' ``DeepseekV4HyperConnection`` and ``DeepseekV4HyperHead`` and against the equations)
and mHC-lite (``lite``, arXiv 2601.05732: H^res a convex combination of the n! permutation
matrices). The references here are written from the equations and never call the scheme's
``enter``/``step``/``exit``, its maps or its norm modules."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import siamesenorm as sn
from helpers import cli_in_process, make_branches, randomize_
from siamesenorm.compute import use_path
from siamesenorm.models import LanguageModel, LMConfig

F64 = torch.float64
DIM, LAYERS, EPS, MIX_EPS = 8, 2, 1e-3, 1e-4


def rms(v, eps, weight=None):
    out = v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps)
    return out if weight is None else out * weight


def run(s, h, branches):
    state = s.enter(h)
    for i, branch in enumerate(branches):
        state = s.step(state, i, branch)
    return state, s.exit(state)


def perturbed(mixing: str, n: int, iters: int = 20, dtype=F64, **options):
    s = sn.build_scheme("mhc", DIM, LAYERS, n_streams=n, sinkhorn_iters=iters, mixing=mixing,
                        mix_eps=MIX_EPS, norm="rmsnorm", eps=EPS, dtype=dtype, **options)
    randomize_(s, scale=0.5)
    with torch.no_grad():                    # dynamic parts that weigh
        s.alpha_pre.fill_(0.7)
        s.alpha_post.fill_(-0.5)
        s.alpha_res.fill_(0.9)
        if mixing == "deepseek_v4":
            s.head_alpha.fill_(0.8)
    return s


def assert_values_and_gradients(s, h, branches, got, want):
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-10, rtol=1e-10)
    weight = torch.randn(got[0].shape, dtype=F64, generator=torch.Generator().manual_seed(4))
    loss_got = (got[0] * weight).sum() + got[1].square().sum()
    loss_want = (want[0] * weight).sum() + want[1].square().sum()
    params = [h, *s.parameters()]
    a = torch.autograd.grad(loss_got, params, allow_unused=True)
    b = torch.autograd.grad(loss_want, params, allow_unused=True)
    assert all(g is not None for g in a), "a parameter without a gradient"
    for g, w in zip(a, b, strict=True):
        torch.testing.assert_close(g, w, atol=1e-9, rtol=1e-9)


# ---- deepseek_v4: the equations --------------------------------------------------------------
def deepseek_mix(logits, iters, eps):
    """C: softmax over each row, + eps, columns / (sum + eps), then (iters - 1) x rows and columns."""
    C = torch.exp(logits) / torch.exp(logits).sum(-1, keepdim=True) + eps
    C = C / (C.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        C = C / (C.sum(-1, keepdim=True) + eps)
        C = C / (C.sum(-2, keepdim=True) + eps)
    return C


def ref_deepseek(s, h, branches, n, iters):
    """H' = C^T H + post^T F(LN(sum_k pre_k H_k)); out = LN(sum_k p_k H_k) (DeepSeek-V4's head)."""
    H = torch.stack([h] * n, -2)
    for i, branch in enumerate(branches):
        x = rms(H.flatten(-2), EPS)                                   # no weight
        pre = torch.sigmoid(s.alpha_pre[i] * (x @ s.phi_pre[i]) + s.b_pre[i]) + MIX_EPS
        post = 2 * torch.sigmoid(s.alpha_post[i] * (x @ s.phi_post[i]) + s.b_post[i])
        C = deepseek_mix(s.alpha_res[i] * (x @ s.phi_res[i]).unflatten(-1, (n, n)) + s.b_res[i],
                         iters, MIX_EPS)
        o = branch(rms(sum(pre[..., k, None] * H[..., k, :] for k in range(n)), EPS, s.norm[i].weight))
        H = torch.stack([sum(C[..., k, j, None] * H[..., k, :] for k in range(n)) + post[..., j, None] * o
                         for j in range(n)], -2)
    x = rms(H.flatten(-2), EPS)
    p = torch.sigmoid(s.head_alpha * (x @ s.head_phi) + s.head_b) + MIX_EPS
    return H, rms(sum(p[..., k, None] * H[..., k, :] for k in range(n)), EPS, s.final_norm.weight)


@pytest.mark.parametrize("path", ["lean", "reference"])
@pytest.mark.parametrize("n, iters", [(4, 20), (3, 2)])
def test_deepseek_v4_equals_its_equations(n, iters, path):
    s = perturbed("deepseek_v4", n, iters)
    assert s.stream_norm[0].weight is None and s.head_norm.weight is None
    h = torch.randn(2, 3, DIM, dtype=F64, generator=torch.Generator().manual_seed(3)).requires_grad_()
    branches = make_branches(2 * LAYERS, DIM, seed=9)
    with use_path("reference" if path == "reference" else "kernels"):
        got = run(s, h, branches)
    assert_values_and_gradients(s, h, branches, got, ref_deepseek(s, h, branches, n, iters))


# ---- deepseek_v4: transformers' modules with their weights mapped onto ours -------------------
@pytest.fixture(scope="module")
def deepseek_modules():
    pytest.importorskip("transformers")
    modeling = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
    from transformers import DeepseekV4Config

    config = DeepseekV4Config(hidden_size=DIM, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=MIX_EPS,
                              rms_norm_eps=EPS)
    return modeling, config


def mapped_scheme(modeling, config, seed: int = 0):
    """Two transformers HyperConnections (one block: attention, MLP), a HyperHead and branch norms
    with random weights, and our deepseek_v4 mHC holding the same numbers under its names."""
    n, g = config.hc_mult, torch.Generator().manual_seed(seed)
    hcs = [modeling.DeepseekV4HyperConnection(config) for _ in range(2)]
    head = modeling.DeepseekV4HyperHead(config)
    norms = [modeling.DeepseekV4RMSNorm(DIM, eps=EPS) for _ in range(2)]
    s = sn.build_scheme("mhc", DIM, 1, n_streams=n, sinkhorn_iters=config.hc_sinkhorn_iters,
                        mixing="deepseek_v4", mix_eps=config.hc_eps, norm="rmsnorm", eps=EPS)
    with torch.no_grad():
        for module in (*hcs, head, *norms):
            for p in module.parameters():
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
        for i, (hc, norm) in enumerate(zip(hcs, norms)):
            fn_pre, fn_post, fn_res = hc.fn.split([n, n, n * n])
            b_pre, b_post, b_res = hc.base.split([n, n, n * n])
            s.phi_pre[i].copy_(fn_pre.T)
            s.phi_post[i].copy_(fn_post.T)
            s.phi_res[i].copy_(fn_res.T)
            s.b_pre[i].copy_(b_pre)
            s.b_post[i].copy_(b_post)
            s.b_res[i].copy_(b_res.view(n, n))
            s.alpha_pre[i], s.alpha_post[i], s.alpha_res[i] = hc.scale
            s.norm[i].weight.copy_(norm.weight)
        s.head_phi.copy_(head.hc_fn.T)
        s.head_b.copy_(head.hc_base)
        s.head_alpha.copy_(head.hc_scale)
    return s, hcs, head, norms


@pytest.mark.parametrize("path", ["lean", "reference"])
def test_deepseek_v4_maps_and_stream_update_equal_transformers(deepseek_modules, path):
    modeling, config = deepseek_modules
    s, hcs, head, norms = mapped_scheme(modeling, config)
    state = torch.randn(2, 5, config.hc_mult, DIM, generator=torch.Generator().manual_seed(1))
    branch = torch.nn.Linear(DIM, DIM)
    tol = {"atol": 1e-6, "rtol": 1e-6}
    with torch.no_grad(), use_path("reference" if path == "reference" else "kernels"):
        for i, hc in enumerate(hcs):
            post, comb, collapsed = hc(state)
            pre, our_post, res = s.maps(state, i)
            torch.testing.assert_close(our_post, post, **tol)
            torch.testing.assert_close(res, comb.transpose(-1, -2), **tol)
            torch.testing.assert_close((pre.unsqueeze(-1) * state).sum(-2), collapsed, **tol)
            fast = s.fast_maps(state, i)
            for a, b in zip(fast, (pre, our_post, res)):
                torch.testing.assert_close(a, b, **tol)
            # DeepseekV4DecoderLayer: post * F(norm(collapsed)) + comb^T @ H
            theirs = post.unsqueeze(-1) * branch(norms[i](collapsed)).unsqueeze(-2) + \
                comb.transpose(-1, -2) @ state
            torch.testing.assert_close(s.step(state, i, branch), theirs, **tol)
        s.final_norm = None                        # DeepseekV4Model applies its norm after the head
        torch.testing.assert_close(s.exit(state), head(state), **tol)


def test_deepseek_v4_computes_its_maps_in_float32_for_bfloat16_streams(deepseek_modules):
    modeling, config = deepseek_modules
    s, hcs, _, _ = mapped_scheme(modeling, config, seed=2)
    state = torch.randn(2, 3, config.hc_mult, DIM, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        post, comb, collapsed = hcs[0](state.bfloat16())
        pre, our_post, res = s.maps(state.bfloat16(), 0)
    assert pre.dtype == torch.float32 and our_post.dtype == res.dtype == torch.bfloat16
    torch.testing.assert_close(our_post, post.to(torch.bfloat16), atol=0, rtol=0)
    torch.testing.assert_close(res, comb.transpose(-1, -2).to(torch.bfloat16), atol=0, rtol=0)
    mixed = (pre.unsqueeze(-1) * state.bfloat16()).sum(-2).to(torch.bfloat16)
    torch.testing.assert_close(mixed, collapsed, atol=0, rtol=0)


# ---- lite: the equations -----------------------------------------------------------------------
def permutation_matrix(perm):
    n = len(perm)
    P = torch.zeros(n, n, dtype=F64)
    for j in range(n):
        P[j, perm[j]] = 1.0
    return P


def ref_lite(s, h, branches, n):
    """H' = (sum_r a_r P_r) H + post^T F(LN(sum_k pre_k H_k)), a = softmax over the n! perms."""
    perms = [permutation_matrix(p) for p in itertools.permutations(range(n))]
    H = torch.stack([h] * n, -2)
    for i, branch in enumerate(branches):
        x = rms(H.flatten(-2), EPS, s.stream_norm[i].weight)
        pre = torch.sigmoid(s.alpha_pre[i] * (x @ s.phi_pre[i]) + s.b_pre[i])
        post = 2 * torch.sigmoid(s.alpha_post[i] * (x @ s.phi_post[i]) + s.b_post[i])
        logits = s.alpha_res[i] * (x @ s.phi_res[i]) + s.b_res[i]         # (..., n!)
        a = torch.exp(logits) / torch.exp(logits).sum(-1, keepdim=True)
        R = sum(a[..., r, None, None] * P for r, P in enumerate(perms))
        o = branch(rms(sum(pre[..., k, None] * H[..., k, :] for k in range(n)), EPS, s.norm[i].weight))
        H = torch.stack([sum(R[..., j, k, None] * H[..., k, :] for k in range(n)) + post[..., j, None] * o
                         for j in range(n)], -2)
    return H, rms(H.sum(-2), EPS, s.final_norm.weight)


@pytest.mark.parametrize("path", ["lean", "reference"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_lite_equals_its_equations(n, path):
    s = perturbed("lite", n)
    S = 2 * LAYERS
    assert s.phi_res.shape == (S, n * DIM, math.factorial(n)) and s.b_res.shape == (S, math.factorial(n))
    h = torch.randn(2, 3, DIM, dtype=F64, generator=torch.Generator().manual_seed(3)).requires_grad_()
    branches = make_branches(S, DIM, seed=9)
    with use_path("reference" if path == "reference" else "kernels"):
        got = run(s, h, branches)
    assert_values_and_gradients(s, h, branches, got, ref_lite(s, h, branches, n))


def test_lite_initialisation_is_the_official_codes():
    s = sn.build_scheme("mhc", DIM, LAYERS, mixing="lite", dtype=F64)
    want = torch.full((2 * LAYERS, 24), -8.0, dtype=F64)
    want[:, 0] = 0.0                                    # the identity permutation
    assert torch.equal(s.b_res.detach(), want) and torch.all(s.phi_res == 0)
    assert "permutations" not in s.state_dict()         # a constant, rebuilt on reset
    res = s.maps(s.enter(torch.randn(1, 2, DIM, dtype=F64)), 0)[2]
    # the identity (weight 1) and the 5 other permutations that fix a stream (weight e^-8 each)
    diagonal = (1 + 5 * math.exp(-8)) / (1 + 23 * math.exp(-8))
    torch.testing.assert_close(torch.diagonal(res, dim1=-2, dim2=-1),
                               torch.full((1, 2, 4), diagonal, dtype=F64), atol=1e-15, rtol=0)


@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("fast", [False, True])
def test_lite_mixing_is_exactly_doubly_stochastic(n, fast):
    s = sn.build_scheme("mhc", DIM, LAYERS, n_streams=n, mixing="lite", dtype=F64)
    with torch.no_grad():                  # logits far apart: Sinkhorn would leave a gap here
        s.phi_res.normal_(0.0, 3.0, generator=torch.Generator().manual_seed(0))
        s.alpha_res.fill_(5.0)
    state = torch.randn(4, 6, n, DIM, dtype=F64, generator=torch.Generator().manual_seed(1)) * 3
    res = (s.fast_maps if fast else s.maps)(state, 1)[2]
    ones = torch.ones(4, 6, n, dtype=F64)
    torch.testing.assert_close(res.sum(-1), ones, atol=1e-12, rtol=0)
    torch.testing.assert_close(res.sum(-2), ones, atol=1e-12, rtol=0)
    assert torch.all(res >= 0)


@pytest.mark.parametrize("mixing", ["lite", "deepseek_v4"])
def test_a_language_model_trains_with_each_mixing(mixing):
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, max_seq_len=16,
                                   scheme="mhc", scheme_options={"mixing": mixing}))
    ids = torch.randint(0, 61, (4, 12))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(5):
        opt.zero_grad()
        loss = model(ids, ids).loss
        loss.backward()
        missing = [n for n, p in model.named_parameters() if p.grad is None]
        assert not missing, missing
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


# ---- options, refusals, listing ---------------------------------------------------------------
def test_the_default_mixing_keeps_its_parameters():
    s = sn.build_scheme("mhc", DIM, LAYERS)
    assert s.mixing == "sinkhorn" and s.phi_res.shape[-1] == 16 and s.b_res.shape[-2:] == (4, 4)
    assert not any(k.startswith(("head_", "permutations")) for k in s.state_dict())
    assert s.stream_norm[0].weight is not None


def test_lite_with_too_many_streams_is_refused_in_one_line():
    with pytest.raises(sn.ConfigError) as err:
        sn.build_scheme("mhc", DIM, LAYERS, mixing="lite", n_streams=6)
    assert "\n" not in str(err.value) and "n_streams <= 5" in str(err.value)
    res = cli_in_process("train", "tiny", "model.scheme=mhc", "model.scheme_options.mixing=lite",
                         "model.scheme_options.n_streams=6", "train.steps=1")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "mixing='lite'" in res.stderr, res.stderr


def test_schemes_listing_shows_the_mixing_options():
    res = cli_in_process("schemes", "-v")
    assert res.returncode == 0
    assert "mixing='sinkhorn', mix_eps=1e-06" in res.stdout and "lite: arXiv 2601.05732" in res.stdout
