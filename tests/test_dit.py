"""DiT with adaLN-Zero over every residual scheme (models/dit.py).

The SiameseNorm and Pre-Norm DiTs are checked against float64 references of the official DiT
block equations (papers.md 1.3 (b), and the standard DiT block for Pre-Norm), written with their own
attention, GELU(tanh) MLP, LayerNorm, position and timestep embeddings (tests/vision_ref.py), after
every parameter has been randomised (adaLN and the final layer start at zero, so the output would
be 0 otherwise).
"""

from __future__ import annotations

import math

import pytest
import torch

import siamesenorm as sn
from helpers import raises_value_error
from siamesenorm.diffusion import DiffusionObjective, create_diffusion, sample
from siamesenorm.errors import ConfigError
from siamesenorm.models import DIT_SIZES, DiT, DiTConfig
from vision_ref import attention, gelu_tanh, layernorm, linear, ln, mlp, patch_embed, randomize

F64 = torch.float64


def small(**overrides) -> DiTConfig:
    options = dict(input_size=8, patch_size=2, in_chans=3, num_classes=5, dim=16, n_layers=2,
                   n_heads=4, mlp_ratio=2.0, scheme="siamese")
    return DiTConfig(**(options | overrides))


def inputs(n=4, cfg=None, seed=0, dtype=F64):
    cfg = cfg or small()
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, cfg.in_chans, cfg.input_size, cfg.input_size, generator=g, dtype=dtype)
    t = torch.randint(0, 1000, (n,), generator=g)
    y = torch.randint(0, cfg.num_classes, (n,), generator=g)
    return x, t, y


# ---- reference pieces, from the DiT paper and code description --------------------------------
def ref_pos_embed(dim, grid):
    """Token (r, c): [sin(c w), cos(c w), sin(r w), cos(r w)], w_j = 10000^(-j / (dim / 4))."""
    q = dim // 4
    rows = []
    for r in range(grid):
        for c in range(grid):
            row = [math.sin(c * 10000 ** (-j / q)) for j in range(q)]
            row += [math.cos(c * 10000 ** (-j / q)) for j in range(q)]
            row += [math.sin(r * 10000 ** (-j / q)) for j in range(q)]
            row += [math.cos(r * 10000 ** (-j / q)) for j in range(q)]
            rows.append(row)
    return torch.tensor(rows, dtype=F64)


def ref_condition(model, t, y):
    """c = MLP(sinusoid(t)) + label_table[y], the sinusoid [cos(t f), sin(t f)], f_j = 1e4^(-j/128)."""
    half = model.config.frequency_dim // 2
    f = torch.tensor([10000 ** (-j / half) for j in range(half)], dtype=F64)
    args = t.to(F64)[:, None] * f
    feats = torch.cat((torch.cos(args), torch.sin(args)), dim=-1)
    mlp_ = model.t_embedder.mlp
    temb = linear(torch.nn.functional.silu(linear(feats, mlp_[0].weight, mlp_[0].bias)),
                  mlp_[2].weight, mlp_[2].bias)
    return temb + model.y_embedder.table.weight[y]


def silu(x):
    return x * torch.sigmoid(x)


def ref_mods(lin, c, k):
    return linear(silu(c), lin.weight, lin.bias).chunk(k, dim=-1)


def mod(h, shift, scale):
    return h * (1 + scale[:, None]) + shift[:, None]


def ref_branch(model, i, shift, scale, gate):
    sub, heads = model.sublayers[i], model.config.n_heads
    f = (lambda u: attention(u, sub, heads)) if i % 2 == 0 else (lambda u: mlp(u, sub, gelu_tanh))
    return lambda u: gate[:, None] * f(mod(u, shift, scale))


