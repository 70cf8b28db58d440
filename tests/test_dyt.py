"""DyT, Dynamic Tanh (Zhu et al., arXiv 2503.10622), as the norm kind ``norm="dyt"``.

The reference is the paper's formula written here, ``DyT(x) = gamma * tanh(alpha * x) + beta``
(Algorithm 1), in float64; its gradients come from autograd on that formula and, for ``alpha``,
from the closed form ``sum(g * gamma * (1 - tanh(alpha x)^2) * x)``. The scheme equations with DyT
are in test_scheme_equations.py (every scheme, lean and reference path).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import siamesenorm as sn
from helpers import cli_in_process
from siamesenorm.compute import use_path
from siamesenorm.errors import ConfigError
from siamesenorm.models import DiT, DiTConfig, LanguageModel, LMConfig, VisionTransformer, ViTConfig
from siamesenorm.nn.fused import norm_value
from siamesenorm.nn.norms import DyT, build_norm, llm_dyt_alpha0

F64 = torch.float64
SRC = str(Path(__file__).resolve().parents[1] / "src")


def paper_dyt(x, alpha, gamma=None, beta=None):
    out = torch.tanh(alpha * x)
    if gamma is not None:
        out = gamma * out
    return out if beta is None else out + beta


def randomized_dyt(dim: int, affine: bool = True, seed: int = 0) -> DyT:
    norm = DyT(dim, affine=affine, dtype=F64)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in norm.parameters():
            p.add_(0.4 * torch.randn(p.shape, generator=g, dtype=F64))
    return norm


# ---- the formula, its gradients, its initialisation ------------------------------------------
@pytest.mark.parametrize("path", ["lean", "reference"])
@pytest.mark.parametrize("affine", [True, False])
def test_dyt_equals_the_paper_formula_in_values_and_gradients(path, affine):
    norm = randomized_dyt(6, affine)
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(3, 5, 6, generator=g, dtype=F64) * 2).requires_grad_()
    up = torch.randn(3, 5, 6, generator=g, dtype=F64)
    with use_path("reference" if path == "reference" else "kernels"):
        out = norm(x)
    params = [norm.alpha] + ([norm.weight, norm.bias] if affine else [])
    got = torch.autograd.grad(out, [x, *params], up)
    leaves = [t.detach().clone().requires_grad_() for t in (x, *params)]
    ref = paper_dyt(*leaves)
    want = torch.autograd.grad(ref, leaves, up)
    torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    t = torch.tanh(norm.alpha.detach() * x.detach())
    gamma = norm.weight.detach() if affine else 1.0
    d_alpha = (up * gamma * (1 - t * t) * x.detach()).sum()
    torch.testing.assert_close(got[1], d_alpha.reshape(1), atol=1e-10, rtol=1e-10)


def test_lean_dyt_passes_gradcheck_and_keeps_only_its_input():
    norm = randomized_dyt(4)
    x = torch.randn(2, 3, 4, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda *a: sn.nn.fused.dyt(*a), (x, norm.alpha, norm.weight, norm.bias))

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
    assert saved_elements("reference") == 2 * 8 * 16 * 4  # x and tanh(alpha x)


def test_initial_values_are_the_papers():
    norm = build_norm("dyt", 8)
    assert isinstance(norm, DyT) and norm.alpha.shape == (1,)
    assert norm.alpha.item() == 0.5 and torch.equal(norm.weight, torch.ones(8))
    assert torch.equal(norm.bias, torch.zeros(8))
    bare = build_norm("dyt", 8, affine=False)
    assert bare.weight is None and bare.bias is None and list(bare.parameters()) == [bare.alpha]
    with torch.no_grad():
        norm.alpha.fill_(3.0)
        norm.weight.fill_(2.0)
    norm.reset_parameters()
    assert norm.alpha.item() == 0.5 and torch.equal(norm.weight, torch.ones(8))


@pytest.mark.parametrize("dim, expected", [
    (64, (1.0, 1.0)), (1024, (1.0, 1.0)), (2048, (1.0, 0.5)), (3072, (1.0, 0.5)),
    (4096, (0.8, 0.2)), (5120, (0.6, 0.15)), (8192, (0.2, 0.05)), (16384, (0.2, 0.05))])
def test_llm_alpha0_follows_tables_11_and_12(dim, expected):
    assert llm_dyt_alpha0(dim) == expected


@pytest.mark.parametrize("scheme", ["pre", "spannorm", "siamese"])
def test_language_model_norms_get_the_llm_alpha0_by_role(scheme):
    cfg = LMConfig(vocab_size=64, dim=4096, n_layers=2, n_heads=32, norm="dyt", scheme=scheme,
                   qk_norm=True)
    model = LanguageModel(cfg, device="meta")
    norms = {name: m for name, m in model.named_modules() if isinstance(m, DyT)}
    assert norms
    for name, m in norms.items():
        assert m.alpha0 == (0.8 if m.role == "attention" else 0.2), name
    q_norm = model.sublayers[0].q_norm
    assert q_norm.role == "attention" and q_norm.alpha0 == 0.8
    if scheme == "pre":
        assert [n.alpha0 for n in model.scheme.pre_norm] == [0.8, 0.2, 0.8, 0.2]
        assert model.scheme.final_norm.alpha0 == 0.2
    if scheme == "spannorm":
        assert all(n.alpha0 == 0.8 for n in model.scheme.attn_norm)
        assert all(n.alpha0 == 0.2 for n in model.scheme.ffn_norm)


def test_vision_models_keep_the_default_alpha0():
    vit = VisionTransformer(ViTConfig(image_size=8, patch_size=4, num_classes=5, dim=2048, n_layers=1,
                                      n_heads=16, norm="dyt"), device="meta")
    dit = DiT(DiTConfig(input_size=8, patch_size=2, num_classes=5, dim=16, n_layers=1, n_heads=4,
                        norm="dyt"))
    for model in (vit, dit):
        norms = [m for m in model.modules() if isinstance(m, DyT)]
        assert norms and all(m.alpha0 == 0.5 for m in norms)
    assert dit.final_layer.norm.weight is None     # DiT's final norm has no affine parameters
    assert dit.final_layer.norm.alpha.item() == 0.5


# ---- every scheme, every model -----------------------------------------------------------------
def assert_one_finite_step(model, loss):
    assert torch.isfinite(loss)
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without a gradient: {missing}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    alphas = [m.alpha.grad for m in model.modules() if isinstance(m, DyT)]
    assert alphas and any(a.abs().sum() > 0 for a in alphas)


@pytest.mark.parametrize("scheme", sn.list_schemes())
def test_every_scheme_with_dyt_trains_a_language_model_step(scheme):
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, max_seq_len=16,
                                   scheme=scheme, norm="dyt", qk_norm=True))
    ids = torch.randint(0, 61, (2, 12))
    assert_one_finite_step(model, model(ids, ids).loss)


@pytest.mark.parametrize("scheme", sn.list_schemes())
def test_every_scheme_with_dyt_trains_a_vit_step(scheme):
    torch.manual_seed(0)
    model = VisionTransformer(ViTConfig(image_size=8, patch_size=4, num_classes=5, dim=16, n_layers=2,
                                        n_heads=4, mlp_ratio=2.0, scheme=scheme, norm="dyt")).train()
    out = model(torch.randn(4, 3, 8, 8), torch.tensor([0, 1, 2, 3]))
    assert_one_finite_step(model, out.loss)


@pytest.mark.parametrize("scheme", sn.list_schemes())
def test_every_scheme_with_dyt_trains_a_dit_step(scheme):
    torch.manual_seed(0)
    model = DiT(DiTConfig(input_size=8, patch_size=2, in_chans=3, num_classes=5, dim=16, n_layers=2,
                          n_heads=4, mlp_ratio=2.0, scheme=scheme, norm="dyt")).train()
    with torch.no_grad():       # wake the zero-initialised adaLN and final layer, so gradients flow
        for lin in [m[1] for m in model.modulation] + [model.final_layer.modulation[1],
                                                       model.final_layer.linear]:
            lin.weight.normal_(0.0, 0.1)
            lin.bias.normal_(0.0, 0.1)
    out = model(torch.randn(4, 3, 8, 8), torch.randint(0, 1000, (4,)), torch.tensor([0, 1, 2, 3]))
    assert_one_finite_step(model, out.pow(2).mean())


@pytest.mark.parametrize("scheme", ["pre", "siamese", "hybridnorm"])
def test_lean_and_reference_paths_agree_in_a_language_model(scheme):
    """With QK(V)-norm the lean attention recomputes the DyT of q, k (and v) in backward."""
    torch.manual_seed(0)
    model = LanguageModel(LMConfig(vocab_size=61, dim=32, n_layers=2, n_heads=4, max_seq_len=16,
                                   scheme=scheme, norm="dyt", qk_norm=True), dtype=F64)
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


def test_norm_value_is_the_forward_bit_for_bit():
    norm = randomized_dyt(8).float()
    x = torch.randn(4, 8, requires_grad=True)
    assert torch.equal(norm_value(norm, x), norm(x))


# ---- configuration, command line, refusals ------------------------------------------------------
run_cli = cli_in_process


def test_train_with_model_norm_dyt(tmp_path):
    out = tmp_path / "run"
    res = run_cli("train", "tiny", "model.norm=dyt", "model.scheme=siamese", "train.steps=2", "--out",
                  str(out))
    assert res.returncode == 0, res.stderr
    assert "norm: dyt" in (out / "config.yaml").read_text()


def test_dyt_with_a_family_is_taken():
    """A family run replaces the family's norms (tests/test_options_everywhere.py checks them)."""
    assert LMConfig(norm="dyt", family="qwen3").norm == "dyt"


def test_unknown_norm_lists_dyt():
    with pytest.raises(ConfigError, match="layernorm, rmsnorm, dyt"):
        LMConfig(norm="dynamic_tanh")
    with pytest.raises(ConfigError, match="dyt"):
        ViTConfig(norm="tanh")


@pytest.mark.parametrize("alpha0", [0, -0.5, True, "0.5"])
def test_bad_alpha0_is_refused(alpha0):
    with pytest.raises(ConfigError, match="alpha0 must be a positive number"):
        DyT(4, alpha0=alpha0)
