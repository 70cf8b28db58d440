"""Keel (arXiv 2601.19895) against its equation, written here from the paper:

    x_{l+1} = LN_1(alpha * x_l + F_l(LN_2(x_l))),   alpha = L (the number of sublayers)

The references use their own LayerNorm and RMSNorm and read only the scheme's parameters (by the
names docs/schemes.md gives them), never its ``step``; every parameter is moved off its initial
value first. Values and gradients agree to 1e-10 in float64, on the lean and the reference path.
"""

from __future__ import annotations

import math

import pytest
import torch

import siamesenorm as sn
from siamesenorm.compute import use_path
from siamesenorm.models import LanguageModel, LMConfig

F64 = torch.float64
DIM, EPS = 8, 1e-3
TOL = {"atol": 1e-10, "rtol": 1e-10}


@pytest.fixture(autouse=True, params=["lean", "reference"])
def compute_path(request):
    with use_path("reference" if request.param == "reference" else "kernels"):
        yield


def own_norm(kind, module, x):
    """The norm ``kind`` with ``module``'s parameters (none: not affine)."""
    weight = getattr(module, "weight", None)
    if kind == "rmsnorm":
        y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + EPS)
        return y if weight is None else y * weight
    mean = x.mean(-1, keepdim=True)
    y = (x - mean) / torch.sqrt((x - mean).pow(2).mean(-1, keepdim=True) + EPS)
    return y if weight is None else y * weight + module.bias


def branches(n, seed=3):
    """``F_i(u) = tanh(u W_i) V_i``: one fixed nonlinear sublayer per index."""
    g = torch.Generator().manual_seed(seed)
    ws = [(torch.randn(DIM, 2 * DIM, generator=g, dtype=F64) / math.sqrt(DIM),
           torch.randn(2 * DIM, DIM, generator=g, dtype=F64) / math.sqrt(2 * DIM)) for _ in range(n)]
    return [lambda u, w=w, v=v: torch.tanh(u @ w) @ v for w, v in ws]


def keel(n_layers, norm="rmsnorm", **options):
    s = sn.build_scheme("keel", DIM, n_layers, norm=norm, eps=EPS, dtype=F64, **options)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for p in s.parameters():
            p.add_(0.4 * torch.randn(p.shape, generator=g, dtype=F64))
    return s


def reference(s, kind, h, fs, alpha):
    x = h
    for i, f in enumerate(fs):
        x = own_norm(kind, s.post_norm[i], alpha * x + f(own_norm(kind, s.pre_norm[i], x)))
    return x if s.final_norm is None else own_norm(kind, s.final_norm, x)


def drive(s, h, fs):
    state = s.enter(h)
    for i, f in enumerate(fs):
        state = s.step(state, i, f)
    return s.exit(state)


def grads(out, params):
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=F64)
    return torch.autograd.grad((out * weights).sum(), params, allow_unused=True)


@pytest.mark.parametrize("norm", ["rmsnorm", "layernorm"])
@pytest.mark.parametrize("options", [{}, {"alpha": 2.5}, {"alpha": 0}, {"final_norm": True},
                                     {"branch_affine": False}])
def test_step_and_gradients_equal_the_paper_equation(norm, options):
    n_layers = 3
    s = keel(n_layers, norm, **options)
    alpha = options.get("alpha", 2 * n_layers)          # the paper's alpha = L, the sublayer count
    assert s.alpha == alpha
    h = torch.randn(2, 5, DIM, generator=torch.Generator().manual_seed(7), dtype=F64) * 2 + 0.5
    h.requires_grad_(True)
    fs = branches(s.n_sublayers)
    params = [h, *s.parameters()]

    out, expected = drive(s, h, fs), reference(s, norm, h, fs, alpha)
    torch.testing.assert_close(out, expected, **TOL)
    for got, want in zip(grads(out, params), grads(expected, params), strict=True):
        torch.testing.assert_close(got, want, **TOL)


def test_the_language_model_equals_a_hand_written_keel_loop():
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=40, dim=16, n_layers=3, n_heads=2, max_seq_len=8, scheme="keel",
                   norm="rmsnorm", norm_eps=EPS)
    model = LanguageModel(cfg).to(F64)
    with torch.no_grad():
        for p in model.scheme.parameters():
            p.add_(0.3 * torch.randn(p.shape, dtype=F64))
    ids = torch.randint(0, 40, (2, 8), generator=torch.Generator().manual_seed(1))

    def hand_written():
        x, s = model.embed(ids), model.scheme
        for i, sub in enumerate(model.sublayers):
            x = own_norm("rmsnorm", s.post_norm[i], 6 * x + sub(own_norm("rmsnorm", s.pre_norm[i], x)))
        return x @ model.embed.weight.T                 # tied head, no final norm

    params = list(model.parameters())
    got, want = model(ids).logits, hand_written()
    torch.testing.assert_close(got, want, **TOL)
    for a, b in zip(grads(got, params), grads(want, params), strict=True):
        torch.testing.assert_close(a, b, **TOL)


