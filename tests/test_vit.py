"""The DeiT-style vision transformer over every residual scheme (models/vit.py).

The SiameseNorm and Pre-Norm models are checked against float64 references written from the
equations of the official DeiT files (papers.md 1.3 (a)) with their own attention, MLP and
LayerNorm (tests/vision_ref.py), after every parameter, norms included, has been randomised.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import siamesenorm as sn
from helpers import raises_value_error
from siamesenorm.errors import ConfigError
from siamesenorm.models import VIT_SIZES, VisionTransformer, ViTConfig, ViTOutput
from siamesenorm.models.vit import drop_path
from vision_ref import attention, gelu, linear, ln, mlp, patch_embed, randomize

F64 = torch.float64


def small(**overrides) -> ViTConfig:
    options = dict(image_size=8, patch_size=4, in_chans=3, num_classes=5, dim=16, n_layers=2,
                   n_heads=4, mlp_ratio=2.0, drop_path=0.1, scheme="siamese")
    return ViTConfig(**(options | overrides))


def images(n=3, cfg=None, seed=0):
    cfg = cfg or small()
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, cfg.in_chans, cfg.image_size, cfg.image_size, generator=g, dtype=F64)


def branch(model, i):
    """The reference sublayer ``i``: attention (even) or GELU MLP (odd), from model's weights."""
    sub, heads = model.sublayers[i], model.config.n_heads
    return (lambda u: attention(u, sub, heads)) if i % 2 == 0 else (lambda u: mlp(u, sub, gelu))


def tokens(model, x):
    cls = model.cls_token.expand(x.shape[0], -1, -1)
    return torch.cat((cls, patch_embed(x, model.patch_embed)), dim=1) + model.pos_embed


