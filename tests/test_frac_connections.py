"""Frac-Connections (arXiv 2503.14125), ``hyper`` with ``fracs=m``, against a reference written here
from the paper's equations, independently of the implementation (float64, values and gradients).

The paper's frac-connection matrix of one sublayer is ``FC = [[0, B], [Gamma, A]]`` (``(m+1) x 2m``)
over the m fractions of the hidden state, ``H = Reshape(h, (m, d/m))``::

    H' = B (.) Reshape(T(Cat(Gamma^T H))) + A^T H

with ``Gamma = A = I``, ``B = 1`` at initialisation (the residual connection), and dynamic weights
``W + s tanh(norm(H) W_proj)`` as in dynamic hyper-connections, the norm over each fraction.
"""

from __future__ import annotations

import pytest
import torch

import siamesenorm as sn
from helpers import make_branches, randomize_
from siamesenorm.compute import use_path
from siamesenorm.schemes import check_scheme_options

F64 = torch.float64
DIM, LAYERS, EPS = 12, 2, 1e-3
TOL = {"atol": 1e-6, "rtol": 1e-6}


@pytest.fixture(autouse=True, params=["lean", "reference"])
def compute_path(request):
    with use_path("reference" if request.param == "reference" else "kernels"):
        yield


def norm(kind, module, x):
    """``module``'s norm of ``x`` over the last dimension, written out."""
    if kind == "layernorm":
        mean = x.mean(-1, keepdim=True)
        var = ((x - mean) ** 2).mean(-1, keepdim=True)
        return (x - mean) / torch.sqrt(var + EPS) * module.weight + module.bias
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + EPS) * module.weight


def ref_frac(s, kind, h, branches, m, dynamic):
    """The paper's Frac-Connections, one fraction at a time; returns the final fractions and output."""
    w = h.shape[-1] // m
    H = [h[..., j * w:(j + 1) * w] for j in range(m)]                   # Reshape(h, (m, d/m))
    for i, branch in enumerate(branches):
        FC, B = s.static_alpha[i], s.static_beta[i]                      # [Gamma | A] (m, 2m); B (m,)
        if dynamic:
            Hn = torch.stack([norm(kind, s.dyn_norm[i], H[k]) for k in range(m)], -2)
            FC = FC + s.alpha_scale[i] * torch.tanh(Hn @ s.alpha_proj[i])   # (..., m, 2m)
            B = B + s.beta_scale[i] * torch.tanh(Hn @ s.beta_proj[i])       # (..., m)
        FC, B = FC.expand(*h.shape[:-1], m, 2 * m), B.expand(*h.shape[:-1], m)
        gamma = [[FC[..., k, j, None] for j in range(m)] for k in range(m)]
        alpha = [[FC[..., k, m + j, None] for j in range(m)] for k in range(m)]
        inputs = [sum(gamma[k][j] * H[k] for k in range(m)) for j in range(m)]   # Gamma^T H
        out = branch(norm(kind, s.norm[i], torch.cat(inputs, -1)))           # T(Cat(...))
        H = [B[..., j, None] * out[..., j * w:(j + 1) * w] + sum(alpha[k][j] * H[k] for k in range(m))
             for j in range(m)]
    return torch.stack(H, -2), norm(kind, s.final_norm, torch.cat(H, -1))


def build(m, kind="layernorm", dynamic=True, **options):
    s = sn.build_scheme("hyper", DIM, LAYERS, n_streams=1, fracs=m, dynamic=dynamic, norm=kind,
                        eps=EPS, dtype=F64, **options)
    return s


def h_input(seed=3):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, 3, DIM, generator=g, dtype=F64) * 1.3 + 0.2).requires_grad_(True)


def run(s, h, branches):
    state = s.enter(h)
    for i, branch in enumerate(branches):
        state = s.step(state, i, branch)
    return state, s.exit(state)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("dynamic", [True, False])
