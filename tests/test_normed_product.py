"""``normed_product``: ``norm(x) @ proj`` with the norm folded into the product (what compiled
graphs of mHC and hyper-connections compute), against the plain composition written here."""

import pytest
import torch

from siamesenorm.nn.norms import build_norm, normed_product

F64 = torch.float64


def plain(x, weight, bias, proj, kind, eps):
    if kind == "layernorm":
        x = x - x.mean(-1, keepdim=True)
    x = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        x = x * weight
    if bias is not None:
        x = x + bias
    return x @ proj


@pytest.mark.parametrize("kind, affine", [("layernorm", True), ("layernorm", False),
                                          ("rmsnorm", True), ("rmsnorm", False)])
def test_values_and_gradients_equal_the_norm_then_the_product(kind, affine):
    g = torch.Generator().manual_seed(0)
    norm = build_norm(kind, 12, 1e-3, affine=affine, dtype=F64)
    with torch.no_grad():
        for p in norm.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64))
    x = (torch.randn(2, 5, 12, generator=g, dtype=F64) + 3).requires_grad_()
    proj = torch.randn(12, 7, generator=g, dtype=F64, requires_grad=True)
    bias = getattr(norm, "bias", None)
    got = normed_product(norm, x, proj)
    want = plain(x, norm.weight, bias, proj, kind, 1e-3)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)
    wanted = [x, proj, *norm.parameters()]
    seed = torch.randn(got.shape, generator=g, dtype=F64)
    for a, b in zip(torch.autograd.grad((got * seed).sum(), wanted),
                    torch.autograd.grad((want * seed).sum(), wanted), strict=True):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-11)


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm"])
def test_under_bf16_autocast_it_is_as_accurate_as_the_plain_composition(kind):
    """Rows whose mean is 100 times their spread: the centring happens before the product's cast,
    so LayerNorm's fold loses nothing to cancellation."""
    g = torch.Generator().manual_seed(1)
    norm = build_norm(kind, 256, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(256, generator=g))
    x = 100 + torch.randn(64, 256, generator=g)
    proj = torch.randn(256, 6, generator=g) / 16
    exact = plain(x.double(), norm.weight.double(), None, proj.double(), kind, 1e-5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        folded = normed_product(norm, x, proj)
        composed = norm(x) @ proj
    err_folded = (folded.double() - exact).abs().max().item()
    err_composed = (composed.double() - exact).abs().max().item()
    assert folded.dtype == composed.dtype == torch.bfloat16
    assert err_folded <= 2 * err_composed + 1e-3, (err_folded, err_composed)
