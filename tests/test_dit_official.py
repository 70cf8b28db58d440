"""The official DiT interface (models/dit_official.py): ``DiT_models`` and the official module tree.

The reference layout, forward and init below are written from the DiT paper (arXiv 2212.09748) and
the module names and steps of its code, not from our model: the forward reads an official-layout
state dict directly (patchify, + pos, c = t_emb + y_emb, adaLN-Zero blocks with a fused qkv, final
modulated LN, linear, unpatchify), in float64. ``OfficialCalls`` makes the calls train.py and
sample.py make of the official diffusion package, on siamesenorm.diffusion.
"""

from __future__ import annotations

import copy
import inspect
import io
import itertools
import math
import re

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import siamesenorm as sn
from siamesenorm.diffusion import create_diffusion, training_losses
from siamesenorm.diffusion.likelihood import mean_flat
from siamesenorm.diffusion.objective import vb_terms
from siamesenorm.models import DiT, DiT_models, DiTConfig
from siamesenorm.models.dit import TimestepEmbedder, modulate
from siamesenorm.models.dit_official import OfficialDiT
from siamesenorm.schemes import fusion
from vision_ref import randomize

F64 = torch.float64
NAMES = ["DiT-XL/2", "DiT-XL/4", "DiT-XL/8", "DiT-L/2", "DiT-L/4", "DiT-L/8",
         "DiT-B/2", "DiT-B/4", "DiT-B/8", "DiT-S/2", "DiT-S/4", "DiT-S/8"]
SIZES = {"XL": (28, 1152, 16), "L": (24, 1024, 16), "B": (12, 768, 12), "S": (12, 384, 6)}
KWARGS = {"input_size": 32, "in_channels": 4, "num_classes": 1000, "learn_sigma": True,
          "class_dropout_prob": 0.1, "mlp_ratio": 4.0, "scheme": "siamese", "scheme_options": None}
S8 = {"input_size": 16, "num_classes": 10}          # DiT-S/8 on 16 x 16 latents: 4 tokens
# A small custom size through the official constructor's arguments.
TINY = {"input_size": 8, "patch_size": 2, "in_channels": 3, "hidden_size": 32, "depth": 2,
        "num_heads": 4, "mlp_ratio": 2.0, "class_dropout_prob": 0.1, "num_classes": 5}


def size_of(name):
    depth, hidden, heads = SIZES[name.split("-")[1].split("/")[0]]
    return depth, hidden, heads, int(name.split("/")[1])


# ---- the official layout, written from the module structure -----------------------------------
def official_layout(depth, hidden, heads, patch, *, input_size=32, in_channels=4, num_classes=1000,
                    learn_sigma=True, class_dropout_prob=0.1, mlp_ratio=4.0):
    """[(key, shape)] of the official DiT, in its module order."""
    tokens = (input_size // patch) ** 2
    out = in_channels * (2 if learn_sigma else 1)
    ff = int(hidden * mlp_ratio)
    d = hidden
    layout = [("pos_embed", (1, tokens, d)),
              ("x_embedder.proj.weight", (d, in_channels, patch, patch)), ("x_embedder.proj.bias", (d,)),
              ("t_embedder.mlp.0.weight", (d, 256)), ("t_embedder.mlp.0.bias", (d,)),
              ("t_embedder.mlp.2.weight", (d, d)), ("t_embedder.mlp.2.bias", (d,)),
              ("y_embedder.embedding_table.weight", (num_classes + int(class_dropout_prob > 0), d))]
    for b in range(depth):
        layout += [(f"blocks.{b}.{name}", shape) for name, shape in (
            ("attn.qkv.weight", (3 * d, d)), ("attn.qkv.bias", (3 * d,)),
            ("attn.proj.weight", (d, d)), ("attn.proj.bias", (d,)),
            ("mlp.fc1.weight", (ff, d)), ("mlp.fc1.bias", (ff,)),
            ("mlp.fc2.weight", (d, ff)), ("mlp.fc2.bias", (d,)),
            ("adaLN_modulation.1.weight", (6 * d, d)), ("adaLN_modulation.1.bias", (6 * d,)))]
    layout += [("final_layer.linear.weight", (patch * patch * out, d)),
               ("final_layer.linear.bias", (patch * patch * out,)),
               ("final_layer.adaLN_modulation.1.weight", (2 * d, d)),
               ("final_layer.adaLN_modulation.1.bias", (2 * d,))]
    return layout


def tiny_layout(**overrides):
    kw = TINY | overrides
    return official_layout(kw["depth"], kw["hidden_size"], kw["num_heads"], kw["patch_size"],
                           input_size=kw["input_size"], in_channels=kw["in_channels"],
                           num_classes=kw["num_classes"], learn_sigma=kw.get("learn_sigma", True),
                           class_dropout_prob=kw["class_dropout_prob"], mlp_ratio=kw["mlp_ratio"])


def s8_layout():
    return official_layout(*size_of("DiT-S/8"), **S8)


def layout_of(model):
    return [(key, tuple(value.shape)) for key, value in model.state_dict().items()]


def random_official(layout, seed=0, dtype=F64):
    """An official-layout state dict with random values: weights ~ N(0, 1 / fan_in), biases and
    the position embedding ~ 0.3 N(0, 1), the label table ~ N(0, 1)."""
    g = torch.Generator().manual_seed(seed)
    sd = {}
    for key, shape in layout:
        noise = torch.randn(shape, generator=g, dtype=dtype)
        if key.endswith("weight") and len(shape) > 1 and "embedding_table" not in key:
            noise = noise / math.sqrt(math.prod(shape[1:]))
        elif "embedding_table" not in key:
            noise = 0.3 * noise
        sd[key] = noise
    return sd


# ---- the reference forward, from the paper's equations -----------------------------------------
def _lin(sd, name, x):
    return x @ sd[name + ".weight"].T + sd[name + ".bias"]


def _silu(x):
    return x * torch.sigmoid(x)


def _ln(x, eps=1e-6):
    mean = x.mean(-1, keepdim=True)
    var = ((x - mean) ** 2).mean(-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps)


def _modulate(x, shift, scale):
    return x * (1 + scale[:, None]) + shift[:, None]


def _gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))


