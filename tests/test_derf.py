"""Derf, Dynamic erf (Chen et al., arXiv 2512.10938), as the norm kind ``norm="derf"``.

The reference is the paper's formula written here, ``Derf(x) = gamma * erf(alpha * x + s) + beta``
with ``alpha`` and ``s`` one scalar each and ``gamma``, ``beta`` per channel, in float64; its
gradients come from autograd on that formula and, for ``alpha`` and ``s``, from the closed forms
``sum(g gamma erf'(z) x)`` and ``sum(g gamma erf'(z))`` with ``erf'(z) = 2 / sqrt(pi) exp(-z^2)``.
"""

from __future__ import annotations

import math

import pytest
import torch

import siamesenorm as sn
from helpers import cli_in_process
from siamesenorm.compute import use_path
from siamesenorm.errors import ConfigError, UserError
from siamesenorm.models import DiT, DiTConfig, LanguageModel, LMConfig, VisionTransformer, ViTConfig
from siamesenorm.nn.fused import norm_value, stream_entry
from siamesenorm.nn.norms import Derf, build_norm

F64 = torch.float64


def paper_derf(x, alpha, s, gamma=None, beta=None):
    out = torch.special.erf(alpha * x + s)
    if gamma is not None:
        out = gamma * out
    return out if beta is None else out + beta


def randomized_derf(dim: int, affine: bool = True, seed: int = 0) -> Derf:
    norm = Derf(dim, affine=affine, dtype=F64)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in norm.parameters():
            p.add_(0.4 * torch.randn(p.shape, generator=g, dtype=F64))
    return norm


# ---- the formula, its gradients, its initialisation ------------------------------------------
@pytest.mark.parametrize("path", ["lean", "reference"])
@pytest.mark.parametrize("affine", [True, False])
def test_derf_equals_the_paper_formula_in_values_and_gradients(path, affine):
    norm = randomized_derf(6, affine)
    assert norm.shift.item() != 0.0              # a shift the formula must honour
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 5, 6, generator=g, dtype=F64) * 2).requires_grad_()
    up = torch.randn(3, 5, 6, generator=g, dtype=F64)
    with use_path("reference" if path == "reference" else "kernels"):
        out = norm(x)
    params = [norm.alpha, norm.shift] + ([norm.weight, norm.bias] if affine else [])
    got = torch.autograd.grad(out, [x, *params], up)
    leaves = [t.detach().clone().requires_grad_() for t in (x, *params)]
    ref = paper_derf(*leaves)
    want = torch.autograd.grad(ref, leaves, up)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    z = norm.alpha.detach() * x.detach() + norm.shift.detach()
    gamma = norm.weight.detach() if affine else 1.0
    slope = up * gamma * 2 / math.sqrt(math.pi) * torch.exp(-z * z)
    torch.testing.assert_close(got[1], (slope * x.detach()).sum().reshape(1), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(got[2], slope.sum().reshape(1), atol=1e-10, rtol=1e-10)


def test_lean_derf_passes_gradcheck_and_keeps_only_its_input():
    norm = randomized_derf(4)
    x = torch.randn(2, 3, 4, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: sn.nn.fused.derf(*a),
                                    (x, norm.alpha, norm.shift, norm.weight, norm.bias))

    def saved_elements(path: str) -> int:
        seen: dict[int, int] = {}

        def pack(t):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes() // t.element_size()
            return t

        with (use_path("reference" if path == "reference" else "kernels"),
              torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)):
            norm(torch.randn(8, 16, 4, dtype=F64, requires_grad=True))
        return sum(n for n in seen.values() if n >= 8 * 16 * 4)  # tensors of the input's size

    assert saved_elements("lean") == 8 * 16 * 4           # x only
    assert saved_elements("reference") > 8 * 16 * 4       # autograd keeps alpha x + s and erf too


