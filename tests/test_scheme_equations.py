"""Every residual scheme against a hand-written reference of its equations (docs/schemes.md).

The references below are written from the contract and the papers, independently of the
implementation: they never call a scheme's ``enter``/``step``/``exit`` nor its norm modules; they
only read the scheme's parameters by the names the contract gives them, and use their own LayerNorm
and RMSNorm. Every parameter is perturbed away from its initial value first, so a norm or a mixing
parameter used in the wrong place changes the output. Everything runs in float64.
"""

from __future__ import annotations

import math

import pytest
import torch

import siamesenorm
from siamesenorm.compute import use_path
from siamesenorm.schemes import build_scheme, list_schemes

F64 = torch.float64
DIM = 8
BATCH, SEQ = 2, 3
EPS = 1e-3  # far from the 1e-5 default, so a norm that ignores the scheme's eps shows up
TOL = {"atol": 1e-6, "rtol": 1e-6}
NORMS = ["layernorm", "rmsnorm", "dyt", "derf"]


@pytest.fixture(autouse=True, params=["lean", "reference", "compiled"])
def compute_path(request, monkeypatch):
    """Every test runs three times: on the memory-lean path (forced on, whatever SIAMESENORM_PATH
    says), on the reference path, the plain composition of modules (siamesenorm.nn.fused), and on
    what a graph being compiled computes (``torch.compiler.is_compiling()`` true: where a scheme
    rewrites its formulation for Inductor, mHC's and hyper-connections' maps)."""
    if request.param == "compiled":
        monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    with use_path("reference" if request.param == "reference" else "kernels"):
        yield request.param


# ---- own norms -------------------------------------------------------------------------------
def layernorm(x, weight, bias, eps):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)  # biased variance
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def rmsnorm(x, weight, eps):
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def dyt(x, alpha, weight, bias):
    """DyT, arXiv 2503.10622: ``gamma * tanh(alpha x) + beta`` (no eps)."""
    return weight * torch.tanh(alpha * x) + bias


def derf(x, alpha, s, weight, bias):
    """Derf, arXiv 2512.10938: ``gamma * erf(alpha x + s) + beta`` (no eps)."""
    return weight * torch.special.erf(alpha * x + s) + bias


def norm_fn(kind, eps):
    """N(module, x): the scheme's norm ``kind`` applied with ``module``'s parameters."""

    def apply(module, x):
        assert module is not None, "a norm the equations use is None"
        bias = getattr(module, "bias", None)
        if kind == "dyt":
            return dyt(x, module.alpha, 1.0 if module.weight is None else module.weight,
                       0.0 if bias is None else bias)
        if kind == "derf":
            return derf(x, module.alpha, module.shift, 1.0 if module.weight is None else module.weight,
                        0.0 if bias is None else bias)
        if kind == "layernorm":
            assert bias is not None, "an affine LayerNorm must have a bias"
            return layernorm(x, module.weight, bias, eps)
        assert bias is None, "RMSNorm has no bias"
        return rmsnorm(x, module.weight, eps)

    return apply


# ---- branches, inputs, parameters ---------------------------------------------------------------
class Branches:
    """Deterministic random nonlinear sublayers ``F_i(u) = tanh(u W_i) V_i``, one per sublayer."""

    def __init__(self, n, dim=DIM, seed=1234):
        g = torch.Generator().manual_seed(seed)
        scale = 1 / math.sqrt(dim)
        self.W = [torch.randn(dim, 2 * dim, generator=g, dtype=F64) * scale for _ in range(n)]
        self.V = [torch.randn(2 * dim, dim, generator=g, dtype=F64) * scale for _ in range(n)]
        self.calls = [0] * n

    def ref(self, i):
        return lambda u: torch.tanh(u @ self.W[i]) @ self.V[i]

    def counted(self, i):
        def f(u):
            self.calls[i] += 1
            assert u.shape[-1] == DIM
            return torch.tanh(u @ self.W[i]) @ self.V[i]

        return f