def _attention(sd, b, x, heads):
    n, tokens, d = x.shape
    qkv = _lin(sd, f"blocks.{b}.attn.qkv", x).reshape(n, tokens, 3, heads, d // heads)
    q, k, v = qkv.permute(2, 0, 3, 1, 4)                     # each (n, heads, tokens, head_dim)
    weights = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // heads), dim=-1)
    return _lin(sd, f"blocks.{b}.attn.proj", (weights @ v).transpose(1, 2).reshape(n, tokens, d))


def _mlp(sd, b, x):
    return _lin(sd, f"blocks.{b}.mlp.fc2", _gelu_tanh(_lin(sd, f"blocks.{b}.mlp.fc1", x)))


def ref_forward(sd, x, t, y, *, heads):
    """The official DiT's output ``(N, C_out, H, W)`` for an official state dict ``sd``."""
    sd = {key: value.to(F64) for key, value in sd.items()}
    x = x.to(F64)
    n, c, size, _ = x.shape
    w = sd["x_embedder.proj.weight"]
    d, p = w.shape[0], w.shape[-1]
    g = size // p
    patches = x.reshape(n, c, g, p, g, p).permute(0, 2, 4, 1, 3, 5).reshape(n, g * g, c * p * p)
    h = patches @ w.reshape(d, -1).T + sd["x_embedder.proj.bias"] + sd["pos_embed"]
    half = 128
    freqs = torch.tensor([10000.0 ** (-j / half) for j in range(half)], dtype=F64)
    angles = t.to(F64)[:, None] * freqs
    features = torch.cat((torch.cos(angles), torch.sin(angles)), dim=-1)
    cond = _lin(sd, "t_embedder.mlp.2", _silu(_lin(sd, "t_embedder.mlp.0", features)))
    cond = cond + sd["y_embedder.embedding_table.weight"][y]
    depth = len({key.split(".")[1] for key in sd if key.startswith("blocks.")})
    for b in range(depth):
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = _lin(
            sd, f"blocks.{b}.adaLN_modulation.1", _silu(cond)).chunk(6, dim=-1)
        h = h + gate_msa[:, None] * _attention(sd, b, _modulate(_ln(h), shift_msa, scale_msa), heads)
        h = h + gate_mlp[:, None] * _mlp(sd, b, _modulate(_ln(h), shift_mlp, scale_mlp))
    shift, scale = _lin(sd, "final_layer.adaLN_modulation.1", _silu(cond)).chunk(2, dim=-1)
    out = _lin(sd, "final_layer.linear", _modulate(_ln(h), shift, scale))   # (n, g*g, p*p*C)
    ch = out.shape[-1] // (p * p)
    return out.reshape(n, g, g, p, p, ch).permute(0, 5, 1, 3, 2, 4).reshape(n, ch, size, size)


def ref_forward_with_cfg(sd, x, t, y, cfg_scale, *, heads):
    """Official guidance: the first half of the batch run twice, the first 3 channels guided."""
    half = x[: len(x) // 2]
    out = ref_forward(sd, torch.cat((half, half)), t, y, heads=heads)
    eps, rest = out[:, :3], out[:, 3:]
    cond, uncond = eps.chunk(2)
    guided = uncond + cfg_scale * (cond - uncond)
    return torch.cat((torch.cat((guided, guided)), rest), dim=1)


def inputs(n, channels, size, num_classes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, channels, size, size, generator=g, dtype=F64),
            torch.randint(0, 1000, (n,), generator=g), torch.randint(0, num_classes, (n,), generator=g))


def assert_relative(actual, expected, rel=1e-6):
    scale = expected.abs().max().item()
    assert scale > 0
    err = (actual.to(F64) - expected).abs().max().item()
    assert err <= rel * scale, f"max error {err:.3g} > {rel:g} x {scale:.3g}"


# ---- (a) the twelve names, their sizes and keyword arguments -----------------------------------
def test_the_twelve_official_names():
    assert list(DiT_models) == NAMES
    import siamesenorm.models as models
    assert "DiT_models" in models.__all__ and models.DiT_models is DiT_models


@pytest.mark.parametrize("name", NAMES)
def test_each_name_has_its_size_and_the_official_defaults(name):
    depth, hidden, heads, patch = size_of(name)
    fn = DiT_models[name]
    assert fn.__name__ == name.replace("-", "_").replace("/", "_")
    model = fn(scheme="pre", device="meta")
    assert isinstance(model, OfficialDiT) and isinstance(model, DiT)
    cfg = model.config
    assert (cfg.n_layers, cfg.dim, cfg.n_heads, cfg.patch_size) == (depth, hidden, heads, patch)
    assert (cfg.input_size, cfg.in_chans, cfg.num_classes, cfg.learn_sigma, cfg.class_dropout_prob,
            cfg.mlp_ratio) == (32, 4, 1000, True, 0.1, 4.0)
    assert (model.num_heads, model.patch_size, model.in_channels, model.out_channels,
            model.learn_sigma) == (heads, patch, 4, 8, True)
    assert layout_of(model) == official_layout(depth, hidden, heads, patch)


def test_the_functions_take_the_official_keyword_arguments():
    for fn in DiT_models.values():
        params = inspect.signature(fn).parameters
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values())
        defaults = {name: p.default for name, p in params.items()}
        assert {name: defaults[name] for name in KWARGS} == KWARGS
    model = DiT_models["DiT-S/8"](input_size=16, in_channels=3, num_classes=7, learn_sigma=False,
                                  class_dropout_prob=0.0, mlp_ratio=2.0, device="meta")
    cfg = model.config
    assert (cfg.input_size, cfg.in_chans, cfg.num_classes, cfg.learn_sigma, cfg.class_dropout_prob,
            cfg.mlp_ratio, cfg.scheme) == (16, 3, 7, False, 0.0, 2.0, "siamese")
    assert model.out_channels == 3 and model.blocks[1].mlp.fc1.out_features == 768
    with pytest.raises(TypeError):
        DiT_models["DiT-S/8"](depth=2)            # the size comes from the name, as officially
    with pytest.raises(TypeError):
        DiT_models["DiT-S/8"](16)                 # keywords only, as officially (**kwargs)