def test_initial_values_are_the_official_codes():
    norm = build_norm("derf", 8)
    assert isinstance(norm, Derf) and norm.alpha.shape == (1,) and norm.shift.shape == (1,)
    assert norm.alpha.item() == 0.5 and norm.shift.item() == 0.0
    assert torch.equal(norm.weight, torch.ones(8)) and torch.equal(norm.bias, torch.zeros(8))
    bare = build_norm("derf", 8, affine=False)
    assert bare.weight is None and bare.bias is None
    assert [n for n, _ in bare.named_parameters()] == ["alpha", "shift"]
    with torch.no_grad():
        for p in norm.parameters():
            p.fill_(3.0)
    norm.reset_parameters()
    assert norm.alpha.item() == 0.5 and norm.shift.item() == 0.0
    assert torch.equal(norm.weight, torch.ones(8)) and torch.equal(norm.bias, torch.zeros(8))
    x = torch.randn(4, 8)                       # at init: erf(x / 2), odd and bounded by 1
    torch.testing.assert_close(norm(x), torch.special.erf(0.5 * x))


@pytest.mark.parametrize("bad", [dict(alpha0=0), dict(alpha0=-1.0), dict(alpha0="0.5"),
                                 dict(shift0=True), dict(shift0=None)])
def test_bad_initial_values_are_refused(bad):
    with pytest.raises(UserError, match="Derf (alpha0|shift0) must be"):
        Derf(4, **bad)


def test_norm_value_is_the_forward_bit_for_bit():
    norm = randomized_derf(8).float()
    x = torch.randn(4, 8, requires_grad=True)
    assert torch.equal(norm_value(norm, x), norm(x))


@pytest.mark.parametrize("with_x_norm", [True, False])
def test_the_lean_stream_entry_equals_the_modules(with_x_norm):
    """SiameseNorm's entry with three Derfs: one autograd function (keeping x and y) against the
    plain composition, values and every gradient (alpha and s included)."""
    x_norm, y_norm, in_norm = (randomized_derf(6, seed=s) for s in (1, 2, 3))
    g = torch.Generator().manual_seed(4)
    x, y = (torch.randn(3, 4, 6, generator=g, dtype=F64).requires_grad_() for _ in range(2))
    ups = [torch.randn(3, 4, 6, generator=g, dtype=F64) for _ in range(2)]
    leaves = [x, y, *y_norm.parameters(), *in_norm.parameters()]
    if with_x_norm:
        leaves += list(x_norm.parameters())
    results = []
    for ref in (False, True):
        with use_path("reference" if ref else "kernels"):
            xo, b = stream_entry(x, y, x_norm=x_norm if with_x_norm else None, y_norm=y_norm,
                                 in_norm=in_norm)
        loss = (xo * ups[0]).sum() + (b * ups[1]).sum()
        results.append((xo.detach(), b.detach(), torch.autograd.grad(loss, leaves)))
    lean, plain = results
    torch.testing.assert_close(lean[0], plain[0], atol=1e-12, rtol=0)
    torch.testing.assert_close(lean[1], plain[1], atol=1e-12, rtol=0)
    for a, b in zip(lean[2], plain[2]):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    assert all(t.abs().sum() > 0 for t in lean[2])


# ---- every scheme, every model -----------------------------------------------------------------
def assert_one_finite_step(model, loss):
    assert torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without a gradient: {missing}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    derfs = [m for m in model.modules() if isinstance(m, Derf)]
    assert derfs and any(m.alpha.grad.abs().sum() > 0 for m in derfs)
    assert any(m.shift.grad.abs().sum() > 0 for m in derfs)


def train_steps(model, loss_fn, steps: int = 4) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = loss_fn()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("scheme", sn.list_schemes())
def test_every_scheme_with_derf_takes_a_language_model_step(scheme):
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, max_seq_len=16,
                                   scheme=scheme, norm="derf", qk_norm=True))
    ids = torch.randint(0, 61, (2, 12))
    assert_one_finite_step(model, model(ids, ids).loss)


@pytest.mark.parametrize("scheme", ["pre", "siamese", "mhc"])
def test_a_language_model_with_derf_trains(scheme):
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, max_seq_len=16,
                                   scheme=scheme, norm="derf", qk_norm=True))
    derfs = [m for m in model.modules() if isinstance(m, Derf)]
    assert derfs and all(m.alpha.item() == 0.5 and m.shift.item() == 0.0 for m in derfs)
    ids = torch.randint(0, 61, (4, 12))
    losses = train_steps(model, lambda: model(ids, ids).loss, steps=6)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