def make_input(seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(BATCH, SEQ, DIM, generator=g, dtype=F64) * 1.5 + 0.3


def make(name, n_layers, norm="layernorm", **options):
    s = build_scheme(name, DIM, n_layers, norm=norm, eps=EPS, dtype=F64, **options)
    assert s.n_sublayers == 2 * n_layers
    assert s.eps == EPS
    for p in s.parameters():
        assert p.dtype == F64
    return s


@torch.no_grad()
def randomize(s, seed=99, scale=0.5):
    """Perturb every parameter from its initial value (norm weights stay around 1)."""
    g = torch.Generator().manual_seed(seed)
    for p in s.parameters():
        p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * scale)


def run(s, h, br):
    """The model loop, checking that each branch is called exactly once per step."""
    h0 = h.clone()
    state = s.enter(h)
    for i in range(s.n_sublayers):
        before = list(br.calls)
        state = s.step(state, i, br.counted(i))
        assert br.calls[i] == before[i] + 1, f"branch {i} called {br.calls[i] - before[i]} times"
        assert all(br.calls[j] == before[j] for j in range(len(br.calls)) if j != i)
    out = s.exit(state)
    torch.testing.assert_close(h, h0, atol=0, rtol=0)  # the input is not modified in place
    assert out.shape == h.shape and out.dtype == F64
    return state, out


def close(actual, expected):
    torch.testing.assert_close(actual, expected, **TOL)


def absent(s, attr):
    return getattr(s, attr, None) is None


# ---- registry and requirements ---------------------------------------------------------------
ALL = ["pre", "post", "siamese", "hybridnorm", "spannorm", "resi_dual", "deepnorm", "keel", "mix_ln",
       "peri_ln", "lns", "hyper", "mhc", "attn_res"]


def test_registry_lists_every_scheme():
    assert set(ALL) <= set(list_schemes())
    assert siamesenorm.build_scheme is build_scheme
    assert siamesenorm.list_schemes is list_schemes


@pytest.mark.parametrize("name,options,qkv_all", [
    ("pre", {}, False), ("post", {}, False), ("post", {"final_norm": True}, False),
    ("siamese", {}, False), ("siamese", {"form": "post_pre", "topology": "single"}, False),
    ("siamese", {"form": "hybrid_pre"}, True),
    ("siamese", {"form": "hybrid_pre", "topology": "single"}, True),
    ("siamese", {"form": "hybrid_pre", "topology": "resi_dual"}, True),
    ("hybridnorm", {}, True), ("hybridnorm", {"first_layer_pre": True}, True),
    ("spannorm", {}, False), ("resi_dual", {}, False), ("deepnorm", {}, False),
    ("keel", {}, False), ("mix_ln", {}, False), ("peri_ln", {}, False), ("lns", {}, False),
    ("hyper", {}, False),
    ("mhc", {}, False), ("attn_res", {}, False), ("attn_res", {"block_size": 2}, False),
])
def test_requires_qkv_norm_blocks(name, options, qkv_all):
    n_layers = 3
    s = make(name, n_layers, **options)
    expected = frozenset(range(n_layers)) if qkv_all else frozenset()
    assert frozenset(s.requires.qkv_norm_blocks) == expected
    if name != "deepnorm":
        assert s.requires.init is None
        assert s.requires.branch_gain == 1.0


# ---- pre / post ------------------------------------------------------------------------------
@pytest.mark.parametrize("norm", NORMS)
def test_pre(norm):
    s = make("pre", 3, norm)
    randomize(s)
    N, h, br = norm_fn(norm, EPS), make_input(), Branches(6)
    state, out = run(s, h, br)

    x = h
    for i in range(6):
        x = x + br.ref(i)(N(s.pre_norm[i], x))
    close(state, x)
    close(out, N(s.final_norm, x))


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("final_norm", [False, True])
def test_post(norm, final_norm):
    s = make("post", 3, norm, final_norm=final_norm)
    randomize(s)
    N, h, br = norm_fn(norm, EPS), make_input(), Branches(6)
    state, out = run(s, h, br)

    x = h
    for i in range(6):
        x = N(s.post_norm[i], x + br.ref(i)(x))
    close(state, x)
    close(out, N(s.final_norm, x) if final_norm else x)