def test_dit_xl_2_has_the_official_parameter_count():
    """675M (DiT paper, Table 1): 675,129,632 entries, the fixed position embedding included."""
    model = DiT_models["DiT-XL/2"](scheme="pre", device="meta")
    total = sum(math.prod(shape) for _, shape in official_layout(28, 1152, 16, 2))
    assert sum(v.numel() for v in model.state_dict().values()) == total == 675_129_632
    assert model.num_parameters() == total - 256 * 1152


# ---- (b) the key layout --------------------------------------------------------------------------
@pytest.mark.parametrize("build, layout", [
    (lambda: DiT_models["DiT-S/8"](scheme="pre", **S8), s8_layout),
    (lambda: OfficialDiT(scheme="pre", **TINY), tiny_layout),
    (lambda: OfficialDiT(scheme="pre", **TINY | {"class_dropout_prob": 0.0, "learn_sigma": False}),
     lambda: tiny_layout(class_dropout_prob=0.0, learn_sigma=False)),
], ids=["DiT-S/8", "tiny", "tiny-no-dropout-no-sigma"])
def test_pre_norm_state_dict_has_exactly_the_official_keys_and_shapes(build, layout):
    model = build()
    assert layout_of(model) == layout()
    # The position embedding saved is the fixed 2-D sin-cos one: column first, then row.
    pos = model.state_dict()["pos_embed"][0].to(F64)
    d, grid = pos.shape[1], math.isqrt(pos.shape[0])
    q = d // 4
    w = torch.tensor([10000.0 ** (-j / q) for j in range(q)], dtype=F64)
    rows, cols = torch.meshgrid(torch.arange(grid, dtype=F64), torch.arange(grid, dtype=F64),
                                indexing="ij")
    c, r = cols.reshape(-1, 1) * w, rows.reshape(-1, 1) * w
    ref = torch.cat((torch.sin(c), torch.cos(c), torch.sin(r), torch.cos(r)), dim=1)
    torch.testing.assert_close(pos, ref, atol=1e-6, rtol=0)


# ---- (c) an official state dict loads strictly and gives the official function --------------------
CASES = {"DiT-S/8": (lambda **kw: DiT_models["DiT-S/8"](scheme="pre", **S8, **kw), s8_layout, 6, S8),
         "tiny": (lambda **kw: OfficialDiT(scheme="pre", **TINY, **kw), tiny_layout, 4, TINY)}