def ref_final(model, h, c):
    """FinalLayer: non-affine LN (eps 1e-6), shift/scale modulation, linear, unpatchify."""
    cfg = model.config
    shift, scale = ref_mods(model.final_layer.modulation[1], c, 2)
    out = linear(mod(layernorm(h), shift, scale), model.final_layer.linear.weight,
                 model.final_layer.linear.bias)
    b, g, p, ch = out.shape[0], cfg.grid_size, cfg.patch_size, cfg.out_channels
    img = torch.zeros(b, ch, g * p, g * p, dtype=F64)
    for r in range(g):
        for col in range(g):
            patch = out[:, r * g + col].reshape(b, p, p, ch).permute(0, 3, 1, 2)
            img[:, :, r * p:(r + 1) * p, col * p:(col + 1) * p] = patch
    return img


def ref_start(model, x, t, y):
    cfg = model.config
    h = patch_embed(x, model.x_embedder) + ref_pos_embed(cfg.dim, cfg.grid_size)
    return h, ref_condition(model, t, y)


def ref_siamese_dit(model, x, t, y):
    """dit-model-siamesenorm.py: u = postnorm(X); x_in = u + prenorm(Y);
    res = gate * F(modulate(LN(x_in))) (LN non-affine); X = u + res / sqrt(2 (l + 1)); Y += res.
    Head: FinalLayer(LN_X(X) + LN_Y(Y), c)."""
    s = model.scheme
    X, c = ref_start(model, x, t, y)
    Y = X
    for i in range(2 * model.config.n_layers):
        shifts = ref_mods(model.modulation[i // 2][1], c, 6)
        shift, scale, gate = shifts[:3] if i % 2 == 0 else shifts[3:]
        gm = math.sqrt(2 * (i // 2 + 1))
        u = ln(X, s.post_norm[i])
        res = ref_branch(model, i, shift, scale, gate)(layernorm(u + ln(Y, s.pre_norm[i])))
        X, Y = u + res / gm, Y + res
    return ref_final(model, ln(X, s.merge_norm_x) + ln(Y, s.merge_norm_y), c)


def ref_pre_dit(model, x, t, y):
    """The DiT block: h += gate * F(modulate(LN(h))) for attention then MLP; FinalLayer(h, c)."""
    h, c = ref_start(model, x, t, y)
    for i in range(2 * model.config.n_layers):
        shifts = ref_mods(model.modulation[i // 2][1], c, 6)
        shift, scale, gate = shifts[:3] if i % 2 == 0 else shifts[3:]
        h = h + ref_branch(model, i, shift, scale, gate)(layernorm(h))
    return ref_final(model, h, c)


# ---- against the official equations --------------------------------------------------------
@pytest.mark.parametrize("scheme, ref", [("siamese", ref_siamese_dit), ("pre", ref_pre_dit)])
def test_output_equals_the_official_dit_equations(scheme, ref):
    model = randomize(DiT(small(scheme=scheme), dtype=F64)).eval()
    x, t, y = inputs()
    # The branch-feeding norms are non-affine and the scheme adds no final norm of its own.
    assert all(not list(m.parameters()) for m in (model.scheme.pre_norm if scheme == "pre"
                                                   else model.scheme.input_norm))
    assert model.scheme.final_norm is None
    with torch.no_grad():
        torch.testing.assert_close(model(x, t, y), ref(model, x, t, y), atol=1e-6, rtol=1e-6)
        y_null = torch.full_like(y, model.config.num_classes)
        torch.testing.assert_close(model(x, t, y_null), ref(model, x, t, y_null), atol=1e-6,
                                   rtol=1e-6)


def test_reference_can_fail():
    """The siamese reference notices a wrong depth scale (here: none)."""
    model = randomize(DiT(small(scheme_options={"depth_scale": False}), dtype=F64)).eval()
    x, t, y = inputs()
    with torch.no_grad():
        assert not torch.allclose(model(x, t, y), ref_siamese_dit(model, x, t, y), atol=1e-4)


def test_position_embedding_is_fixed_and_matches_dit():
    model = DiT(small(dim=32))
    assert "pos_embed" not in dict(model.named_parameters())
    torch.testing.assert_close(model.pos_embed[0].double(), ref_pos_embed(32, 4), atol=1e-6, rtol=0)


# ---- every scheme ------------------------------------------------------------------------
def wake(model, seed=0):
    """Randomise the zero-initialised adaLN modulations and final layer, so gradients flow."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for lin in [m[1] for m in model.modulation] + [model.final_layer.modulation[1],
                                                       model.final_layer.linear]:
            lin.weight.copy_(torch.randn(lin.weight.shape, generator=g) * 0.1)
            lin.bias.copy_(torch.randn(lin.bias.shape, generator=g) * 0.1)
    return model


@pytest.mark.parametrize("scheme", sn.list_schemes())
def test_every_scheme_runs_forward_and_backward(scheme):
    torch.manual_seed(0)
    model = wake(DiT(small(scheme=scheme))).train()
    x, t, y = inputs(dtype=torch.float32)
    out = model(x, t, y)
    assert out.shape == (4, 6, 8, 8) and torch.isfinite(out).all()
    out.pow(2).mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    # Only the label table's rows are looked up; every tensor gets a gradient.
    assert not missing, f"parameters without a gradient: {missing}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())
    assert model.sublayers[1].approximate == "tanh"


# ---- shapes, errors, init ------------------------------------------------------------------
@pytest.mark.parametrize("learn_sigma, channels", [(True, 6), (False, 3)])
def test_output_shape(learn_sigma, channels):
    model = DiT(small(learn_sigma=learn_sigma))
    assert model.out_channels == channels
    x, t, y = inputs(2, dtype=torch.float32)
    assert model(x, t, y).shape == (2, channels, 8, 8)


@pytest.mark.parametrize("overrides, fragment", [
    ({"input_size": 9}, r"DiTConfig.input_size \(9\) must be divisible by DiTConfig.patch_size"),
    ({"dim": 18}, r"DiTConfig.dim \(18\) must be divisible by DiTConfig.n_heads"),
    ({"dim": 6, "n_heads": 2}, r"DiTConfig.dim \(6\) must be divisible by 4"),
    ({"class_dropout_prob": 1.0}, r"class_dropout_prob must be in \[0, 1\)"),
    ({"learn_sigma": "yes"}, "learn_sigma must be true or false"),
    ({"num_classes": 0}, "num_classes must be a positive integer"),
    ({"norm": "groupnorm"}, "unknown value 'groupnorm'"),
])
def test_bad_configs_are_refused_in_one_line(overrides, fragment):
    with pytest.raises(ConfigError, match=fragment) as info:
        small(**overrides)
    assert "\n" not in str(info.value)


def test_bad_inputs_are_refused():
    model = DiT(small())
    x, t, y = inputs(2, dtype=torch.float32)
    with raises_value_error(r"x must have shape \(batch, 3, 8, 8\)"):
        model(x[:, :1], t, y)
    with raises_value_error(r"t and y must have shape \(2,\)"):
        model(x, t[:1], y)
    with raises_value_error(r"labels must lie in 0..5"):
        model(x, t, torch.tensor([0, 6]))
    with raises_value_error("integer class labels"):
        model(x, t, y.float())
    with raises_value_error("even batch"):
        model.forward_with_cfg(x[:1], t[:1], y[:1], 4.0)
    with pytest.raises(ConfigError, match="unknown size 'DiT-XXL/2'"):
        DiTConfig.from_size("DiT-XXL/2")


def test_fresh_dit_outputs_exactly_zero_and_inits_like_dit():
    torch.manual_seed(0)
    model = DiT(small(scheme="siamese", dim=64, class_dropout_prob=0.0))
    x, t, y = inputs(3, small(dim=64), dtype=torch.float32)
    assert torch.equal(model(x, t, y), torch.zeros(3, 6, 8, 8))
    zeros = [m[1] for m in model.modulation] + [model.final_layer.modulation[1],
                                                model.final_layer.linear]
    assert all(not lin.weight.any() and not lin.bias.any() for lin in zeros)
    attn = model.sublayers[0]
    # q, k and v: Xavier-uniform of official DiT's fused (3d x d) qkv weight, sqrt(6 / (d + 3d)).
    fused = math.sqrt(6 / (64 + 3 * 64))
    for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert fused * 0.97 < proj.weight.abs().max() <= fused
        assert not proj.bias.any()
    square = math.sqrt(6 / (64 + 64))  # the output projection: a plain d x d Xavier-uniform
    assert square * 0.97 < attn.out_proj.weight.abs().max() <= square
    up = model.sublayers[1].up_proj.weight          # the MLP: Xavier over its own shape
    assert up.abs().max() <= math.sqrt(6 / sum(up.shape))
    table = model.y_embedder.table.weight
    assert table.shape == (6, 64)  # null label always present
    assert abs(model.t_embedder.mlp[0].weight.std().item() / 0.02 - 1) < 0.1
    conv = model.x_embedder.weight
    assert conv.abs().max() <= math.sqrt(6 / (3 * 4 + 64))  # Xavier over the flattened kernel
    assert not list(model.final_layer.norm.parameters())


def test_meta_build_equals_direct_build_after_reset_parameters():
    cfg = small(scheme="siamese")
    torch.manual_seed(3)
    direct = DiT(cfg)
    meta = DiT(cfg, device="meta")
    assert all(p.is_meta for p in meta.parameters())
    meta.to_empty(device="cpu")
    torch.manual_seed(3)
    meta.reset_parameters()
    a = {**dict(direct.named_parameters()), **dict(direct.named_buffers())}
    b = {**dict(meta.named_parameters()), **dict(meta.named_buffers())}
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=0, rtol=0, msg=name)


def test_scheme_options_can_override_the_head_defaults():
    model = DiT(small(scheme="pre", scheme_options={"final_norm": True, "branch_affine": True}))
    assert model.scheme.final_norm is not None and model.scheme.pre_norm[0].weight is not None


# ---- labels and guidance -----------------------------------------------------------------------
def test_labels_are_dropped_in_training_mode_only():
    model = DiT(small(class_dropout_prob=0.3))
    table = model.y_embedder.table.weight
    y = torch.zeros(4000, dtype=torch.long)
    null = table[model.config.num_classes]
    torch.manual_seed(0)
    rows = model.y_embedder(y, drop=True)
    dropped = (rows == null).all(-1).float().mean().item()
    assert abs(dropped - 0.3) < 0.03
    assert torch.equal(model.y_embedder(y, drop=False), table[y])
    # The model drops only in training mode; y == num_classes is the null label in any mode.
    wake(randomize(model))
    x, t, _ = inputs(64, dtype=torch.float32)
    y = torch.randint(0, 5, (64,), generator=torch.Generator().manual_seed(1))
    model.eval()
    assert torch.equal(model(x, t, y), model(x, t, y))
    model.train()
    torch.manual_seed(0)
    train_out, eval_out = model(x, t, y), model.eval()(x, t, y)
    changed = ~torch.isclose(train_out, eval_out).flatten(1).all(-1)
    assert 0 < changed.float().mean() < 0.7
    null_out = model(x, t, torch.full_like(y, 5))
    torch.testing.assert_close(train_out[changed], null_out[changed])


def test_cfg_scale_one_is_the_conditional_output_and_scale_s_extrapolates():
    model = wake(randomize(DiT(small(class_dropout_prob=0.5), dtype=F64))).train()
    x, t, y = inputs(3)
    null = torch.full_like(y, 5)
    batch_x, batch_t, batch_y = torch.cat((x, x)), torch.cat((t, t)), torch.cat((y, null))
    with torch.no_grad():
        cond, uncond = model.eval()(x, t, y), model(x, t, null)
        model.train()  # forward_with_cfg never drops labels, even in training mode
        one = model.forward_with_cfg(batch_x, batch_t, batch_y, 1.0)
        four = model.forward_with_cfg(batch_x, batch_t, batch_y, 4.0)
    eps = slice(0, 3)
    torch.testing.assert_close(one[:3], cond, atol=1e-12, rtol=0)
    torch.testing.assert_close(one[3:, eps], cond[:, eps], atol=1e-12, rtol=0)
    torch.testing.assert_close(one[3:, 3:], uncond[:, 3:], atol=1e-12, rtol=0)
    guided = uncond[:, eps] + 4.0 * (cond[:, eps] - uncond[:, eps])
    torch.testing.assert_close(four[:3, eps], guided, atol=1e-12, rtol=0)
    torch.testing.assert_close(four[3:, eps], guided, atol=1e-12, rtol=0)
    torch.testing.assert_close(four[:3, 3:], cond[:, 3:], atol=1e-12, rtol=0)


# ---- sizes ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name, millions", [("S", 33), ("B", 130), ("L", 458)])
def test_dit_sizes_match_the_paper(name, millions):
    """DiT paper, Table 1: 33M, 130M, 458M parameters (the patch size barely changes them)."""
    for patch in (2, 4):
        cfg = DiTConfig.from_size(f"DiT-{name}/{patch}")
        assert cfg.patch_size == patch
        model = DiT(cfg, device="meta")
        assert abs(model.num_parameters() / 1e6 / millions - 1) < 0.01


def test_digits_size():
    cfg = DiTConfig.from_size("digits", learn_sigma=False)
    assert (cfg.input_size, cfg.patch_size, cfg.in_chans, cfg.dim, cfg.n_layers, cfg.n_heads) == \
        (8, 2, 1, 64, 4, 4)
    assert "DiT-B/2" in DIT_SIZES and "DiT-L/4" in DIT_SIZES
    model = DiT(cfg)
    x = torch.randn(2, 1, 8, 8)
    assert model(x, torch.tensor([0, 999]), torch.tensor([3, 10])).shape == (2, 1, 8, 8)


# ---- sampling a real DiT -------------------------------------------------------------------
@pytest.fixture(scope="module", params=[False, True], ids=["fixed-sigma", "learn-sigma"])
def trained_dit(request) -> DiffusionObjective:
    """A tiny DiT trained for 40 Adam steps on two flat classes (dark, bright), over a 100-step
    linear process (the scaled schedule), with label dropout so that guidance has a null class."""
    torch.manual_seed(0)
    cfg = small(learn_sigma=request.param, class_dropout_prob=0.2, num_classes=2, in_chans=1, dim=32)
    objective = DiffusionObjective(DiT(cfg), create_diffusion(num_timesteps=100))
    optimizer = torch.optim.Adam(objective.parameters(), lr=3e-3)
    x = torch.cat([torch.full((16, 1, 8, 8), -0.8), torch.full((16, 1, 8, 8), 0.8)])
    y = torch.tensor([0] * 16 + [1] * 16)
    losses = []
    for _ in range(40):
        loss = objective(x, y).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    return objective


@pytest.mark.parametrize("method", ["ddpm", "ddim"])
@pytest.mark.parametrize("cfg_scale", [1.0, 4.0])
def test_a_trained_dit_samples_images_of_the_right_shape_in_range(trained_dit, method, cfg_scale):
    labels = torch.tensor([0, 1, 1, 0, 1])
    assert trained_dit.training

    def draw(scale: float = cfg_scale) -> torch.Tensor:
        return sample(trained_dit, labels, method=method, steps=10, cfg_scale=scale,
                      generator=torch.Generator().manual_seed(1))

    out = draw()
    assert out.shape == (5, 1, 8, 8) and out.dtype == torch.float32
    assert torch.isfinite(out).all() and out.min() >= -1.0 and out.max() <= 1.0
    assert (out.abs() < 1).float().mean() > 0.5      # mostly inside the range, not clipped noise
    assert out.std() > 0.1                           # not a constant image
    assert trained_dit.training                      # its mode is given back
    assert torch.equal(draw(), out)                  # the generator fixes the samples
    if cfg_scale != 1.0:
        assert not torch.allclose(draw(1.0), out)    # guidance changes what is drawn
