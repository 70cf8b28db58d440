"""The fused hand-over lives in schemes/fusion.py, outside the schemes' equations."""

from __future__ import annotations

import ast
import inspect

import pytest
import torch

from siamesenorm.models import LanguageModel, LMConfig
from siamesenorm.models.stack import hidden_at
from siamesenorm.schemes import build_scheme, fusion, get_scheme_class
from siamesenorm.schemes.pre import PreNorm

FUSED = {"pre": fusion.PendingAdd, "siamese": fusion.PendingUpdate, "keel": fusion.PendingNorm}


@pytest.mark.parametrize("name", list(FUSED))
def test_the_scheme_files_hold_no_hand_over(name):
    """The equations name no pending state and no deferring rule: those are the dispatch's."""
    cls = get_scheme_class(name)
    source = inspect.getsource(inspect.getmodule(cls))
    names = {n.id for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Name)}
    names |= {n.attr for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Attribute)}
    assert not names & {"defers_add", "defers_update", "add_then_norm", "stream_update_entry",
                        "PendingAdd", "PendingUpdate", "PendingNorm"}
    assert isinstance(cls.fusion, (fusion.AddThenNorm, fusion.UpdateThenEntry, fusion.NormThenNorm))


def _loss_and_grads(model, x):
    loss = model(x[:, :-1], x[:, 1:]).loss
    return [loss, *torch.autograd.grad(loss, list(model.parameters()))]


@pytest.mark.parametrize("name, options", [("pre", {}), ("siamese", {}), ("siamese", {"form": "hybrid_pre"}),
                                           ("siamese", {"topology": "resi_dual"}), ("keel", {})])
def test_the_dispatch_computes_the_equations(name, options, monkeypatch):
    """With every write left pending (here the plain ops run each fused step, no kernel), the loss
    and every gradient are the equations' bit for bit, and the states between steps were pending."""
    torch.manual_seed(0)
    cfg = LMConfig(vocab_size=32, dim=16, n_layers=2, n_heads=2, max_seq_len=8, scheme=name,
                   scheme_options=options, norm="rmsnorm")
    model = LanguageModel(cfg).double()
    x = torch.randint(0, 32, (2, 9))
    want = _loss_and_grads(model, x)
    monkeypatch.setattr(fusion, "defers_add", lambda *a: True)
    monkeypatch.setattr(fusion, "defers_update", lambda *a: True)
    seen = []
    step = type(model.scheme).step
    monkeypatch.setattr(type(model.scheme), "step",
                        lambda self, *a: seen.append(type(out := step(self, *a))) or out)
    got = _loss_and_grads(model, x)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert FUSED[name] in seen


def test_a_subclass_that_rewrites_an_equation_is_not_fused(monkeypatch):
    class Scaled(PreNorm):
        def step(self, h, i, branch):
            return h + 0.5 * branch(self.pre_norm[i](h))

    class OwnExit(PreNorm):
        def exit(self, h):
            return 2 * h

    monkeypatch.setattr(fusion, "defers_add", lambda *a: True)
    h = torch.randn(2, 8)
    for cls in (Scaled, OwnExit):
        scheme = cls(8, 1)
        state = scheme.step(h, 0, torch.tanh)
        assert isinstance(state, torch.Tensor)
    scheme = build_scheme("pre", 8, 1)
    assert isinstance(scheme.step(h, 0, torch.tanh), fusion.PendingAdd)
    assert isinstance(build_scheme("lns", 8, 1).step(h, 0, torch.tanh), torch.Tensor)


def test_a_pending_state_reads_as_its_streams():
    """Diagnostics and a model's hidden states see the streams, not the pending write."""
    pre, siamese = build_scheme("pre", 8, 1), build_scheme("siamese", 8, 1)
    h, out = torch.randn(2, 8), torch.randn(2, 8)
    pending = fusion.PendingAdd(h, out)
    assert torch.equal(pre.streams(pending)["h"], h + out)
    assert torch.equal(hidden_at(pre, pending), h + out)
    assert torch.equal(pre.exit(pending), pre.final_norm(h + out))
    streams = siamese.streams(fusion.PendingUpdate(h, h, out, 2.0))
    assert torch.equal(streams["x"], h + out / 2.0) and torch.equal(streams["y"], h + out)