# ---- siamese ---------------------------------------------------------------------------------
def ref_siamese(s, N, h, F, *, form, input_norm, depth_scale, merge, topology):
    """docs/schemes.md "siamese": papers.md 1.3 (a) DeiT for post_pre, (c) OLMo for hybrid_pre."""
    two_inputs = topology == "siamese"  # Y feeds the branch input
    keep_y = topology != "single"  # Y is carried at all
    X, Y = h, h
    for i in range(2 * s.n_layers):
        b = i // 2
        c = math.sqrt(2 * (b + 1)) if depth_scale else 1.0
        if form == "post_pre":
            X = N(s.post_norm[i], X)
            u = X + N(s.pre_norm[i], Y) if two_inputs else X
            out = F[i](N(s.input_norm[i], u) if input_norm else u)
            X = X + out / c
            if keep_y:
                Y = Y + out
        elif i % 2 == 0:  # hybrid_pre, attention
            u = X * s.x_gain[b]
            if two_inputs:
                u = u + N(s.pre_norm[i], Y)
            A = F[i](u)
            X = X + A / c
            if keep_y:
                Y = Y + A
        else:  # hybrid_pre, MLP
            Xn = N(s.post_norm[b], X)
            u = Xn + N(s.pre_norm[i], Y) if two_inputs else Xn
            M = F[i](N(s.input_norm[b], u) if input_norm else u)
            X = Xn + M / c
            if keep_y:
                Y = Y + M
    if topology == "single":
        return (X, None), N(s.merge_norm_x, X)
    merged = N(s.merge_norm_x, X) + N(s.merge_norm_y, Y)
    return (X, Y), (N(s.final_norm, merged) if merge == "normed_sum" else merged)


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("topology", ["siamese", "single", "resi_dual"])
@pytest.mark.parametrize("merge", ["normed_sum", "sum"])
@pytest.mark.parametrize("depth_scale", [True, False])
@pytest.mark.parametrize("input_norm", [True, False])
@pytest.mark.parametrize("form", ["post_pre", "hybrid_pre"])
def test_siamese(form, input_norm, depth_scale, merge, topology, norm):
    opts = dict(form=form, input_norm=input_norm, depth_scale=depth_scale, merge=merge,
                topology=topology)
    s = make("siamese", 3, norm, **opts)
    n_layers = 3
    # structure stated by the contract
    per_sublayer, per_block = 2 * n_layers, n_layers
    if form == "post_pre":
        assert len(s.post_norm) == per_sublayer
        if input_norm:
            assert len(s.input_norm) == per_sublayer
    else:
        assert len(s.post_norm) == per_block
        if input_norm:
            assert len(s.input_norm) == per_block
        assert len(s.x_gain) == per_block
        for g in s.x_gain:  # x_gain starts at 1
            assert g.shape == (DIM,)
            torch.testing.assert_close(g.detach(), torch.ones(DIM, dtype=F64), atol=0, rtol=0)
    if not input_norm:
        assert s.input_norm is None
    if topology == "siamese":
        assert len(s.pre_norm) == per_sublayer
    else:
        assert absent(s, "pre_norm")
    if topology == "single":
        assert absent(s, "merge_norm_y") and absent(s, "final_norm")

    randomize(s)
    N, h, br = norm_fn(norm, EPS), make_input(), Branches(6)
    state, out = run(s, h, br)
    (X, Y), expected = ref_siamese(s, N, h, [br.ref(i) for i in range(6)], **opts)

    close(out, expected)
    close(state[0], X)
    if topology == "single":
        assert state[1] is None
        assert len(s.streams(state)) == 1
        close(next(iter(s.streams(state).values())), X)
    else:
        close(state[1], Y)
        assert len(s.streams(state)) == 2


