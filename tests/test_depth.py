"""Depth behaviour at initialisation, in the full language model.

The paper's claims (arXiv 2602.08064, Sec. 3 and Fig. 2a): Pre-Norm's hidden-state norm grows with
depth, SiameseNorm's X stream stays bounded, and both keep the gradient flowing to the first block.
"""

from __future__ import annotations

import math

import pytest
import torch

import siamesenorm as sn
from siamesenorm.analysis import block_grad_norms, stream_rms
from siamesenorm.models import LanguageModel, LMConfig


def _model(scheme: str, n_layers: int, init: str = "normal", **options) -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(LMConfig(vocab_size=64, dim=32, n_layers=n_layers, n_heads=2,
                                  max_seq_len=16, scheme=scheme, scheme_options=options, init=init))


def _batch(seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 64, (2, seq), generator=g), torch.randint(0, 64, (2, seq), generator=g)


@pytest.mark.parametrize("name", sn.list_schemes())
def test_96_layer_model_at_init_is_finite(name):
    model = _model(name, 96)
    x, y = _batch(8)
    out = model(x, y)
    assert torch.isfinite(out.logits).all()
    out.loss.backward()
    assert math.isfinite(out.loss.item())
    for pname, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), pname
    # The first block learns: its gradient is not lost on the way down.
    assert block_grad_norms(model)[0] > 0


@pytest.mark.parametrize("init", ["normal", "mitchell"])
def test_pre_norm_hidden_norm_grows_with_depth_while_siamese_x_stays_bounded(init):
    x, _ = _batch()
    with torch.no_grad():
        pre = stream_rms(_model("pre", 64, init), x)["h"]
        siamese = stream_rms(_model("siamese", 64, init), x)
    quarters = [pre[k] for k in (0, 15, 31, 47, 63)]
    assert all(a < b for a, b in zip(quarters, quarters[1:])), quarters
    if init == "mitchell":  # the paper's initialisation: the growth is large
        assert pre[-1] > 2 * pre[0], (pre[0], pre[-1])
    assert all(0.5 < r < 2.0 for r in siamese["x"]), siamese["x"]
    # Y is the Pre-Norm-like stream: it grows as Pre-Norm's does.
    assert siamese["y"][-1] > siamese["y"][0]


@pytest.mark.parametrize("name", ["pre", "siamese"])
@pytest.mark.parametrize("init", ["normal", "mitchell"])
def test_gradient_reaches_the_first_block_within_a_factor_of_ten(name, init):
    model = _model(name, 64, init)
    x, y = _batch()
    model(x, y).loss.backward()
    norms = block_grad_norms(model)
    assert 0.1 < norms[0] / norms[-1] < 10, (norms[0], norms[-1])


@pytest.mark.parametrize("init", ["normal", "mitchell"])
def test_keel_at_depth_the_gradient_reaches_every_block(init):
    # Keel (arXiv 2601.19895): the skip weighted alpha = L keeps every block's gradient within a
    # factor of ten of the last's. Block 0's is larger, not smaller: its skip carries the raw
    # embedding (RMS ~ init_std), so its output norm divides by alpha * init_std instead of alpha.
    model = _model("keel", 64, init)
    x, y = _batch()
    model(x, y).loss.backward()
    norms = block_grad_norms(model)
    assert all(0.1 < n / norms[-1] < 10 for n in norms[1:]), norms
    assert norms[0] > norms[-1], (norms[0], norms[-1])