def ref_siamese_deit(model, x):
    """deit-model-siamesenorm.py: per sublayer X = LN^X(X); z = F(LN^in(X + LN^Y(Y)));
    X += z / sqrt(2 (l + 1)); Y += z. Head on the class token of LN(LN(X) + LN(Y))."""
    s = model.scheme
    X = Y = tokens(model, x)
    for i in range(2 * model.config.n_layers):
        c = math.sqrt(2 * (i // 2 + 1))
        X = ln(X, s.post_norm[i])
        z = branch(model, i)(ln(X + ln(Y, s.pre_norm[i]), s.input_norm[i]))
        X, Y = X + z / c, Y + z
    out = ln(ln(X, s.merge_norm_x) + ln(Y, s.merge_norm_y), s.final_norm)
    return linear(out[:, 0], model.head.weight, model.head.bias)


def ref_pre_deit(model, x):
    """DeiT: h += attn(LN1(h)); h += mlp(LN2(h)); head on the class token of LN(h)."""
    s, h = model.scheme, tokens(model, x)
    for i in range(2 * model.config.n_layers):
        h = h + branch(model, i)(ln(h, s.pre_norm[i]))
    return linear(ln(h, s.final_norm)[:, 0], model.head.weight, model.head.bias)


# ---- against the official equations --------------------------------------------------------
@pytest.mark.parametrize("scheme, ref", [("siamese", ref_siamese_deit), ("pre", ref_pre_deit)])
def test_logits_equal_the_official_deit_equations(scheme, ref):
    model = randomize(VisionTransformer(small(scheme=scheme), dtype=F64)).eval()
    x = images()
    with torch.no_grad():
        torch.testing.assert_close(model(x).logits, ref(model, x), atol=1e-6, rtol=1e-6)
        assert model.scheme.eps == 1e-6


def test_siamese_reference_is_sensitive_to_the_head_norms():
    """The comparison above can fail: perturbing one merge norm moves the logits."""
    model = randomize(VisionTransformer(small(), dtype=F64)).eval()
    x = images()
    with torch.no_grad():
        before = model(x).logits
        model.scheme.merge_norm_y.weight.mul_(1.5)
        assert not torch.allclose(model(x).logits, before, atol=1e-6)
        torch.testing.assert_close(model(x).logits, ref_siamese_deit(model, x), atol=1e-6, rtol=1e-6)


# ---- every scheme ------------------------------------------------------------------------
@pytest.mark.parametrize("scheme", sn.list_schemes())
def test_every_scheme_trains_one_step_with_finite_gradients(scheme):
    torch.manual_seed(0)
    model = VisionTransformer(small(scheme=scheme, drop_path=0.2)).train()
    out = model(images(4).float(), torch.tensor([0, 1, 2, 3]))
    assert out.logits.shape == (4, 5) and torch.isfinite(out.loss)
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"parameters without a gradient: {missing}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


def test_schemes_requirements_reach_the_sublayers():
    hybrid = VisionTransformer(small(scheme="hybridnorm"))
    assert all(hybrid.sublayers[i].v_norm is not None for i in (0, 2))
    torch.manual_seed(0)
    cfg = small(scheme="deepnorm", dim=64, n_heads=4, mlp_ratio=4.0)
    deep = VisionTransformer(cfg)
    beta = deep.scheme.beta
    attn, ffn = deep.sublayers[2], deep.sublayers[3]

    def std_ratio(w, expected):
        return w.std().item() / expected

    assert abs(std_ratio(attn.q_proj.weight, math.sqrt(2 / 128)) - 1) < 0.1
    assert abs(std_ratio(attn.v_proj.weight, beta * math.sqrt(2 / 128)) - 1) < 0.1
    assert abs(std_ratio(ffn.up_proj.weight, beta * math.sqrt(2 / (64 + 256))) - 1) < 0.1


# ---- shapes, errors, init ------------------------------------------------------------------
def test_shapes_features_and_output_type():
    model = VisionTransformer(small(dim=32, n_heads=4)).eval()
    x = images(2).float()
    out = model(x)
    assert isinstance(out, ViTOutput) and out.loss is None
    assert out.logits.shape == (2, 5)
    assert model.forward_tokens(x).shape == (2, 5, 32)  # class token + 4 patches
    feats = model.features(x)
    assert feats.shape == (2, 32)
    torch.testing.assert_close(model.head(feats), out.logits)


@pytest.mark.parametrize("overrides, fragment", [
    ({"image_size": 10}, r"ViTConfig.image_size \(10\) must be divisible by ViTConfig.patch_size"),
    ({"dim": 18}, r"ViTConfig.dim \(18\) must be divisible by ViTConfig.n_heads"),
    ({"drop_path": 1.0}, r"ViTConfig.drop_path must be in \[0, 1\)"),
    ({"dropout": -0.1}, r"ViTConfig.dropout must be in \[0, 1\)"),
    ({"label_smoothing": 1}, r"ViTConfig.label_smoothing must be in"),
    ({"n_layers": 0}, "ViTConfig.n_layers must be a positive integer"),
    ({"norm": "batchnorm"}, "ViTConfig.norm: unknown value 'batchnorm'"),
    ({"mlp_ratio": 0.01}, "gives an empty MLP"),
    ({"scheme_options": [1]}, "scheme_options must be a mapping"),
])
def test_bad_configs_are_refused_in_one_line(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment) as info:
        small(**overrides)
    assert "\n" not in str(info.value)


def test_bad_schemes_sizes_and_inputs_are_refused():
    with pytest.raises(ConfigError, match="unknown scheme 'siamse'"):
        VisionTransformer(small(scheme="siamse"))
    with pytest.raises(ConfigError, match="has no option 'depth'"):
        VisionTransformer(small(scheme_options={"depth": 1}))
    with pytest.raises(ConfigError, match="unknown size 'DeiT-XL'"):
        ViTConfig.from_size("DeiT-XL")
    model = VisionTransformer(small())
    with raises_value_error(r"images must have shape \(batch, 3, 8, 8\)"):
        model(torch.zeros(2, 3, 16, 16))
    with raises_value_error(r"class-index targets must have shape \(2,\)"):
        model(torch.zeros(2, 3, 8, 8), torch.zeros(2, 1, dtype=torch.long))
    with raises_value_error(r"soft targets must have shape \(2, 5\)"):
        model(torch.zeros(2, 3, 8, 8), torch.zeros(2, 4))


def test_init_follows_deit():
    torch.manual_seed(0)
    model = VisionTransformer(small(dim=64, n_heads=4, image_size=32, patch_size=4))
    for name, p in model.named_parameters():
        if name.endswith("bias") and not name.startswith(("patch_embed", "scheme")):
            assert not p.any(), name
    for name in ("sublayers.0.q_proj.weight", "sublayers.1.down_proj.weight", "head.weight",
                 "pos_embed"):
        p = dict(model.named_parameters())[name]
        assert abs(p.std().item() / 0.02 - 1) < 0.1, name
    norms = [m for m in model.scheme.modules() if hasattr(m, "eps") and m is not model.scheme]
    assert norms and all(torch.equal(m.weight, torch.ones_like(m.weight)) for m in norms)
    assert all(m.eps == 1e-6 for m in norms)


def test_meta_build_equals_direct_build_after_reset_parameters():
    cfg = small(scheme="siamese")
    torch.manual_seed(3)
    direct = VisionTransformer(cfg)
    meta = VisionTransformer(cfg, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    torch.manual_seed(3)
    meta.reset_parameters()
    for (name, a), (_, b) in zip(direct.state_dict().items(), meta.state_dict().items(), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0, msg=name)


# ---- drop-path -------------------------------------------------------------------------------
def test_drop_path_zeroes_whole_samples_and_keeps_the_mean():
    torch.manual_seed(0)
    x = torch.ones(4000, 3, 2, dtype=F64)
    y = drop_path(x, 0.25)
    per_sample = y.flatten(1)
    assert set(per_sample.unique().tolist()) <= {0.0, 1 / 0.75}
    assert torch.all(per_sample.min(1).values == per_sample.max(1).values)  # whole samples
    assert abs((per_sample[:, 0] == 0).float().mean().item() - 0.25) < 0.03
    assert drop_path(x, 0.25, training=False) is x and drop_path(x, 0.0) is x


def test_drop_path_rates_rise_linearly_and_are_off_in_eval():
    model = VisionTransformer(small(n_layers=5, drop_path=0.4))
    assert model.drop_path_rates == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.4])
    randomize(model)
    x = images(8).float()
    reference = VisionTransformer(small(n_layers=5, drop_path=0.0))
    reference.load_state_dict(model.state_dict())
    model.eval()
    reference.eval()
    torch.testing.assert_close(model(x).logits, reference(x).logits, atol=0, rtol=0)
    model.train()
    torch.manual_seed(1)
    first = model(x).logits
    assert not torch.allclose(first, model(x).logits)  # stochastic in training


# ---- loss ------------------------------------------------------------------------------------
def log_softmax(z):
    return z - torch.logsumexp(z, dim=-1, keepdim=True)


def test_loss_smooths_integer_targets_in_training_only():
    model = randomize(VisionTransformer(small(drop_path=0.0, label_smoothing=0.2), dtype=F64))
    x, targets = images(6), torch.tensor([0, 1, 2, 3, 4, 0])
    out = model.train()(x, targets)
    logp = log_softmax(out.logits)
    nll = -logp[torch.arange(6), targets].mean()
    uniform = -logp.mean(-1).mean()
    torch.testing.assert_close(out.loss, 0.8 * nll + 0.2 * uniform)
    out = model.eval()(x, targets)
    torch.testing.assert_close(out.loss, -log_softmax(out.logits)[torch.arange(6), targets].mean())
    assert not torch.allclose(out.loss, 0.8 * nll + 0.2 * uniform)


def test_soft_targets_take_plain_cross_entropy_in_both_modes():
    model = randomize(VisionTransformer(small(drop_path=0.0), dtype=F64))
    x = images(4)
    soft = torch.softmax(torch.randn(4, 5, dtype=F64, generator=torch.Generator().manual_seed(2)), -1)
    for mode in (True, False):
        out = model.train(mode)(x, soft)
        expected = -(soft * log_softmax(out.logits)).sum(-1).mean()
        torch.testing.assert_close(out.loss, expected)


# ---- sizes and accounting --------------------------------------------------------------------
@pytest.mark.parametrize("size, params, gmacs", [
    ("DeiT-T", 5_717_416, 1.3), ("DeiT-S", 22_050_664, 4.6), ("DeiT-B", 86_567_656, 17.6)])
def test_deit_sizes_match_the_paper(size, params, gmacs):
    """Parameter counts of the timm/DeiT models and the DeiT paper's (multiply-add) GFLOPs."""
    model = VisionTransformer(ViTConfig.from_size(size), device="meta")
    assert model.num_parameters() == params
    assert abs(model.flops_per_image() / 2e9 / gmacs - 1) < 0.05
    cfg = ViTConfig.from_size(size, scheme="siamese")
    siamese = VisionTransformer(cfg, device="meta")
    # Per sublayer LN^X, LN^Y, LN^in instead of one pre-norm; at exit three norms instead of one.
    extra_norms = 2 * (2 * cfg.n_layers) + 2
    assert siamese.num_parameters() - params == extra_norms * 2 * cfg.dim


def test_sizes_dict_and_digits_size():
    assert {"DeiT-T", "DeiT-S", "DeiT-B", "digits"} <= set(VIT_SIZES)
    cfg = ViTConfig.from_size("digits", scheme="siamese")
    assert (cfg.image_size, cfg.patch_size, cfg.in_chans, cfg.num_classes) == (8, 2, 1, 10)
    assert (cfg.dim, cfg.n_layers, cfg.n_heads, cfg.seq_len) == (64, 6, 4, 17)
    out = VisionTransformer(cfg)(torch.zeros(2, 1, 8, 8))
    assert out.logits.shape == (2, 10)


# ---- learns --------------------------------------------------------------------------------
def prototype_task(n, g, prototypes):
    """Class k: prototype image k plus strong noise (linearly separable in expectation)."""
    labels = torch.randint(0, len(prototypes), (n,), generator=g)
    return prototypes[labels] + 0.8 * torch.randn(n, 1, 8, 8, generator=g), labels


def test_tiny_siamese_vit_learns_a_separable_task():
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    prototypes = torch.randn(4, 1, 8, 8, generator=g)
    cfg = ViTConfig(image_size=8, patch_size=4, in_chans=1, num_classes=4, dim=32, n_layers=2,
                    n_heads=2, drop_path=0.0, scheme="siamese")
    model = VisionTransformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
    x, y = prototype_task(256, g, prototypes)
    with torch.no_grad():
        initial = model.eval()(x, y).loss.item()
    for _ in range(120):
        xb, yb = prototype_task(16, g, prototypes)
        loss = model.train()(xb, yb).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        out = model.eval()(x, y)
    accuracy = (out.logits.argmax(-1) == y).float().mean().item()
    assert initial > 1.2 and accuracy > 0.95 and out.loss.item() < 0.3
    assert F.cross_entropy(out.logits, y).item() == pytest.approx(out.loss.item())


# ---- timm ------------------------------------------------------------------------------------
def test_timm_entry_points_build_without_timm():
    from siamesenorm.models import timm_models

    registered = []
    names = timm_models.register_timm_models(lambda fn: registered.append(fn) or fn)
    assert "vit_siamese_tiny_patch16_224" in names and "vit_pre_base_patch16_224" in names
    assert len(names) == 3 * len(sn.list_schemes()) == len(registered)
    fn = next(f for f in registered if f.__name__ == "vit_siamese_small_patch16_224")
    model = fn(pretrained=False, num_classes=7, img_size=32, drop_path_rate=0.0, drop_rate=None,
               pretrained_cfg=None)
    assert model.config.scheme == "siamese" and model.config.dim == 384
    assert model.pretrained_cfg["input_size"] == (3, 32, 32)
    logits = model.eval()(torch.zeros(2, 3, 32, 32))
    assert logits.shape == (2, 7) and model.num_classes == 7
    model.reset_classifier(3)
    assert model(torch.zeros(1, 3, 32, 32)).shape == (1, 3)
    with pytest.raises(ConfigError, match="no pretrained"):
        fn(pretrained=True)
    with pytest.raises(ConfigError, match="bn_momentum"):
        fn(bn_momentum=0.1)


def test_timm_registration():
    timm = pytest.importorskip("timm")
    import siamesenorm.models.timm_models  # noqa: F401  (registers)

    assert "vit_siamese_tiny_patch16_224" in timm.list_models("vit_siamese_*")
    model = timm.create_model("vit_pre_tiny_patch16_224", num_classes=10, img_size=32,
                              drop_path_rate=0.05)
    assert model.config.scheme == "pre" and model.config.drop_path == 0.05
    assert model(torch.zeros(1, 3, 32, 32)).shape == (1, 10)


def test_without_timm_nothing_is_registered():
    try:
        import timm  # noqa: F401
    except Exception:  # noqa: BLE001
        from siamesenorm.models import timm_models

        assert timm_models.REGISTERED == []
    else:
        pytest.skip("timm is installed")