def test_siamese_defaults():
    """Default options: post_pre, input_norm, depth_scale, normed_sum, siamese topology."""
    s = make("siamese", 2)
    randomize(s)
    N, h, br = norm_fn("layernorm", EPS), make_input(), Branches(4)
    _, out = run(s, h, br)
    _, expected = ref_siamese(s, N, h, [br.ref(i) for i in range(4)], form="post_pre",
                              input_norm=True, depth_scale=True, merge="normed_sum",
                              topology="siamese")
    close(out, expected)


# ---- hybridnorm ------------------------------------------------------------------------------
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("first_layer_pre", [False, True])
def test_hybridnorm(first_layer_pre, norm):
    s = make("hybridnorm", 3, norm, first_layer_pre=first_layer_pre)
    assert len(s.ffn_norm) == 3
    if not first_layer_pre:
        assert absent(s, "attn_norm")
    randomize(s)
    N, h, br = norm_fn(norm, EPS), make_input(), Branches(6)
    state, out = run(s, h, br)

    x = h
    for i in range(6):
        b, F = i // 2, br.ref(i)
        star = b == 0 and first_layer_pre
        if i % 2 == 0:
            x = x + F(N(s.attn_norm, x)) if star else x + F(x)
        elif star:
            x = x + F(N(s.ffn_norm[0], x))
        else:
            xn = N(s.ffn_norm[b], x)
            x = xn + F(xn)
    close(state, x)
    close(out, N(s.final_norm, x))


# ---- spannorm --------------------------------------------------------------------------------
@pytest.mark.parametrize("norm", NORMS)
def test_spannorm(norm):
    s = make("spannorm", 3, norm)
    assert len(s.attn_norm) == 3 and len(s.ffn_norm) == 3
    randomize(s)
    N, h, br = norm_fn(norm, EPS), make_input(), Branches(6)
    state, out = run(s, h, br)

    x = h
    for b in range(3):
        a_in = N(s.initial_norm, x) if b == 0 else x
        y = N(s.attn_norm[b], x + br.ref(2 * b)(a_in))
        x = N(s.ffn_norm[b], x + br.ref(2 * b + 1)(y))
    close(state[0], x)
    close(out, x)


# ---- resi_dual -------------------------------------------------------------------------------
@pytest.mark.parametrize("norm", NORMS)
def test_resi_dual(norm):
    s = make("resi_dual", 3, norm)
    randomize(s)
    N, h, br = norm_fn(norm, EPS), make_input(), Branches(6)
    state, out = run(s, h, br)

    xa, xd = h, h
    for i in range(6):
        o = br.ref(i)(xa)
        xa = N(s.post_norm[i], xa + o)
        xd = xd + o
    close(state[0], xa)
    close(state[1], xd)
    close(out, xa + N(s.dual_norm, xd))


# ---- deepnorm --------------------------------------------------------------------------------
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("arch", ["decoder", "encoder"])
@pytest.mark.parametrize("n_layers", [2, 3])
def test_deepnorm(arch, n_layers, norm):
    s = make("deepnorm", n_layers, norm, arch=arch)
    M = n_layers  # decoder: (2M)^(1/4), (8M)^(-1/4); encoder-only: the same with N = n_layers
    alpha, beta = (2 * M) ** 0.25, (8 * M) ** -0.25
    assert float(s.alpha) == pytest.approx(alpha, rel=1e-12)
    assert float(s.beta) == pytest.approx(beta, rel=1e-12)
    assert s.requires.init == "xavier"
    assert s.requires.branch_gain == pytest.approx(beta, rel=1e-12)
    assert s.requires.qkv_norm_blocks == frozenset()

    randomize(s)
    N, h, br = norm_fn(norm, EPS), make_input(), Branches(2 * n_layers)
    state, out = run(s, h, br)
    x = h
    for i in range(2 * n_layers):
        x = N(s.post_norm[i], alpha * x + br.ref(i)(x))
    close(state, x)
    close(out, x)


def test_deepnorm_explicit_alpha_beta():
    s = make("deepnorm", 3, alpha=1.7, beta=0.3)
    assert float(s.alpha) == 1.7 and float(s.beta) == 0.3
    assert s.requires.branch_gain == 0.3
    randomize(s)
    N, h, br = norm_fn("layernorm", EPS), make_input(), Branches(6)
    _, out = run(s, h, br)
    x = h
    for i in range(6):
        x = N(s.post_norm[i], 1.7 * x + br.ref(i)(x))
    close(out, x)


