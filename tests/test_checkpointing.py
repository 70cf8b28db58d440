"""Activation checkpointing (``sublayer``, ``selective``) changes no number, only what is kept; and
the byte count of what a forward keeps, against counts made by hand."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import siamesenorm as sn
from helpers import randomize_
from siamesenorm.config import CHECKPOINTING_MODES
from siamesenorm.diffusion import DiffusionObjective, create_diffusion
from siamesenorm.models import DiT, DiTConfig, LanguageModel, LMConfig, VisionTransformer, ViTConfig
from siamesenorm.models.checkpointing import (
    activation_checkpointing,
    activation_memory,
    saved_activation_bytes,
    set_activation_checkpointing,
)

F64 = torch.float64
MODES = ("sublayer", "selective")


def _lm(scheme: str, options: dict | None = None, **kw) -> LanguageModel:
    torch.manual_seed(0)
    cfg = LMConfig(**({"vocab_size": 64, "dim": 32, "n_layers": 2, "n_heads": 4, "max_seq_len": 8,
                       "scheme": scheme, "scheme_options": options or {}} | kw))
    model = LanguageModel(cfg, dtype=F64)
    randomize_(model, scale=0.1)
    return model


def _grads(model: torch.nn.Module, x, y, mode: str, seed: int = 3):
    set_activation_checkpointing(model, mode)
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)                        # the draws of dropout, drop-path, diffusion noise
    loss = model(x, y).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(model, x, y):
    want_loss, want = _grads(model, x, y, "none")
    assert want, "no gradient at all"
    for mode in MODES:
        loss, got = _grads(model, x, y, mode)
        torch.testing.assert_close(loss, want_loss, rtol=1e-12, atol=0, msg=mode)
        assert got.keys() == want.keys(), mode
        for name in want:
            torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-13,
                                       msg=f"{mode}: {name}")


def test_modes_are_the_configs():
    assert set(MODES) | {"none"} == set(CHECKPOINTING_MODES)


@pytest.mark.parametrize("scheme", sn.list_schemes())
def test_every_scheme_gets_the_same_gradients_under_each_mode(scheme):
    model = _lm(scheme)
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    _assert_same(model.train(), x, x.roll(-1, 1))


def test_siamese_olmo_form_and_dropout_replay_the_same_draws():
    model = _lm("siamese", {"form": "hybrid_pre"}, dropout=0.2)
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    _assert_same(model.train(), x, x.roll(-1, 1))


def test_vit_with_drop_path_and_dropout():
    torch.manual_seed(0)
    cfg = ViTConfig(image_size=8, patch_size=4, in_chans=3, num_classes=5, dim=16, n_layers=3,
                    n_heads=4, mlp_ratio=2.0, drop_path=0.3, dropout=0.2, scheme="siamese")
    model = VisionTransformer(cfg, dtype=F64).train()
    x = torch.randn(4, 3, 8, 8, dtype=F64)
    _assert_same(model, x, torch.tensor([0, 1, 2, 3]))


def test_dit_objective():
    torch.manual_seed(0)
    cfg = DiTConfig(input_size=8, patch_size=2, in_chans=4, num_classes=3, dim=16, n_layers=2,
                    n_heads=4, scheme="siamese")
    objective = DiffusionObjective(DiT(cfg, dtype=F64), create_diffusion(num_timesteps=50)).train()
    randomize_(objective, scale=0.1)               # adaLN-Zero starts with every gate at zero
    x = torch.randn(3, 4, 8, 8, dtype=F64).clamp(-1, 1)
    _assert_same(objective, x, torch.tensor([0, 1, 2]))


def test_modes_replace_each_other_and_none_restores_the_plain_step():
    model = _lm("siamese")
    plain = type(model.scheme).step
    set_activation_checkpointing(model, "sublayer")
    set_activation_checkpointing(model, "sublayer")
    assert activation_checkpointing(model) == "sublayer"
    set_activation_checkpointing(model, "selective")
    assert activation_checkpointing(model) == "selective"
    set_activation_checkpointing(model, "none")
    assert activation_checkpointing(model) == "none"
    assert "step" not in vars(model.scheme) and model.scheme.step.__func__ is plain
    assert set(model.state_dict()) == set(_lm("siamese").state_dict())


def test_evaluation_and_no_grad_run_the_plain_step(monkeypatch):
    import siamesenorm.models.checkpointing as ck

    calls = []
    real = ck.checkpoint
    monkeypatch.setattr(ck, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = _lm("siamese").eval()
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    want, kept = model(x).logits, saved_activation_bytes(lambda: model(x, x).loss)
    for mode in MODES:
        set_activation_checkpointing(model.eval(), mode)
        torch.testing.assert_close(model(x).logits, want, rtol=0, atol=0)        # eval mode
        assert saved_activation_bytes(lambda: model(x, x).loss) == kept          # nothing extra
        with torch.no_grad():  # the plain composition (no lean functions without gradients)
            torch.testing.assert_close(model.train()(x).logits, want, rtol=0, atol=1e-12)
        with torch.inference_mode():
            model(x)
        assert calls == [], mode
        model(x, x).loss.backward()                # training with gradients: one per step
        assert len(calls) == 2 * model.config.n_layers, mode
        calls.clear()


class _Count(TorchDispatchMode):
    def __init__(self, ops) -> None:
        super().__init__()
        self.ops, self.n = ops, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func in self.ops
        return func(*args, **(kwargs or {}))


def test_selective_recomputes_no_matrix_product():
    """The backward of ``selective`` runs exactly the matrix products of the plain backward; that of
    ``sublayer`` runs the forward's again."""
    from siamesenorm.models.checkpointing import _SAVED_OPS

    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    for scheme in ("pre", "siamese"):
        model = _lm(scheme).train()
        counts = {}
        for mode in CHECKPOINTING_MODES:
            set_activation_checkpointing(model, mode)
            loss = model(x, x).loss
            with _Count(_SAVED_OPS) as count:
                loss.backward()
            counts[mode] = count.n
        assert counts["selective"] == counts["none"] < counts["sublayer"], (scheme, counts)