@pytest.mark.parametrize("scheme", ["pre", "siamese"])
def test_a_vit_with_derf_trains(scheme):
    torch.manual_seed(0)
    model = VisionTransformer(ViTConfig(image_size=8, patch_size=4, num_classes=5, dim=16, n_layers=2,
                                        n_heads=4, mlp_ratio=2.0, scheme=scheme, norm="derf")).train()
    images, labels = torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3])
    assert_one_finite_step(model, model(images, labels).loss)
    losses = train_steps(model, lambda: model(images, labels).loss)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


@pytest.mark.parametrize("scheme", ["pre", "siamese"])
def test_a_dit_with_derf_trains(scheme):
    torch.manual_seed(0)
    model = DiT(DiTConfig(input_size=8, patch_size=2, in_chans=3, num_classes=5, dim=16, n_layers=2,
                          n_heads=4, mlp_ratio=2.0, scheme=scheme, norm="derf")).train()
    assert model.final_layer.norm.weight is None     # DiT's final norm has no affine parameters
    with torch.no_grad():       # wake the zero-initialised adaLN and final layer, so gradients flow
        for lin in [m[1] for m in model.modulation] + [model.final_layer.modulation[1],
                                                       model.final_layer.linear]:
            lin.weight.normal_(0.0, 0.1)
            lin.bias.normal_(0.0, 0.1)
    x, t, y = torch.randn(4, 3, 8, 8), torch.randint(0, 1000, (4,)), torch.tensor([0, 1, 2, 3])
    assert_one_finite_step(model, model(x, t, y).pow(2).mean())
    losses = train_steps(model, lambda: model(x, t, y).pow(2).mean())
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


@pytest.mark.parametrize("scheme", ["pre", "siamese", "hybridnorm"])
def test_lean_and_reference_paths_agree_in_a_language_model(scheme):
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, max_seq_len=16,
                                   scheme=scheme, norm="derf", qk_norm=True), dtype=F64)
    with torch.no_grad():       # shifts away from 0, so a dropped shift would show
        for m in model.modules():
            if isinstance(m, Derf):
                m.shift.normal_(0.0, 0.3)
    ids = torch.randint(0, 61, (2, 12))
    grads = []
    for path in ("lean", "reference"):
        model.zero_grad()
        with use_path("reference" if path == "reference" else "kernels"):
            loss = model(ids, ids).loss
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters()]))
    torch.testing.assert_close(grads[0][0], grads[1][0], atol=1e-12, rtol=0)
    for a, b in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


# ---- configuration, command line, refusals ------------------------------------------------------
def test_train_with_model_norm_derf(tmp_path):
    out = tmp_path / "run"
    res = cli_in_process("train", "tiny", "model.norm=derf", "model.scheme=siamese", "train.steps=2",
                         "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "norm: derf" in (out / "config.yaml").read_text()


def test_derf_with_a_family_is_taken():
    """A family run replaces the family's norms (tests/test_options_everywhere.py checks them)."""
    assert LMConfig(norm="derf", family="qwen3").norm == "derf"


def test_derf_in_olmo_core_is_refused_in_one_line():
    with pytest.raises(UserError) as err:
        LMConfig(norm="derf").check_host("olmo_core")
    message = str(err.value)
    assert "model.norm=derf" in message and "OLMo-core" in message and "\n" not in message


def test_unknown_norm_lists_derf():
    with pytest.raises(ConfigError, match="layernorm, rmsnorm, dyt, derf"):
        LMConfig(norm="erf")
    for config in (ViTConfig, DiTConfig):
        with pytest.raises(ConfigError, match="derf"):
            config(norm="dynamic_erf")


def test_schemes_listing_names_derf():
    res = cli_in_process("schemes", "-v")
    assert res.returncode == 0 and "derf (Derf, gamma * erf(alpha x + s) + beta" in res.stdout