def test_defaults_and_options():
    s = sn.build_scheme("keel", DIM, 5)
    assert s.alpha == 10.0 and s.final_norm is None and s.branch_affine
    assert sn.scheme_options("keel") == {"alpha": None, "branch_affine": True, "final_norm": False}
    assert sn.build_scheme("keel", DIM, 5, alpha=1).alpha == 1.0
    assert sn.build_scheme("keel", DIM, 5, branch_affine=False).pre_norm[0].weight is None
    assert sn.build_scheme("keel", DIM, 5, branch_affine=False).post_norm[0].weight is not None
    assert "alpha=10" in repr(s)
    for bad, why in [(-1, r"outside \[0"), ("L", "must be a number"), (True, "must be a number")]:
        with pytest.raises(sn.ConfigError, match=rf"^scheme 'keel': option alpha.*{why}"):
            sn.build_scheme("keel", DIM, 5, alpha=bad)


def test_the_stream_stays_normalised_whatever_the_skip_weight():
    # Post-Norm's property, kept: every state is a norm's output (RMS ~ 1 with unit gains).
    s = sn.build_scheme("keel", DIM, 8, norm="rmsnorm", eps=EPS, dtype=F64)
    h = 50 * torch.randn(2, 3, DIM, dtype=F64)
    state = s.enter(h)
    for i, f in enumerate(branches(s.n_sublayers)):
        state = s.step(state, i, f)
        stream = s.streams(state)["h"]
        assert torch.allclose(stream.pow(2).mean(-1), torch.ones(2, 3, dtype=F64), atol=1e-3)


def _state_gradients(name, n_layers=64, **options):
    """RMS of d(out . w)/d(state) entering each sublayer, with branches whose output is as large
    as their input (a fixed offset of RMS 1 plus a nonlinear part: the regime the paper analyses,
    where Post-Norm's skip weighs 1 against a branch of size ~1)."""
    s = sn.build_scheme(name, 32, n_layers, norm="rmsnorm", eps=EPS, dtype=F64, **options)
    g = torch.Generator().manual_seed(2)
    fs = [(torch.randn(32, 64, generator=g, dtype=F64) / math.sqrt(32),
           torch.randn(64, 32, generator=g, dtype=F64) * 0.5 / math.sqrt(64),
           torch.randn(32, generator=g, dtype=F64)) for _ in range(s.n_sublayers)]
    h = torch.randn(2, 4, 32, generator=g, dtype=F64)
    h = (h / h.pow(2).mean(-1, keepdim=True).sqrt()).requires_grad_(True)   # a normalised input
    states, state = [], s.enter(h)
    # The plain path: there the branch input LN^pre(h) is computed from the stream h; the lean
    # entry returns both from the sum before LN^post, so h's gradient would miss the branch's part.
    with use_path("reference"):
        for i, (w, v, b) in enumerate(fs):
            stream = s.streams(state)["h"]
            stream.retain_grad()
            states.append(stream)
            state = s.step(state, i, lambda u, w=w, v=v, b=b: torch.tanh(u @ w) @ v + b)
        out = s.exit(state)
    (out * torch.randn(out.shape, generator=g, dtype=F64)).sum().backward()
    return [t.grad.pow(2).mean().sqrt().item() for t in states]


def test_at_depth_64_the_highway_skip_keeps_the_gradient_that_post_norm_loses():
    # The paper's mechanism (Sec. 3): through LN(x + F) the skip passes about |x| / |x + F| of the
    # gradient, so Post-Norm's shrinks geometrically with depth once F is as large as x; weighted
    # alpha = L, the skip passes about 1 - |F|^2 / (2 alpha^2 |x|^2) per sublayer: no decay over L.
    keel = _state_gradients("keel")
    assert 0.5 < keel[0] / keel[-1] < 2, (keel[0], keel[-1])
    post = _state_gradients("post")
    assert post[0] / post[-1] < 1e-10, (post[0], post[-1])
    weak = _state_gradients("keel", alpha=1)            # Post-Norm plus the branch norm: decays too
    assert weak[0] / weak[-1] < 1e-10, (weak[0], weak[-1])


@pytest.mark.parametrize("suffix", ["", "-gpu"])
def test_the_keel_depth_preset_is_table2s_grid_with_keel_beside_pre_norm(suffix):
    import dataclasses

    from siamesenorm.experiments import build_grid

    def cells(preset):
        return {(c.variant.label, c.seed): c.config for c in build_grid(preset, [])[2]}

    keel, table2 = cells("keel-depth" + suffix), cells("table2" + suffix)
    assert {c.model.scheme for c in keel.values()} == {"pre", "keel"}
    assert all(c.model.scheme_options == {} for c in keel.values())
    for (label, seed), cfg in table2.items():               # every shape, rate and seed of table2
        if label.startswith("pre-"):
            assert keel[label, seed] == cfg
            twin = keel["keel-" + label[4:], seed]
            assert dataclasses.replace(twin.model, scheme="pre") == cfg.model
            assert dataclasses.replace(twin, model=cfg.model) == cfg
    assert len(keel) == len(table2)