@pytest.mark.parametrize("case", list(CASES))
def test_an_official_state_dict_loads_strictly_and_matches_the_reference_forward(case):
    build, layout, heads, kw = CASES[case]
    sd = random_official(layout())
    given = {key: value.clone() for key, value in sd.items()}
    model = build(dtype=F64).eval()
    assert str(model.load_state_dict(sd, strict=True)) == "<All keys matched successfully>"
    assert all(torch.equal(sd[key], given[key]) for key in given) and list(sd) == list(given)
    # The same weights come back, in the official order (the fused qkv included).
    back = model.state_dict()
    assert list(back) == list(given)
    assert all(torch.equal(back[key], given[key]) for key in given)
    x, t, y = inputs(3, model.in_channels, kw["input_size"], kw["num_classes"])
    with torch.no_grad():
        out, ref = model(x, t, y), ref_forward(sd, x, t, y, heads=heads)
    assert out.shape == (3, 2 * model.in_channels, kw["input_size"], kw["input_size"])
    assert_relative(out, ref, 1e-6)
    # A float32 model reads the same dict and agrees to float32 rounding.
    single = build().eval()
    single.load_state_dict(sd, strict=True)
    with torch.no_grad():
        assert_relative(single(x.float(), t, y), ref, 1e-4)


def test_the_loaded_position_embedding_and_null_label_are_used():
    sd = random_official(tiny_layout(), seed=3)
    model = OfficialDiT(scheme="pre", **TINY, dtype=F64).eval()
    model.load_state_dict(sd)
    assert torch.equal(model.pos_embed, sd["pos_embed"])        # the checkpoint's, as officially
    x, t, _ = inputs(2, 3, 8, 5)
    null = torch.full((2,), TINY["num_classes"])
    with torch.no_grad():
        assert_relative(model(x, t, null), ref_forward(sd, x, t, null, heads=4), 1e-6)


def test_label_dropout_in_training_mode_draws_as_officially():
    """Training mode drops each label with ``class_dropout_prob``, the mask drawn first in the
    forward as ``torch.rand(N) < p``, as the official label embedder does."""
    layout = tiny_layout(class_dropout_prob=0.5)
    sd = random_official(layout, seed=4)
    model = OfficialDiT(scheme="pre", **TINY | {"class_dropout_prob": 0.5}, dtype=F64).train()
    model.load_state_dict(sd)
    x, t, y = inputs(8, 3, 8, 5)
    torch.manual_seed(11)
    dropped = torch.rand(8) < 0.5
    assert 0 < dropped.sum() < 8
    torch.manual_seed(11)
    with torch.no_grad():
        out = model(x, t, y)
    assert_relative(out, ref_forward(sd, x, t, torch.where(dropped, 5, y), heads=4), 1e-6)


def test_without_class_dropout_the_table_has_no_null_row_and_loads_back():
    overrides = {"class_dropout_prob": 0.0}
    sd = random_official(tiny_layout(**overrides), seed=5)
    assert sd["y_embedder.embedding_table.weight"].shape == (5, 32)
    model = OfficialDiT(scheme="pre", **TINY | overrides, dtype=F64).eval()
    assert model.y_embedder.embedding_table.num_embeddings == 5          # as officially
    assert str(model.load_state_dict(sd, strict=True)) == "<All keys matched successfully>"
    assert torch.equal(model.state_dict()["y_embedder.embedding_table.weight"],
                       sd["y_embedder.embedding_table.weight"])
    x, t, y = inputs(2, 3, 8, 5)
    with torch.no_grad():
        assert_relative(model(x, t, y), ref_forward(sd, x, t, y, heads=4), 1e-6)
    with pytest.raises(ValueError, match=r"labels must lie in 0\.\.4 \(no null label"):
        model(x, t, torch.tensor([1, 5]))