def test_selective_survives_hooks_that_run_other_ops_in_the_recompute():
    """FSDP2's hooks run inside a step (the sublayer's all-gather) and may run a different number of
    ops in the recompute than in the forward; ``selective`` must not care. Simulated with a pre-hook
    on every sublayer that runs one more op at each call."""
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    for scheme in ("pre", "post", "siamese", "hyper"):
        model = _lm(scheme).train()

        def busy(module, args, calls=[]):          # noqa: B006 (one list per model, on purpose)
            calls.append(1)
            for _ in calls:
                torch.ones(2, dtype=F64).add_(1)

        for sub in model.sublayers:
            sub.register_forward_pre_hook(busy)
        _assert_same(model, x, x.roll(-1, 1))


def test_errors_are_value_errors():
    with pytest.raises(ValueError, match="one of none, sublayer, selective"):
        set_activation_checkpointing(_lm("pre"), "layer")
    with pytest.raises(ValueError, match="SchemeHost"):
        set_activation_checkpointing(torch.nn.Linear(2, 2), "sublayer")


# ---- counting what a forward keeps ----------------------------------------------------------------
def test_bytes_saved_by_hand():
    a = torch.randn(10, 10, requires_grad=True)
    w = torch.nn.Parameter(torch.randn(10, 10))
    # (a @ w) keeps a and w (existing: not counted); tanh keeps its output h (400 bytes);
    # h * h keeps h once; the sum keeps nothing; the loss itself is 4 bytes.
    assert saved_activation_bytes(lambda: (torch.tanh(a @ w) ** 2).sum()) == 400 + 4
    # a product of two existing tensors keeps both, but they existed before: only the loss is new
    assert saved_activation_bytes(lambda: (a * w).sum()) == 4
    # a temporary that nothing keeps is not counted: exp's output feeds only a sum; the product
    # keeps the factor without gradient (for the other's gradient), not the one with it
    assert saved_activation_bytes(lambda: (a.detach().exp()).sum() * a.sum()) == 4 + 4
    # a view of an existing tensor is not new memory; a view of a new one counts its storage once
    assert saved_activation_bytes(lambda: (a[:5] * w[:5]).sum()) == 4
    x = torch.randn(4, 25, requires_grad=True)
    assert saved_activation_bytes(lambda: (torch.sigmoid(x).view(10, 10).t() @ w).sum()) == 400 + 4


def test_checkpointing_lowers_the_count_and_meta_counts_like_a_real_device():
    x = torch.randint(0, 64, (4, 8), generator=torch.Generator().manual_seed(1))
    for scheme in ("pre", "siamese"):
        model = _lm(scheme).eval()                 # measured in training mode, then restored
        got = {mode: activation_memory(model, x, x, mode) for mode in CHECKPOINTING_MODES}
        assert got["none"] > got["selective"] > got["sublayer"] > 0, (scheme, got)
        torch.manual_seed(0)
        meta = LanguageModel(model.config, device="meta", dtype=F64)
        xm = x.to("meta")
        assert {m: activation_memory(meta, xm, xm, m) for m in CHECKPOINTING_MODES} == got
        assert activation_checkpointing(model) == "none" and not model.training   # restored


def test_sublayer_keeps_each_steps_input_streams():
    """Under ``sublayer`` a step keeps only its input state, so one more block (two steps) adds one
    (B, T, d) float64 tensor per stream and step: one stream for Pre-Norm, two for SiameseNorm and
    ResiDual, n for hyper-connections (its streams are one (B, T, n, d) tensor)."""
    b, t, d = 4, 8, 32
    x = torch.randint(0, 64, (b, t), generator=torch.Generator().manual_seed(1))
    stream = b * t * d * 8
    for scheme, streams in (("pre", 1), ("siamese", 2), ("resi_dual", 2), ("hyper", 4)):
        options = {"n_streams": 4} if scheme == "hyper" else {}
        deeper, shallower = (activation_memory(_lm(scheme, options, n_layers=n), x, x, "sublayer")
                             for n in (3, 2))
        assert deeper - shallower == 2 * streams * stream, scheme