@pytest.mark.parametrize("m", [2, 3, 4])
def test_frac_connections_equal_the_paper_values_and_gradients(m, dynamic, kind):
    s = build(m, kind, dynamic)
    S = 2 * LAYERS
    # the contract: shapes and the initial values (the residual connection)
    eye = torch.eye(m, dtype=F64)
    assert s.static_alpha.shape == (S, m, 2 * m) and s.static_beta.shape == (S, m)
    torch.testing.assert_close(s.static_alpha.detach(), torch.cat([eye, eye], 1).expand(S, m, 2 * m),
                               atol=0, rtol=0)
    assert torch.all(s.static_beta == 1)
    if dynamic:
        assert s.alpha_proj.shape == (S, DIM // m, 2 * m) and s.beta_proj.shape == (S, DIM // m)
        assert torch.all(s.alpha_proj == 0) and torch.all(s.beta_proj == 0)
        assert torch.all(s.alpha_scale == 0.01) and torch.all(s.beta_scale == 0.01)
        assert s.dyn_norm[0].weight.shape == (DIM // m,)
    else:
        assert getattr(s, "alpha_proj", None) is None and getattr(s, "dyn_norm", None) is None
    randomize_(s, scale=0.5)
    if dynamic:
        with torch.no_grad():
            s.alpha_scale.copy_(torch.linspace(0.4, 0.9, S))
            s.beta_scale.copy_(torch.linspace(-0.6, 0.5, S))
    branches = make_branches(S, DIM, seed=5)
    h = h_input()
    state, out = run(s, h, branches)
    assert state.shape == (2, 3, m, DIM // m) and out.shape == h.shape
    params = [h, *s.parameters()]
    got = torch.autograd.grad((out * torch.linspace(-1, 1, DIM, dtype=F64)).sum(), params)
    ref_state, ref_out = ref_frac(s, kind, h, branches, m, dynamic)
    torch.testing.assert_close(state, ref_state, **TOL)
    torch.testing.assert_close(out, ref_out, **TOL)
    want = torch.autograd.grad((ref_out * torch.linspace(-1, 1, DIM, dtype=F64)).sum(), params,
                               allow_unused=True)
    for p, g, r in zip(params, got, want, strict=True):
        torch.testing.assert_close(g, torch.zeros_like(p) if r is None else r, **TOL)


@pytest.mark.parametrize("dynamic", [True, False])
def test_frac_connections_at_init_are_pre_norm(dynamic):
    """With Gamma = A = I and B = 1 (and the dynamic projections zero), a step is exactly Pre-Norm's
    ``h + F(LN(h))`` on the whole width, whatever the norms' parameters."""
    s = build(4, dynamic=dynamic)
    with torch.no_grad():
        for module in [*s.norm, s.final_norm]:
            randomize_(module)
    branches = make_branches(2 * LAYERS, DIM, seed=2)
    h = h_input()
    _, out = run(s, h, branches)
    x = h
    for i, branch in enumerate(branches):
        x = x + branch(norm("layernorm", s.norm[i], x))
    torch.testing.assert_close(out, norm("layernorm", s.final_norm, x), atol=1e-12, rtol=0)


@pytest.mark.parametrize("n_streams", [1, 2, 3])
def test_fracs_1_is_plain_hyper_connections(n_streams):
    plain = sn.build_scheme("hyper", DIM, LAYERS, n_streams=n_streams, dtype=F64)
    torch.manual_seed(0)
    randomize_(plain)
    frac = sn.build_scheme("hyper", DIM, LAYERS, n_streams=n_streams, fracs=1, dtype=F64)
    a, b = plain.state_dict(), frac.state_dict()
    assert {k: v.shape for k, v in a.items()} == {k: v.shape for k, v in b.items()}
    frac.load_state_dict(a)
    branches = make_branches(2 * LAYERS, DIM)
    h = h_input()
    outs = [run(s, h, branches)[1] for s in (plain, frac)]
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
    grads = [torch.autograd.grad(o.square().sum(), [h, *s.parameters()])
             for o, s in zip(outs, (plain, frac))]
    for g, r in zip(*grads, strict=True):
        torch.testing.assert_close(g, r, atol=0, rtol=0)


def test_one_fraction_reference_is_one_stream_hyper_connections():
    """The paper's FC with m = 1 is HC with n = 1 (expansion rate 1): the reference above, run on
    the one-stream scheme's parameters, gives that scheme's output."""
    s = sn.build_scheme("hyper", DIM, LAYERS, n_streams=1, norm="layernorm", eps=EPS, dtype=F64)
    randomize_(s, scale=0.5)
    branches = make_branches(2 * LAYERS, DIM, seed=4)
    h = h_input()
    torch.testing.assert_close(run(s, h, branches)[1], ref_frac(s, "layernorm", h, branches, 1, True)[1],
                               **TOL)


def test_parameter_count_matches_the_paper():
    """Table 1 of the paper: DFCx4 adds 0.000165B parameters to OLMo2-1B (16 blocks, width 2048,
    RMSNorm): per sublayer the fraction norm, W (d/m x 2m), W_beta (d/m), the static FC matrix and the
    two scales."""
    s = sn.build_scheme("hyper", 2048, 16, n_streams=1, fracs=4, norm="rmsnorm", device="meta")
    added = sum(p.numel() for name, p in s.named_parameters()
                if not name.startswith(("norm.", "final_norm.")))
    assert round(added / 1e9, 6) == 0.000165


@pytest.mark.parametrize("options, dim, fragment", [
    ({"fracs": 2}, 16, "set n_streams=1"),
    ({"n_streams": 3, "fracs": 4}, 16, "streams of fractions (n_streams=3) are not defined"),
    ({"n_streams": 1, "fracs": 5}, 16, "fracs=5 must divide the model width dim=16"),
    ({"n_streams": 1, "fracs": 0}, 16, "option fracs=0 is outside"),
    ({"n_streams": 1, "fracs": 2.0}, 16, "option fracs must be an integer"),
])
def test_bad_fracs_are_refused_in_one_line(options, dim, fragment):
    with pytest.raises(sn.ConfigError) as built:
        sn.build_scheme("hyper", dim, 2, **options)
    with pytest.raises(sn.ConfigError) as checked:
        check_scheme_options("hyper", options, dim)
    assert fragment in str(built.value) and str(checked.value) == str(built.value)
    assert "\n" not in str(built.value)