# ---- keel --------------------------------------------------------------------------------------
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("options", [{}, {"alpha": 1.5}, {"final_norm": True}])
def test_keel(norm, options):
    # arXiv 2601.19895: x_{l+1} = LN_1(alpha x_l + F_l(LN_2(x_l))), alpha = L sublayers by default
    s = make("keel", 3, norm, **options)
    alpha = options.get("alpha", 6)
    assert s.alpha == alpha and s.requires == siamesenorm.SchemeRequirements()
    randomize(s)
    N, h, br = norm_fn(norm, EPS), make_input(), Branches(6)
    state, out = run(s, h, br)
    x = h
    for i in range(6):
        x = N(s.post_norm[i], alpha * x + br.ref(i)(N(s.pre_norm[i], x)))
    close(state, x)
    close(out, N(s.final_norm, x) if options.get("final_norm") else x)


# ---- mix_ln ----------------------------------------------------------------------------------
@pytest.mark.parametrize("post_fraction,n_layers,n_post", [
    (0.25, 4, 1), (0.25, 3, 0), (0.25, 8, 2), (0.5, 2, 1), (0.5, 3, 1), (0.5, 4, 2),
    (0.75, 3, 2), (1.0, 2, 2), (0.0, 2, 0),
])
def test_mix_ln_n_post(post_fraction, n_layers, n_post):
    s = make("mix_ln", n_layers, post_fraction=post_fraction)
    assert s.n_post == n_post == math.floor(post_fraction * n_layers)
    assert (s.final_norm is None) == (n_post == n_layers)


def test_mix_ln_default_fraction():
    assert make("mix_ln", 8).n_post == 2  # post_fraction defaults to 0.25


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("post_fraction,n_layers", [
    (0.5, 2), (0.5, 3), (0.5, 4), (0.25, 4), (1.0, 2), (0.0, 2),
])
def test_mix_ln(post_fraction, n_layers, norm):
    s = make("mix_ln", n_layers, norm, post_fraction=post_fraction)
    n_post = math.floor(post_fraction * n_layers)
    randomize(s)
    N, h, br = norm_fn(norm, EPS), make_input(), Branches(2 * n_layers)
    state, out = run(s, h, br)

    x = h
    for i in range(2 * n_layers):
        F = br.ref(i)
        x = N(s.norm[i], x + F(x)) if i // 2 < n_post else x + F(N(s.norm[i], x))
    close(state, x)
    close(out, N(s.final_norm, x) if n_post < n_layers else x)


# ---- peri_ln ---------------------------------------------------------------------------------
@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("embed_norm, input_norm", [(False, True), (True, True), (False, False)])
def test_peri_ln(embed_norm, input_norm, norm):
    """``input_norm=False``: OLMo2's reordered norm, ``x + LN^out(F(x))``."""
    s = make("peri_ln", 3, norm, embed_norm=embed_norm, input_norm=input_norm)
    if not embed_norm:
        assert s.embed_norm is None
    assert (s.input_norm is None) is not input_norm
    randomize(s)
    N, h, br = norm_fn(norm, EPS), make_input(), Branches(6)
    state, out = run(s, h, br)

    x = N(s.embed_norm, h) if embed_norm else h
    for i in range(6):
        u = N(s.input_norm[i], x) if input_norm else x
        x = x + N(s.output_norm[i], br.ref(i)(u))
    close(state, x)
    close(out, N(s.final_norm, x))


