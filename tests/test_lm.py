"""Tests of the decoder-only language model and its scheme-agnostic parts (attention, RoPE, MLP).

RoPE convention under test: rotate-half. Pair ``(x[j], x[j + d/2])`` of a head vector at
position ``p`` is rotated by the angle ``p * theta ** (-2j / d)``. The reference below writes that
pair as the complex number ``x[j] + i x[j + d/2]`` and multiplies it by ``exp(i * angle)``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from helpers import raises_value_error
from siamesenorm.errors import ConfigError
from siamesenorm.models import LanguageModel, LMConfig
from siamesenorm.nn.attention import Attention
from siamesenorm.nn.rope import RotaryEmbedding
from siamesenorm.schemes import base as scheme_base
from siamesenorm.schemes import get_scheme_class, list_schemes
from siamesenorm.schemes.base import SchemeRequirements

F64 = torch.float64


def tiny(**overrides) -> LMConfig:
    options = dict(vocab_size=61, dim=32, n_layers=2, n_heads=4, max_seq_len=64, scheme="pre")
    options.update(overrides)
    return LMConfig(**options)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Give every parameter non-trivial values: norm weights near 1, matrices ~ 1/sqrt(fan_in)."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        if p.dim() == 1:
            p.copy_((1.0 + 0.3 * noise) if name.endswith("weight") else 0.1 * noise)
        else:
            p.copy_(noise / math.sqrt(p.shape[1]))
    return model


def with_temp_scheme(monkeypatch: pytest.MonkeyPatch, name: str, requires: SchemeRequirements):
    """Register, for one test only, a Pre-Norm variant that declares ``requires``."""
    pre = get_scheme_class("pre")

    class Variant(pre):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.requires = requires

    Variant.name = name
    monkeypatch.setitem(scheme_base._REGISTRY, name, Variant)


def state_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (non-persistent ones included), by name."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


# ---- shapes, loss ------------------------------------------------------------------------------
def test_shapes_and_initial_loss_near_uniform() -> None:
    torch.manual_seed(0)
    cfg = tiny()
    model = LanguageModel(cfg)
    ids = torch.randint(0, cfg.vocab_size, (3, 16))
    targets = torch.randint(0, cfg.vocab_size, (3, 16))
    out = model(ids, targets)
    assert out.logits.shape == (3, 16, cfg.vocab_size)
    assert out.loss is not None and out.loss.shape == ()
    assert abs(out.loss.item() - math.log(cfg.vocab_size)) < 0.1
    assert model(ids).loss is None

    targets[:, ::2] = -100  # ignored positions
    expected = F.cross_entropy(out.logits[:, 1::2].reshape(-1, cfg.vocab_size),
                               targets[:, 1::2].reshape(-1))
    torch.testing.assert_close(model(ids, targets).loss, expected)


def test_gelu_mlp_and_untied_head() -> None:
    cfg = tiny(mlp="gelu", tie_embeddings=False, bias=True)
    model = LanguageModel(cfg)
    assert model.sublayers[1].up_proj.out_features == 4 * cfg.dim
    assert not hasattr(model.sublayers[1], "gate_proj")
    assert model.lm_head is not None and model.lm_head.weight is not model.embed.weight
    assert model(torch.randint(0, cfg.vocab_size, (2, 5))).logits.shape == (2, 5, cfg.vocab_size)
    assert LanguageModel(tiny(dim=256)).sublayers[1].up_proj.out_features == 704  # 8/3*256 -> 64k


# ---- attention ---------------------------------------------------------------------------------
def ref_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """``x``: (..., T, d). Rotate-half RoPE through complex multiplication."""
    half = x.shape[-1] // 2
    freqs = theta ** (-2.0 * torch.arange(half, dtype=F64) / x.shape[-1])
    angles = positions.to(F64)[:, None] * freqs[None, :]
    z = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(angles), angles)
    return torch.cat((z.real, z.imag), dim=-1)


def ref_rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def ref_attention(attn: Attention, x: torch.Tensor, pos: int, theta: float,
                  eps: float) -> torch.Tensor:
    """Causal softmax attention written out head by head."""
    b, t, d = x.shape
    h, hk = attn.n_heads, attn.n_kv_heads
    hd = d // h

    def lin(layer: torch.nn.Linear, inp: torch.Tensor) -> torch.Tensor:
        y = inp @ layer.weight.T
        return y if layer.bias is None else y + layer.bias

    q = lin(attn.q_proj, x).reshape(b, t, h, hd)
    k = lin(attn.k_proj, x).reshape(b, t, hk, hd)
    v = lin(attn.v_proj, x).reshape(b, t, hk, hd)
    if attn.q_norm is not None:
        q, k = ref_rms(q, attn.q_norm.weight, eps), ref_rms(k, attn.k_norm.weight, eps)
    if attn.v_norm is not None:
        v = ref_rms(v, attn.v_norm.weight, eps)
    positions = torch.arange(pos, pos + t)
    q = ref_rope(q.transpose(1, 2), positions, theta)  # (b, h, t, hd)
    k = ref_rope(k.transpose(1, 2), positions, theta)
    v = v.transpose(1, 2)
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    heads = []
    for head in range(h):
        kv = head // (h // hk)
        scores = q[:, head] @ k[:, kv].transpose(-1, -2) / math.sqrt(hd)
        weights = scores.masked_fill(future, float("-inf")).softmax(-1)
        heads.append(weights @ v[:, kv])
    merged = torch.stack(heads, dim=2).reshape(b, t, d)
    return lin(attn.out_proj, merged)


@pytest.mark.parametrize("qk_norm,qkv_norm,n_kv_heads,pos,bias", [
    (False, False, 3, 0, False),
    (True, False, 3, 5, False),
    (False, True, 1, 2, True),
])
def test_attention_matches_reference(qk_norm: bool, qkv_norm: bool, n_kv_heads: int, pos: int,
                                     bias: bool) -> None:
    theta, eps = 500.0, 1e-5
    attn = Attention(24, 3, n_kv_heads, max_seq_len=16, rope_theta=theta, qk_norm=qk_norm,
                     qkv_norm=qkv_norm, norm="rmsnorm", norm_eps=eps, bias=bias, dtype=F64)
    randomize(attn, seed=1)
    x = torch.randn(2, 7, 24, dtype=F64, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(attn(x, pos=pos), ref_attention(attn, x, pos, theta, eps),
                               rtol=1e-10, atol=1e-10)
    # RoPE attention depends only on relative positions: shifting every position changes nothing
    torch.testing.assert_close(attn(x, pos=0), attn(x, pos=pos), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("pos", [0, 3])
def test_rope_matches_reference(pos: int) -> None:
    rope = RotaryEmbedding(8, 16, theta=100.0, dtype=F64)
    x = torch.randn(2, 3, 5, 8, dtype=F64, generator=torch.Generator().manual_seed(0))
    expected = ref_rope(x, torch.arange(pos, pos + 5), 100.0)
    torch.testing.assert_close(rope(x, pos), expected, rtol=1e-12, atol=1e-12)
    assert not torch.allclose(rope(x, pos + 1), expected)
    with raises_value_error("max_seq_len"):
        rope(x, 12)


def test_gqa_equals_explicitly_repeated_kv_heads() -> None:
    cfg = tiny(n_heads=4, n_kv_heads=2, qk_norm=True)
    grouped = randomize(LanguageModel(cfg, dtype=F64))
    full = LanguageModel(tiny(n_heads=4, n_kv_heads=4, qk_norm=True), dtype=F64)
    state = grouped.state_dict()
    group, hd = 2, cfg.head_dim
    for key, value in list(state.items()):
        # (kv_heads * hd, dim) -> (heads * hd, dim): kv head j serves query heads 2j and 2j + 1
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            heads = value.reshape(cfg.kv_heads, hd, cfg.dim)
            state[key] = heads.repeat_interleave(group, dim=0).reshape(-1, cfg.dim)
    full.load_state_dict(state)
    ids = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(grouped(ids).logits, full(ids).logits, rtol=1e-10, atol=1e-10)


# ---- KV cache and generation -------------------------------------------------------------------
def test_cached_greedy_generation_equals_uncached() -> None:
    # untied: a random tied model mostly repeats one token, which would test little
    cfg = tiny(n_layers=3, n_kv_heads=2, qk_norm=True, tie_embeddings=False)
    model = randomize(LanguageModel(cfg, dtype=F64), seed=3)
    model.train()
    prompt = torch.randint(0, cfg.vocab_size, (2, 5), generator=torch.Generator().manual_seed(4))
    cached = model.generate(prompt, 20, greedy=True, use_cache=True)
    uncached = model.generate(prompt, 20, greedy=True, use_cache=False)
    assert model.training
    assert cached.shape == (2, 25) and torch.equal(cached[:, :5], prompt)
    assert torch.equal(cached, uncached)
    assert len(set(cached[:, 5:].flatten().tolist())) > 5  # not a degenerate repetition


def test_cached_logits_equal_uncached_logits() -> None:
    cfg = tiny(n_layers=2, n_kv_heads=2)
    model = randomize(LanguageModel(cfg), seed=5).eval()
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(6))
    full = model(ids).logits
    cache = model.new_cache(batch_size=2)
    pieces = [(0, 6), (6, 7), (7, 10), (10, 12)]  # prefill, one token, then chunks of several
    with torch.no_grad():
        for start, end in pieces:
            logits = model(ids[:, start:end], cache=cache, pos=start).logits
            assert cache.length == end
            torch.testing.assert_close(logits, full[:, start:end], rtol=1e-5, atol=1e-5)


def test_generation_length_limits() -> None:
    cfg = tiny(max_seq_len=16)
    model = LanguageModel(cfg)
    prompt = torch.randint(0, cfg.vocab_size, (1, 10))
    with raises_value_error("max_seq_len"):
        model.generate(prompt, 7, greedy=True)
    assert model.generate(prompt, 6, greedy=True).shape == (1, 16)
    assert model.generate(prompt, 12, greedy=True, use_cache=False).shape == (1, 22)
    with raises_value_error("max_seq_len"):
        model(torch.zeros(1, 17, dtype=torch.long))
    with raises_value_error(r"shape \(batch, seq\)"):
        model(torch.zeros(17, dtype=torch.long))
    with raises_value_error("KV cache write"):
        model(prompt, cache=model.new_cache(1), pos=3)   # the cache holds no positions yet
    with raises_value_error("temperature >= 0"):   # the command checks a user's settings itself
        model.generate(prompt, 2, temperature=-1.0)


def test_sampling_is_reproducible_and_top1_is_greedy() -> None:
    cfg = tiny()
    model = randomize(LanguageModel(cfg), seed=7)
    prompt = torch.randint(0, cfg.vocab_size, (2, 4), generator=torch.Generator().manual_seed(8))

    def sample(seed: int, **kw) -> torch.Tensor:
        return model.generate(prompt, 20, generator=torch.Generator().manual_seed(seed), **kw)

    assert torch.equal(sample(0), sample(0))
    assert not torch.equal(sample(0), sample(1))
    assert torch.equal(sample(0, top_k=1), model.generate(prompt, 20, greedy=True))
    assert torch.equal(sample(0, top_k=5, temperature=0.7, use_cache=False),
                       sample(0, top_k=5, temperature=0.7))


# ---- initialisation ----------------------------------------------------------------------------
@pytest.mark.parametrize("init", ["normal", "mitchell"])
def test_meta_build_equals_direct_build(init: str) -> None:
    cfg = tiny(init=init, tie_embeddings=False, bias=True, qk_norm=True, n_kv_heads=2)
    torch.manual_seed(0)
    direct = LanguageModel(cfg)
    meta = LanguageModel(cfg, device="meta")
    assert all(t.is_meta for t in state_of(meta).values())
    meta.to_empty(device="cpu")
    torch.manual_seed(0)
    meta.reset_parameters()
    a, b = state_of(direct), state_of(meta)
    assert a.keys() == b.keys() and any(".rope." in key for key in a)
    for key in a:
        assert torch.equal(a[key], b[key]), key
    ids = torch.randint(0, cfg.vocab_size, (2, 8))
    assert torch.equal(direct(ids).logits, meta(ids).logits)


@pytest.mark.parametrize("scheme", list_schemes())
def test_every_scheme_builds_on_meta_and_decodes_with_cache(scheme: str) -> None:
    cfg = tiny(scheme=scheme, n_layers=3, init="mitchell")
    torch.manual_seed(0)
    direct = LanguageModel(cfg, dtype=F64)
    meta = LanguageModel(cfg, device="meta", dtype=F64)
    meta.to_empty(device="cpu")
    torch.manual_seed(0)
    meta.reset_parameters()
    a, b = state_of(direct), state_of(meta)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    prompt = torch.randint(0, cfg.vocab_size, (2, 4), generator=torch.Generator().manual_seed(0))
    assert torch.equal(direct.generate(prompt, 8, greedy=True),
                       direct.generate(prompt, 8, greedy=True, use_cache=False))


def test_mitchell_init_std_and_truncation() -> None:
    dim, n_layers = 512, 3
    torch.manual_seed(0)
    model = LanguageModel(tiny(dim=dim, n_layers=n_layers, n_heads=4, init="mitchell",
                               tie_embeddings=False))
    hidden = model.config.hidden_dim

    def check(weight: torch.Tensor, std: float) -> None:
        assert abs(weight.std().item() / std - 1) < 0.1
        assert weight.abs().max().item() <= 3 * std * (1 + 1e-6)

    for layer in range(n_layers):
        attn, mlp = model.sublayers[2 * layer], model.sublayers[2 * layer + 1]
        check(attn.out_proj.weight, 1 / math.sqrt(2 * dim * (layer + 1)))
        check(mlp.down_proj.weight, 1 / math.sqrt(2 * hidden * (layer + 1)))
        check(attn.q_proj.weight, 1 / math.sqrt(dim))
        check(mlp.gate_proj.weight, 1 / math.sqrt(dim))
    check(model.embed.weight, 1 / math.sqrt(dim))
    check(model.lm_head.weight, 1 / math.sqrt(dim))


def test_normal_init_scales_output_projections() -> None:
    cfg = tiny(dim=256, n_layers=4, init_std=0.02)
    model = LanguageModel(cfg)
    out_std = 0.02 / math.sqrt(2 * cfg.n_layers)
    assert abs(model.sublayers[4].out_proj.weight.std().item() / out_std - 1) < 0.1
    assert abs(model.sublayers[5].down_proj.weight.std().item() / out_std - 1) < 0.1
    assert abs(model.sublayers[4].k_proj.weight.std().item() / 0.02 - 1) < 0.1


def test_scheme_xavier_init_and_branch_gain(monkeypatch: pytest.MonkeyPatch) -> None:
    dim, gain = 256, 0.5
    with_temp_scheme(monkeypatch, "_test_xavier", SchemeRequirements(init="xavier",
                                                                     branch_gain=gain))
    with_temp_scheme(monkeypatch, "_test_gain", SchemeRequirements(branch_gain=gain))

    def close(weight: torch.Tensor, std: float) -> bool:
        return abs(weight.std().item() / std - 1) < 0.1

    xav = LanguageModel(tiny(dim=dim, n_layers=2, n_kv_heads=2, scheme="_test_xavier"))
    attn, mlp, hidden = xav.sublayers[2], xav.sublayers[3], xav.config.hidden_dim
    assert close(attn.q_proj.weight, math.sqrt(2 / (2 * dim)))
    assert close(attn.k_proj.weight, math.sqrt(2 / (dim + dim // 2)))
    assert close(attn.v_proj.weight, gain * math.sqrt(2 / (dim + dim // 2)))
    assert close(attn.out_proj.weight, gain * math.sqrt(2 / (2 * dim)))
    assert close(mlp.up_proj.weight, gain * math.sqrt(2 / (dim + hidden)))
    assert close(mlp.down_proj.weight, gain * math.sqrt(2 / (dim + hidden)))

    scaled = LanguageModel(tiny(dim=dim, n_layers=2, scheme="_test_gain"))
    attn, mlp = scaled.sublayers[2], scaled.sublayers[3]
    assert close(attn.q_proj.weight, 0.02) and close(attn.k_proj.weight, 0.02)
    assert close(attn.v_proj.weight, gain * 0.02) and close(mlp.gate_proj.weight, gain * 0.02)
    assert close(attn.out_proj.weight, gain * 0.02 / 2)  # 0.02 / sqrt(2 * n_layers) * gain


def test_scheme_qkv_norm_requirement_reaches_only_its_blocks(
        monkeypatch: pytest.MonkeyPatch) -> None:
    with_temp_scheme(monkeypatch, "_test_qkv",
                     SchemeRequirements(qkv_norm_blocks=frozenset({1})))
    for qk_norm in (False, True):
        model = LanguageModel(tiny(n_layers=3, scheme="_test_qkv", qk_norm=qk_norm))
        for block in range(3):
            attn = model.sublayers[2 * block]
            has_qk = qk_norm or block == 1
            assert (attn.q_norm is not None) == has_qk and (attn.k_norm is not None) == has_qk
            assert (attn.v_norm is not None) == (block == 1)
        assert model.sublayers[2].v_norm.weight.shape == (model.config.head_dim,)


# ---- config validation and accounting ---------------------------------------------------------
@pytest.mark.parametrize("overrides,field", [
    (dict(dim=30, n_heads=4), "dim"),
    (dict(n_layers=-1), "n_layers"),
    (dict(mlp="relu"), "mlp"),
    (dict(n_kv_heads=3), "n_kv_heads"),
    (dict(init="xavier"), "init"),
    (dict(norm="batchnorm"), "norm"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(dropout=1.5), "dropout"),
])
def test_config_errors_name_the_field(overrides: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=rf"LMConfig\.{field}\b"):
        tiny(**overrides)


def test_unknown_scheme_option_is_refused() -> None:
    with pytest.raises(ConfigError, match="no_such_option"):
        LanguageModel(tiny(scheme_options={"no_such_option": 1}))


@pytest.mark.parametrize("tied", [True, False])
def test_parameter_count_and_flops(tied: bool) -> None:
    v, d, n_layers, kv_heads, hidden, seq = 61, 32, 2, 2, 96, 10
    cfg = tiny(vocab_size=v, dim=d, n_layers=n_layers, n_heads=4, n_kv_heads=kv_heads,
               mlp_hidden=hidden, norm="rmsnorm", tie_embeddings=tied)
    model = LanguageModel(cfg)
    kv_dim = kv_heads * d // 4
    block = 2 * d * d + 2 * d * kv_dim + 3 * d * hidden
    scheme = sum(p.numel() for p in model.scheme.parameters())
    assert scheme == (2 * n_layers + 1) * d  # Pre-Norm: one RMSNorm per sublayer plus the final
    head = 0 if tied else v * d
    total = v * d + n_layers * block + scheme + head
    assert model.num_parameters() == total == sum(p.numel() for p in model.parameters())
    assert model.num_parameters(non_embedding=True) == total - v * d
    matmul = n_layers * block + scheme + v * d  # the vocab projection, tied or not
    assert model.flops_per_token(seq) == 6 * matmul + 12 * n_layers * d * seq
    assert model.flops_per_token() == 6 * matmul + 12 * n_layers * d * cfg.max_seq_len