def test_strict_loading_names_official_keys_in_its_errors():
    model = OfficialDiT(scheme="pre", **TINY)
    sd = random_official(tiny_layout(), dtype=torch.float32)
    del sd["pos_embed"], sd["blocks.1.attn.qkv.weight"], sd["blocks.0.mlp.fc1.bias"]
    sd["blocks.7.mlp.fc1.weight"] = torch.zeros(1)
    result = model.load_state_dict(sd, strict=False)
    assert result.missing_keys == ["pos_embed", "blocks.0.mlp.fc1.bias", "blocks.1.attn.qkv.weight"]
    assert result.unexpected_keys == ["blocks.7.mlp.fc1.weight"]
    sd["blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    with pytest.raises(RuntimeError) as error:
        model.load_state_dict(sd)
    message = str(error.value)
    assert "size mismatch for blocks.0.attn.qkv.weight: copying a param with shape torch.Size([3, 3])" \
        in message and "torch.Size([96, 32])" in message
    assert '"pos_embed", "blocks.0.mlp.fc1.bias", "blocks.1.attn.qkv.weight".' in message
    assert "sublayers" not in message and "q_proj" not in message


def test_loading_inside_a_wrapper_renames_only_the_model_keys():
    wrapper = torch.nn.Module()
    wrapper.model = OfficialDiT(scheme="pre", **TINY)
    wrapper.head = torch.nn.Linear(2, 2)
    keys = list(wrapper.state_dict())
    assert keys == [f"model.{k}" for k, _ in tiny_layout()] + ["head.weight", "head.bias"]
    other = torch.nn.Module()
    other.model = OfficialDiT(scheme="pre", **TINY)
    other.head = torch.nn.Linear(2, 2)
    assert str(other.load_state_dict(wrapper.state_dict())) == "<All keys matched successfully>"


# ---- (d) forward_with_cfg ------------------------------------------------------------------------
@pytest.mark.parametrize("case", list(CASES))
def test_forward_with_cfg_guides_the_first_three_channels_as_officially(case):
    build, layout, heads, kw = CASES[case]
    sd = random_official(layout(), seed=1)
    model = build(dtype=F64).eval()
    model.load_state_dict(sd)
    n, channels, size = 2, model.in_channels, kw["input_size"]
    x, t, y = inputs(2 * n, channels, size, kw["num_classes"], seed=2)
    t = torch.cat((t[:n], t[:n]))
    y = torch.cat((y[:n], torch.full((n,), kw["num_classes"])))
    with torch.no_grad():
        out = model.forward_with_cfg(x, t, y, 4.0)
    ref = ref_forward_with_cfg(sd, x, t, y, 4.0, heads=heads)
    assert out.shape == (2 * n, 2 * channels, size, size)
    assert_relative(out, ref, 1e-6)
    # The 4th noise channel of a 4-channel latent is not guided: each half keeps its own.
    if channels > 3:
        plain = ref_forward(sd, torch.cat((x[:n], x[:n])), t, y, heads=heads)
        assert_relative(out[:, 3:], plain[:, 3:], 1e-6)
        assert not torch.allclose(out[:n, 3], out[n:, 3])


# ---- (e) every scheme through DiT_models ---------------------------------------------------------
EXTRA = re.compile(r"scheme\.|blocks\.\d+\.attn\.[qkv]_norm\.")


@pytest.mark.parametrize("scheme", sn.list_schemes())
def test_every_scheme_builds_and_runs_through_dit_models_with_its_keys(scheme):
    torch.manual_seed(0)
    model = randomize(DiT_models["DiT-S/8"](scheme=scheme, **S8)).eval()
    sd = model.state_dict()
    official = dict(s8_layout())
    assert [k for k in sd if k in official] == list(official)
    assert all(tuple(sd[k].shape) == shape for k, shape in official.items())
    extra = [k for k in sd if k not in official]
    assert all(EXTRA.match(k) for k in extra), extra
    assert {k for k in extra if k.startswith("scheme.")} == {f"scheme.{k}" for k in model.scheme.state_dict()}
    # The parameters are the state dict: the same names, in the same order, the same tensors.
    params = dict(model.named_parameters())
    assert list(params) == list(sd)
    assert all(params[k].data_ptr() == sd[k].data_ptr() for k in sd)
    ema = copy.deepcopy(model)
    for p in ema.parameters():
        p.data.zero_()
    update_ema(ema, model, decay=0.0)           # train.py's step, parameters matched by name
    assert all(torch.equal(value, sd[key]) for key, value in ema.state_dict().items())
    x, t, y = inputs(2, 4, 16, 10)
    with torch.no_grad():
        out = model(x.float(), t, y)
    assert out.shape == (2, 8, 16, 16) and torch.isfinite(out).all()
    fresh = DiT_models["DiT-S/8"](scheme=scheme, **S8).eval()
    assert str(fresh.load_state_dict(sd)) == "<All keys matched successfully>"
    with torch.no_grad():
        assert torch.equal(fresh(x.float(), t, y), out)


def test_the_default_scheme_is_siamese_with_its_norms_under_scheme():
    model = DiT_models["DiT-S/8"](**S8)
    assert model.config.scheme == "siamese"
    keys = set(model.state_dict())
    assert {"scheme.post_norm.0.weight", "scheme.pre_norm.23.bias", "scheme.merge_norm_x.weight",
            "scheme.merge_norm_y.bias"} <= keys
    assert keys - {k for k, _ in s8_layout()} == {k for k in keys if k.startswith("scheme.")}


@pytest.mark.parametrize("scheme", sn.list_schemes())
def test_our_dit_weights_load_and_give_the_same_function(scheme):
    """A plain DiT's own state dict loads too, and the official layout round-trips it exactly."""
    options = {"form": "hybrid_pre"} if scheme == "siamese" else {}
    config = DiTConfig(input_size=8, patch_size=2, in_chans=3, num_classes=5, dim=32, n_layers=2,
                       n_heads=4, mlp_ratio=2.0, scheme=scheme, scheme_options=options)
    native = randomize(DiT(config, dtype=F64), seed=7).eval()
    model = OfficialDiT(**TINY, scheme=scheme, scheme_options=options, dtype=F64).eval()
    assert str(model.load_state_dict(native.state_dict())) == "<All keys matched successfully>"
    again = OfficialDiT(**TINY, scheme=scheme, scheme_options=options, dtype=F64).eval()
    again.load_state_dict(model.state_dict())
    x, t, y = inputs(2, 3, 8, 5)
    with torch.no_grad():
        ref, out = native(x, t, y), model(x, t, y)
        assert_relative(out, ref, 1e-13)                  # the same function, fused qkv or not
        assert torch.equal(again(x, t, y), out)
    if scheme in ("siamese", "hybridnorm"):                      # per-head q, k, v norms
        assert "blocks.1.attn.v_norm.weight" in model.state_dict()


# ---- (f) the official module tree ---------------------------------------------------------------
def test_the_official_module_tree_and_attributes():
    model = OfficialDiT(scheme="pre", **TINY)
    d, tokens = 32, 16
    assert isinstance(model.blocks, torch.nn.ModuleList) and len(model.blocks) == 2
    for block in model.blocks:
        assert not list(block.norm1.parameters()) and not list(block.norm2.parameters())
        assert block.attn.qkv.weight.shape == (3 * d, d) and block.attn.proj.weight.shape == (d, d)
        assert block.mlp.fc1.weight.shape == (64, d) and block.mlp.fc2.weight.shape == (d, 64)
        assert block.adaLN_modulation[-1].weight.shape == (6 * d, d)
    assert isinstance(model.x_embedder.proj, torch.nn.Conv2d)
    assert model.x_embedder.num_patches == model.num_patches == tokens
    assert model.x_embedder.patch_size[0] == model.patch_size == 2
    assert model.y_embedder.embedding_table.weight.shape == (6, d)
    assert model.final_layer.adaLN_modulation[-1].weight.shape == (2 * d, d)
    assert model.final_layer.linear.weight.shape == (2 * 2 * 6, d)
    assert not list(model.final_layer.norm_final.parameters())
    assert isinstance(model.pos_embed, torch.nn.Parameter) and not model.pos_embed.requires_grad
    assert model.pos_embed.shape == (1, tokens, d)
    assert isinstance(model.t_embedder.mlp, torch.nn.Sequential)
    assert model.t_embedder.frequency_embedding_size == 256
    # token_drop: forced ids take the null label; forward(labels, train, force_drop_ids)
    labels = torch.tensor([1, 2, 3])
    forced = torch.tensor([1, 0, 1])
    assert model.y_embedder.token_drop(labels, forced).tolist() == [5, 2, 5]
    table = model.y_embedder.embedding_table.weight
    assert torch.equal(model.y_embedder(labels, False, forced), table[[5, 2, 5]])
    assert torch.equal(model.y_embedder(labels, False), table[[1, 2, 3]])
    # unpatchify: (N, T, p * p * C) -> (N, C, H, W), each token's features ordered (p, q, C)
    tokens_in = torch.randn(2, tokens, 2 * 2 * 6)
    grid = tokens_in.reshape(2, 4, 4, 2, 2, 6)
    expected = torch.zeros(2, 6, 8, 8)
    for h, w, pi, qi in itertools.product(range(4), range(4), range(2), range(2)):
        expected[:, :, 2 * h + pi, 2 * w + qi] = grid[:, h, w, pi, qi]
    assert torch.equal(model.unpatchify(tokens_in), expected)


def test_timestep_embedding_is_the_official_static_method():
    t = torch.tensor([0, 1, 250, 999])
    half = 128
    freqs = torch.tensor([10000.0 ** (-j / half) for j in range(half)], dtype=F64)
    angles = t.to(F64)[:, None] * freqs
    ref = torch.cat((torch.cos(angles), torch.sin(angles)), dim=-1)
    for embedder in (TimestepEmbedder, DiT_models["DiT-S/8"](**S8, device="meta").t_embedder):
        features = embedder.timestep_embedding(t, 256)
        assert features.dtype == torch.float32 and features.shape == (4, 256)
        torch.testing.assert_close(features.to(F64), ref, atol=1e-6, rtol=0)
    odd = TimestepEmbedder.timestep_embedding(t, 7)         # an odd size ends in a zero column
    assert odd.shape == (4, 7) and not odd[:, 6].any()
    assert torch.equal(odd[:, :6], TimestepEmbedder.timestep_embedding(t, 6))


def official_init(layout, seed):
    """The official ``initialize_weights`` on an official-layout dict, written from its steps:
    every linear Xavier-uniform in module order (biases 0), the patch embedding Xavier-uniform over
    its flattened kernel, the label table and the timestep MLP weights N(0, 0.02), the adaLN layers
    and the final linear zero (the position embedding is left out)."""
    torch.manual_seed(seed)
    sd = {key: torch.zeros(shape) for key, shape in layout}
    for key, shape in layout:
        if key.endswith(".weight") and len(shape) == 2 and "embedding_table" not in key:
            torch.nn.init.xavier_uniform_(sd[key])
    patch = sd["x_embedder.proj.weight"]
    torch.nn.init.xavier_uniform_(patch.view(patch.shape[0], -1))
    for key in ("y_embedder.embedding_table.weight", "t_embedder.mlp.0.weight",
                "t_embedder.mlp.2.weight"):
        torch.nn.init.normal_(sd[key], std=0.02)
    for key in sd:
        if "adaLN_modulation" in key or key.startswith("final_layer.linear"):
            sd[key].zero_()
    del sd["pos_embed"]
    return sd


def test_a_fresh_model_draws_the_official_init_and_initialize_weights_redraws_it():
    torch.manual_seed(4)
    model = OfficialDiT(scheme="pre", **TINY)
    expected = official_init(tiny_layout(), 4)
    got = model.state_dict()
    assert [key for key in expected if not torch.equal(got[key], expected[key])] == []
    torch.manual_seed(4)
    model.blocks[0].attn.qkv.weight.data.zero_()
    model.initialize_weights()
    assert torch.equal(model.blocks[0].attn.qkv.weight, expected["blocks.0.attn.qkv.weight"])
    x, t, y = inputs(2, 3, 8, 5)
    assert torch.equal(model(x.float(), t, y), torch.zeros(2, 6, 8, 8))     # adaLN-Zero
    meta = OfficialDiT(scheme="pre", **TINY, device="meta")                # a dry run's build
    meta.to_empty(device="cpu")
    torch.manual_seed(4)
    meta.initialize_weights()
    assert all(torch.equal(a, b) for a, b in zip(meta.state_dict().values(),
                                                 model.state_dict().values(), strict=True))


def test_deepnorm_gain_goes_on_v_of_the_fused_qkv_and_on_proj_not_on_q_and_k():
    torch.manual_seed(0)
    model = OfficialDiT(scheme="deepnorm", **TINY)
    gain = model.scheme.requires.branch_gain
    assert gain < 0.9
    q, k, v = model.blocks[1].attn.qkv.weight.chunk(3)
    fused = math.sqrt(6 / (32 + 96))
    for part, bound in ((q, fused), (k, fused), (v, gain * fused),
                        (model.blocks[1].attn.proj.weight, gain * math.sqrt(6 / 64))):
        assert 0.9 * bound < part.abs().max() <= bound


def test_code_written_against_the_official_modules_computes_the_official_function():
    """A forward of one's own over the official modules (as feature-caching code writes it), a
    loop over ``blocks``, and forward hooks on the blocks."""
    sd = random_official(tiny_layout(), seed=6)
    model = OfficialDiT(scheme="pre", **TINY, dtype=F64).eval()
    model.load_state_dict(sd)
    x, t, y = inputs(2, 3, 8, 5)
    ref = ref_forward(sd, x, t, y, heads=4)
    seen = []
    for block in model.blocks:
        block.register_forward_hook(lambda module, args, out: seen.append(module))
    with torch.no_grad():
        c = model.t_embedder(t) + model.y_embedder(y, model.training)
        h = model.x_embedder(x) + model.pos_embed
        for block in model.blocks:
            h = block(h, c)
        looped = model.unpatchify(model.final_layer(h, c))
        assert seen == list(model.blocks)
        h = model.x_embedder(x) + model.pos_embed
        for block in model.blocks:
            sa, ca, ga, sm, cm, gm = block.adaLN_modulation(c).chunk(6, dim=1)
            h = h + ga.unsqueeze(1) * block.attn(modulate(block.norm1(h), sa, ca))
            h = h + gm.unsqueeze(1) * block.mlp(modulate(block.norm2(h), sm, cm))
        own = model.unpatchify(model.final_layer(h, c))
    assert_relative(looped, ref, 1e-12)
    assert_relative(own, ref, 1e-12)


def test_a_block_given_a_tensor_returns_one_where_the_scheme_defers_its_add(monkeypatch):
    """Where fused kernels run (CUDA), Pre-Norm leaves each residual add to the next norm (a tuple
    state); ``block(x, c)`` still returns the official ``x``."""
    monkeypatch.setattr(fusion, "defers_add", lambda *args: True)
    sd = random_official(tiny_layout(), seed=8)
    model = OfficialDiT(scheme="pre", **TINY, dtype=F64).eval()
    model.load_state_dict(sd)
    x, t, y = inputs(2, 3, 8, 5)
    with torch.no_grad():
        assert isinstance(model.scheme.step(torch.zeros(1, 2, 32, dtype=F64), 0, torch.sin),
                          fusion.PendingAdd)
        c = model.t_embedder(t) + model.y_embedder(y, False)
        h = model.x_embedder(x) + model.pos_embed
        for block in model.blocks:
            h = block(h, c)
            assert isinstance(h, torch.Tensor)
        looped = model.unpatchify(model.final_layer(h, c))
        ref = ref_forward(sd, x, t, y, heads=4)
        assert_relative(looped, ref, 1e-12)
        assert_relative(model(x, t, y), ref, 1e-12)


# ---- (g) train.py and sample.py, as they call the model ----------------------------------------
class OfficialCalls:
    """What train.py and sample.py call of the official ``diffusion`` package, on our own process:
    ``create_diffusion(timestep_respacing)``, ``num_timesteps``, ``training_losses(model, x, t,
    model_kwargs)`` and ``p_sample_loop(fn, shape, noise, clip_denoised=, model_kwargs=,
    progress=, device=)``. The model is called as there: ``model(x_t, t, **model_kwargs)`` with the
    original timesteps, and must return ``2 C`` channels (a learned variance)."""

    def __init__(self, timestep_respacing: str) -> None:
        base = create_diffusion()
        self.process = base.respace(int(timestep_respacing)) if timestep_respacing else base
        self.num_timesteps = self.process.num_timesteps

    def _output(self, model, x, t, model_kwargs):
        out = model(x, self.process.model_timesteps(t), **model_kwargs)
        assert out.shape == (x.shape[0], 2 * x.shape[1], *x.shape[2:])
        return out

    def training_losses(self, model, x_start, t, model_kwargs=None, noise=None):
        noise = torch.randn_like(x_start) if noise is None else noise
        x_t = self.process.q_sample(x_start, t, noise)
        eps, v = self._output(model, x_t, t, model_kwargs or {}).split(x_start.shape[1], dim=1)
        mse = mean_flat((noise - eps) ** 2)
        vb = vb_terms(self.process, torch.cat((eps.detach(), v), dim=1), x_start, x_t, t)
        return {"loss": mse + vb, "mse": mse, "vb": vb}

    def p_sample_loop(self, model, shape, noise, clip_denoised=True, model_kwargs=None,
                      progress=False, device=None):
        x = noise
        for step in reversed(range(self.num_timesteps)):
            t = torch.full((shape[0],), step, device=device)
            p = self.process.p_mean_variance(self._output(model, x, t, model_kwargs or {}), x, t,
                                             clip_denoised=clip_denoised)
            x = p.mean + (step > 0) * torch.exp(0.5 * p.log_variance) * torch.randn_like(x)
        return x


def update_ema(ema, model, decay=0.9999):
    """train.py's EMA step: each parameter of ``ema`` moves towards ``model``'s of the same name."""
    ema_params = dict(ema.named_parameters())
    with torch.no_grad():
        for name, param in model.named_parameters():
            ema_params[name].mul_(decay).add_(param.data, alpha=1 - decay)


@pytest.fixture
def one_process_group(tmp_path):
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_train_py_and_sample_py_run_unchanged(one_process_group):
    """train.py's model, EMA, DDP, loss, optimizer and checkpoint; then sample.py's load and
    guided sampling: each call as the scripts make it, at DiT-S/8 on 16 x 16 latents."""
    torch.manual_seed(0)
    latent, classes = 16, 10
    model = DiT_models["DiT-S/8"](input_size=latent, num_classes=classes)
    ema = copy.deepcopy(model)
    assert all(block._scheme is ema.scheme for block in ema.blocks)      # each copy runs its own
    for p in ema.parameters():
        p.requires_grad = False
    model = DDP(model)
    diffusion = OfficialCalls(timestep_respacing="")
    assert diffusion.num_timesteps == 1000
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0)
    update_ema(ema, model.module, decay=0)
    assert all(torch.equal(a, b) for a, b in zip(ema.parameters(), model.module.parameters(), strict=True))
    model.train()
    ema.eval()
    pos_embed = model.module.pos_embed.detach().clone()
    for step in range(2):                    # a second forward: DDP refuses unused parameters
        x, y = torch.randn(4, 4, latent, latent), torch.randint(0, classes, (4,))
        t = torch.randint(0, diffusion.num_timesteps, (x.shape[0],))
        noise = torch.randn_like(x)
        torch.manual_seed(step)
        loss = diffusion.training_losses(model, x, t, dict(y=y), noise=noise)["loss"].mean()
        with torch.no_grad():        # siamesenorm.diffusion's own call: the same loss
            torch.manual_seed(step)
            ours = training_losses(model.module, diffusion.process, x, t, noise, y)["loss"].mean()
        assert torch.isfinite(loss) and abs(loss.item() - ours.item()) < 1e-6 * ours.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
        ema_before = ema.final_layer.linear.weight.detach().clone()
        update_ema(ema, model.module)
    trained = model.module.final_layer.linear.weight
    torch.testing.assert_close(ema.final_layer.linear.weight,
                               0.9999 * ema_before + 1e-4 * trained.detach(), rtol=0, atol=1e-9)
    assert all(p.grad is not None for p in model.module.parameters() if p.requires_grad)
    assert model.module.pos_embed.grad is None and torch.equal(model.module.pos_embed, pos_embed)
    assert trained.any()
    buffer = io.BytesIO()
    torch.save({"model": model.module.state_dict(), "ema": ema.state_dict(),
                "opt": opt.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    assert [k for k in checkpoint["ema"] if not k.startswith("scheme.")] == [k for k, _ in s8_layout()]
    # sample.py: a fresh model, the EMA weights, guidance on a doubled batch, a respaced process
    sampler = DiT_models["DiT-S/8"](input_size=latent, num_classes=classes)
    assert str(sampler.load_state_dict(checkpoint["ema"])) == "<All keys matched successfully>"
    sampler.eval()
    diffusion = OfficialCalls(timestep_respacing="3")
    z = torch.randn(2, 4, latent, latent)
    y = torch.tensor([1, 2])
    z, y = torch.cat([z, z], 0), torch.cat([y, torch.tensor([classes] * 2)], 0)
    with torch.no_grad():
        assert torch.equal(sampler.forward_with_cfg(z, torch.full((4,), 999), y, 4.0),
                           ema.forward_with_cfg(z, torch.full((4,), 999), y, 4.0))
        samples = diffusion.p_sample_loop(sampler.forward_with_cfg, z.shape, z, clip_denoised=False,
                                          model_kwargs=dict(y=y, cfg_scale=4.0), progress=False,
                                          device="cpu")
    samples, _ = samples.chunk(2, dim=0)
    assert samples.shape == (2, 4, latent, latent) and torch.isfinite(samples).all()