# ---- lns -------------------------------------------------------------------------------------
@pytest.mark.parametrize("norm", NORMS)
def test_lns(norm):
    s = make("lns", 3, norm)
    randomize(s)
    N, h, br = norm_fn(norm, EPS), make_input(), Branches(6)
    state, out = run(s, h, br)

    x = h
    for i in range(6):
        x = x + br.ref(i)(N(s.pre_norm[i], x) / math.sqrt(i // 2 + 1))
    close(state, x)
    close(out, N(s.final_norm, x))


# ---- hyper -----------------------------------------------------------------------------------
def copies(h, n):
    return torch.stack([h] * n, dim=-2)  # (..., n, d)


def ref_hyper(s, N, h, F, n, dynamic):
    H = copies(h, n)
    for i in range(2 * s.n_layers):
        A, B = s.static_alpha[i], s.static_beta[i]  # (n, n+1), (n,)
        if dynamic:
            Hn = N(s.dyn_norm[i], H)  # (..., n, d)
            A = A + s.alpha_scale[i] * torch.tanh(Hn @ s.alpha_proj[i])  # (..., n, n+1)
            B = B + s.beta_scale[i] * torch.tanh(Hn @ s.beta_proj[i])  # (..., n)
        A = A.expand(*H.shape[:-2], n, n + 1)
        B = B.expand(*H.shape[:-2], n)
        mix = [sum(A[..., k, j, None] * H[..., k, :] for k in range(n)) for j in range(n + 1)]
        o = F[i](N(s.norm[i], mix[0]))
        H = torch.stack([B[..., k, None] * o + mix[k + 1] for k in range(n)], dim=-2)
    return H, N(s.final_norm, H.sum(-2))


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("dynamic", [True, False])
@pytest.mark.parametrize("n_streams", [1, 2, 3])
def test_hyper(n_streams, dynamic, norm):
    n, S = n_streams, 6
    s = make("hyper", 3, norm, n_streams=n, dynamic=dynamic)
    # initial values (contract)
    sa = s.static_alpha.detach()
    assert sa.shape == (S, n, n + 1)
    for i in range(S):
        e = torch.zeros(n, dtype=F64)
        e[i % n] = 1
        torch.testing.assert_close(sa[i, :, 0], e, atol=0, rtol=0)
        torch.testing.assert_close(sa[i, :, 1:], torch.eye(n, dtype=F64), atol=0, rtol=0)
    torch.testing.assert_close(s.static_beta.detach(), torch.ones(S, n, dtype=F64), atol=0, rtol=0)
    if dynamic:
        assert s.alpha_proj.shape == (S, DIM, n + 1) and s.beta_proj.shape == (S, DIM)
        assert torch.all(s.alpha_proj == 0) and torch.all(s.beta_proj == 0)
        torch.testing.assert_close(s.alpha_scale.detach(), torch.full((S,), 0.01, dtype=F64))
        torch.testing.assert_close(s.beta_scale.detach(), torch.full((S,), 0.01, dtype=F64))
    else:
        for attr in ("dyn_norm", "alpha_proj", "beta_proj", "alpha_scale", "beta_scale"):
            assert absent(s, attr), attr

    randomize(s)
    if dynamic:  # make the dynamic part weigh clearly
        with torch.no_grad():
            s.alpha_scale.copy_(torch.linspace(0.3, 0.8, S, dtype=F64))
            s.beta_scale.copy_(torch.linspace(-0.7, 0.5, S, dtype=F64))
    N, h, br = norm_fn(norm, EPS), make_input(), Branches(S)
    state, out = run(s, h, br)
    H, expected = ref_hyper(s, N, h, [br.ref(i) for i in range(S)], n, dynamic)
    assert state.shape == (BATCH, SEQ, n, DIM)
    close(state, H)
    close(out, expected)


@pytest.mark.parametrize("dynamic", [True, False])
def test_hyper_init_is_pre_norm_on_copies(dynamic):
    """papers.md section 4: at initialisation every stream follows the Pre-Norm trajectory."""
    n = 2
    s = make("hyper", 2, n_streams=n, dynamic=dynamic)
    h, br = make_input(), Branches(4)
    state = s.enter(h)
    close(state, copies(h, n))
    for i in range(4):
        state = s.step(state, i, br.counted(i))
    x = h
    for i in range(4):
        x = x + br.ref(i)(layernorm(x, 1.0, 0.0, EPS))
    close(state, copies(x, n))


# ---- mhc -------------------------------------------------------------------------------------
def sinkhorn(logits, iters):
    R = torch.exp(logits)
    for _ in range(iters):
        R = R / R.sum(-1, keepdim=True)  # rows
        R = R / R.sum(-2, keepdim=True)  # columns
    return R


def ref_mhc(s, N, h, F, n, iters):
    H = copies(h, n)
    for i in range(2 * s.n_layers):
        x = rmsnorm(H.flatten(-2), s.stream_norm[i].weight, s.eps)  # (..., n*d)
        pre = torch.sigmoid(s.alpha_pre[i] * (x @ s.phi_pre[i]) + s.b_pre[i])
        post = 2 * torch.sigmoid(s.alpha_post[i] * (x @ s.phi_post[i]) + s.b_post[i])
        logits = s.alpha_res[i] * (x @ s.phi_res[i]).unflatten(-1, (n, n)) + s.b_res[i]
        R = sinkhorn(logits, iters)  # (..., n, n)
        o = F[i](N(s.norm[i], sum(pre[..., k, None] * H[..., k, :] for k in range(n))))
        H = torch.stack([sum(R[..., j, k, None] * H[..., k, :] for k in range(n))
                         + post[..., j, None] * o for j in range(n)], dim=-2)
    return H, N(s.final_norm, H.sum(-2))


@pytest.mark.parametrize("norm", NORMS)
@pytest.mark.parametrize("n_streams,iters", [(2, 20), (4, 20), (2, 3)])
def test_mhc(n_streams, iters, norm):
    n, S = n_streams, 6
    opts = {"n_streams": n} if iters == 20 else {"n_streams": n, "sinkhorn_iters": iters}
    s = make("mhc", 3, norm, **opts)
    # initial values (contract)
    assert s.phi_pre.shape == (S, n * DIM, n) and s.phi_post.shape == (S, n * DIM, n)
    assert s.phi_res.shape == (S, n * DIM, n * n)
    for name in ("phi_pre", "phi_post", "phi_res", "b_post"):
        assert torch.all(getattr(s, name) == 0), name
    for name in ("alpha_pre", "alpha_post", "alpha_res"):
        torch.testing.assert_close(getattr(s, name).detach(), torch.full((S,), 0.01, dtype=F64))
    b_pre = torch.full((S, n), -2.0, dtype=F64)
    b_pre[torch.arange(S), torch.arange(S) % n] = 2.0
    torch.testing.assert_close(s.b_pre.detach(), b_pre, atol=0, rtol=0)
    b_res = 4.0 * torch.eye(n, dtype=F64).expand(S, n, n)
    torch.testing.assert_close(s.b_res.detach(), b_res, atol=0, rtol=0)
    assert s.stream_norm[0].weight.shape == (n * DIM,)
    assert getattr(s.stream_norm[0], "bias", None) is None  # RMSNorm, whatever `norm` is
    # the reference's Sinkhorn is sane: 20 iterations on the initial b_res are doubly stochastic
    R0 = sinkhorn(s.b_res.detach()[0], 20)
    torch.testing.assert_close(R0.sum(-1), torch.ones(n, dtype=F64), atol=1e-6, rtol=0)
    torch.testing.assert_close(R0.sum(-2), torch.ones(n, dtype=F64), atol=1e-6, rtol=0)
    assert torch.all(R0 > 0)

    randomize(s)
    with torch.no_grad():  # clearly non-zero dynamic parts
        s.alpha_pre.copy_(torch.linspace(0.3, 0.9, S, dtype=F64))
        s.alpha_post.copy_(torch.linspace(-0.6, 0.6, S, dtype=F64))
        s.alpha_res.copy_(torch.linspace(0.4, 1.0, S, dtype=F64))
    N, h, br = norm_fn(norm, EPS), make_input(), Branches(S)
    state, out = run(s, h, br)
    H, expected = ref_mhc(s, N, h, [br.ref(i) for i in range(S)], n, iters)
    assert state.shape == (BATCH, SEQ, n, DIM)
    close(state, H)
    close(out, expected)
