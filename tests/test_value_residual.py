"""Value residuals (ResFormer, arXiv 2410.17897) in the language model.

The paper's equations, written out below independently of the library: with ``V_n = H_{n-1} W^V_n``
the values of attention layer ``n`` (after its per-head value norm, if any), every layer after the
first attends with ``own_n * V_n + first_n * V_1`` instead of ``V_n``, sharing its own attention
weights; ``own = first = 1/2`` (Identity-ResFormer) unless learned (Learnable-ResFormer).
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from helpers import cli_in_process, raises_value_error
from siamesenorm.config import TrainConfig, dump_config
from siamesenorm.errors import ConfigError
from siamesenorm.models import LanguageModel, LMConfig
from siamesenorm.models.checkpointing import set_activation_checkpointing
from siamesenorm.nn.attention import Attention
from siamesenorm.nn.value_residual import FirstValues
from siamesenorm.schemes import list_schemes
from siamesenorm.tasks import load_config
from siamesenorm.train import build_optimizer
from siamesenorm.train import train as train_engine
from test_train import RandomWindows

F64 = torch.float64
SRC = str(Path(__file__).resolve().parents[1] / "src")


def tiny(**overrides) -> LMConfig:
    options = dict(vocab_size=29, dim=24, n_layers=3, n_heads=4, n_kv_heads=2, max_seq_len=32,
                   tie_embeddings=False, value_residual=True)
    options.update(overrides)
    return LMConfig(**options)


@torch.no_grad()
def randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Norm weights and mixing weights near 1, matrices ~ 1/sqrt(fan_in), all different."""
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        noise = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        p.copy_(1.0 + 0.3 * noise if p.dim() == 1 else noise / math.sqrt(p.shape[1]))
    return model


def ids(b: int = 2, t: int = 9, seed: int = 1, vocab: int = 29) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


# ---- the paper's equations, by hand -----------------------------------------------------------
def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps) * weight


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of ``(B, H, T, D)`` at positions 0..T-1."""
    half = x.shape[-1] // 2
    angles = torch.arange(x.shape[-2], dtype=F64)[:, None] * theta ** (-torch.arange(half, dtype=F64) / half)
    cos, sin = angles.cos(), angles.sin()
    a, b = x[..., :half], x[..., half:]
    return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)


def reference_logits(model: LanguageModel, tokens: torch.Tensor) -> torch.Tensor:
    """Pre-Norm Llama-style decoder with value residuals, head by head (the model's parameters)."""
    cfg, scheme, subs = model.config, model.scheme, model.sublayers
    b, t = tokens.shape
    h, hk, hd, eps = cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.norm_eps
    x = model.embed.weight[tokens]
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    first = None
    for layer in range(cfg.n_layers):
        attn, mlp = subs[2 * layer], subs[2 * layer + 1]
        u = rms(x, scheme.pre_norm[2 * layer].weight, eps)
        q = rope((u @ attn.q_proj.weight.T).reshape(b, t, h, hd).transpose(1, 2), cfg.rope_theta)
        k = rope((u @ attn.k_proj.weight.T).reshape(b, t, hk, hd).transpose(1, 2), cfg.rope_theta)
        v = (u @ attn.v_proj.weight.T).reshape(b, t, hk, hd).transpose(1, 2)
        if layer == 0:
            first = v                                   # V_1
        else:                                           # V_n <- own_n V_n + first_n V_1
            mix = attn.value_mix
            v = mix.own_weight * v + mix.first_weight * first
        heads = []
        for head in range(h):
            g = head // (h // hk)
            scores = q[:, head] @ k[:, g].transpose(-1, -2) / math.sqrt(hd)
            heads.append(scores.masked_fill(future, float("-inf")).softmax(-1) @ v[:, g])
        x = x + torch.stack(heads, dim=2).reshape(b, t, cfg.dim) @ attn.out_proj.weight.T
        u = rms(x, scheme.pre_norm[2 * layer + 1].weight, eps)
        gated = torch.nn.functional.silu(u @ mlp.gate_proj.weight.T) * (u @ mlp.up_proj.weight.T)
        x = x + gated @ mlp.down_proj.weight.T
    return rms(x, scheme.final_norm.weight, eps) @ model.lm_head.weight.T


@pytest.mark.parametrize("mix,own,first", [("fixed", 0.5, 0.5), ("fixed", 2.0, 1.0),
                                           ("learned", 0.5, 0.5)])
def test_model_equals_the_papers_equations_in_values_and_gradients(mix: str, own: float,
                                                                   first: float) -> None:
    model = LanguageModel(tiny(value_residual_mix=mix, value_residual_own=own, value_residual_first=first),
                          dtype=F64)
    randomize(model, seed=2)
    if mix == "fixed":
        assert all(a.value_mix.own_weight == own and a.value_mix.first_weight == first
                   for a in model.sublayers[2::2])
    tokens, targets = ids(), ids(seed=3)
    params = [p for p in model.parameters()]
    got = model(tokens).logits
    want = reference_logits(model, tokens)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    loss = torch.nn.functional.cross_entropy
    g_got = torch.autograd.grad(loss(got.flatten(0, 1), targets.flatten()), params)
    g_want = torch.autograd.grad(loss(want.flatten(0, 1), targets.flatten()), params)
    for (name, _), a, b in zip(model.named_parameters(), g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=name)
    if mix == "learned":        # the mixing weights are trained: each gets a gradient
        assert all(g.abs().item() > 0 for (n, _), g in zip(model.named_parameters(), g_got)
                   if "value_mix" in n)


def test_values_mix_after_the_layers_value_norm() -> None:
    """HybridNorm's QKV-norm: V_n is the normalised value; V_1 is taken as given."""
    attn = Attention(16, 4, 2, max_seq_len=8, qkv_norm=True, layer_idx=1, value_residual="learned",
                     dtype=F64)
    randomize(attn, seed=4)
    x = torch.randn(2, 5, 16, dtype=F64, generator=torch.Generator().manual_seed(5))
    carry = FirstValues()
    carry.values = torch.randn(2, 2, 5, 4, dtype=F64, generator=torch.Generator().manual_seed(6))
    got = attn(x, first_values=carry)
    b, t, hd = 2, 5, 4
    q = rope(rms((x @ attn.q_proj.weight.T).reshape(b, t, 4, hd), attn.q_norm.weight, 1e-5).transpose(1, 2),
             10000.0)
    k = rope(rms((x @ attn.k_proj.weight.T).reshape(b, t, 2, hd), attn.k_norm.weight, 1e-5).transpose(1, 2),
             10000.0)
    v = rms((x @ attn.v_proj.weight.T).reshape(b, t, 2, hd), attn.v_norm.weight, 1e-5).transpose(1, 2)
    v = attn.value_mix.own_weight * v + attn.value_mix.first_weight * carry.values
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    heads = [(q[:, h] @ k[:, h // 2].transpose(-1, -2) / math.sqrt(hd)).masked_fill(future, float("-inf"))
             .softmax(-1) @ v[:, h // 2] for h in range(4)]
    want = torch.stack(heads, dim=2).reshape(b, t, 16) @ attn.out_proj.weight.T
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("mix", ["fixed", "learned"])
def test_no_weight_on_the_first_values_is_plain_attention(mix: str) -> None:
    plain = randomize(LanguageModel(tiny(value_residual=False), dtype=F64), seed=7)
    mixed = LanguageModel(tiny(value_residual_mix=mix, value_residual_own=1.0, value_residual_first=0.0),
                          dtype=F64)
    missing, unexpected = mixed.load_state_dict(plain.state_dict(), strict=False)
    assert not unexpected and all("value_mix" in name for name in missing)
    assert bool(missing) == (mix == "learned")
    tokens = ids(seed=8)
    torch.testing.assert_close(mixed(tokens).logits, plain(tokens).logits, rtol=0, atol=0)
    half = LanguageModel(tiny(value_residual_mix=mix), dtype=F64)
    half.load_state_dict(plain.state_dict(), strict=False)
    assert not torch.allclose(half(tokens).logits, plain(tokens).logits)


@pytest.mark.parametrize("scheme", list_schemes())
def test_every_scheme_trains_a_finite_step_with_it(scheme: str) -> None:
    torch.manual_seed(0)
    model = LanguageModel(tiny(scheme=scheme, n_layers=2, value_residual_mix="learned"))
    opt = build_optimizer(model, 1e-2)
    tokens, targets = ids(t=12, seed=9), ids(t=12, seed=10)
    loss = model(tokens, targets).loss
    loss.backward()
    assert torch.isfinite(loss)
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    assert model.sublayers[2].value_mix.first_weight.grad.abs().item() > 0
    opt.step()
    assert model.sublayers[2].value_mix.first_weight.item() != 0.5
    assert torch.isfinite(model(tokens, targets).loss)


@pytest.mark.parametrize("mix", ["fixed", "learned"])
def test_cached_generation_equals_uncached(mix: str) -> None:
    model = randomize(LanguageModel(tiny(value_residual_mix=mix, qk_norm=True), dtype=F64), seed=11)
    prompt = ids(b=2, t=5, seed=12)
    cached = model.generate(prompt, 20, greedy=True, use_cache=True)
    assert torch.equal(cached, model.generate(prompt, 20, greedy=True, use_cache=False))
    assert len(set(cached[:, 5:].flatten().tolist())) > 3
    tokens = ids(b=2, t=12, seed=13)
    full = model(tokens).logits
    cache = model.new_cache(batch_size=2)
    with torch.no_grad():
        for start, end in [(0, 6), (6, 7), (7, 10), (10, 12)]:   # prefill, one token, chunks
            torch.testing.assert_close(model(tokens[:, start:end], cache=cache, pos=start).logits,
                                       full[:, start:end], rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("scheme", ["pre", "siamese"])
@pytest.mark.parametrize("mode", ["sublayer", "selective"])
def test_activation_checkpointing_keeps_values_and_gradients(scheme: str, mode: str) -> None:
    model = randomize(LanguageModel(tiny(scheme=scheme, value_residual_mix="learned"), dtype=F64), seed=14)
    tokens, targets = ids(seed=15), ids(seed=16)

    def grads() -> tuple[torch.Tensor, list[torch.Tensor]]:
        model.zero_grad()
        loss = model(tokens, targets).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    loss, want = grads()
    set_activation_checkpointing(model, mode)
    loss_ckpt, got = grads()
    torch.testing.assert_close(loss_ckpt, loss, rtol=1e-12, atol=1e-12)
    for (name, _), a, b in zip(model.named_parameters(), got, want):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


def test_attention_needs_the_first_layers_values() -> None:
    later = Attention(16, 4, layer_idx=1, value_residual="fixed")
    x = torch.randn(1, 3, 16)
    with raises_value_error("needs first_values"):
        later(x)
    with raises_value_error("layer 0 has not run"):
        later(x, first_values=FirstValues())
    with pytest.raises(ConfigError, match="value_residual must be None or one of fixed, learned"):
        Attention(16, 4, value_residual="sparse")


# ---- configuration ------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, fragment", [
    ({"value_residual_mix": "sparse"}, "model.value_residual_mix: unknown value 'sparse'; choose one of "
                                       "fixed, learned"),
    ({"value_residual": "yes"}, "model.value_residual must be true or false"),
    ({"value_residual_own": float("nan")}, "model.value_residual_own must be a finite number"),
    ({"value_residual_first": "half"}, "model.value_residual_first must be a finite number"),
    ({"value_residual": False, "value_residual_mix": "learned"},
     "model.value_residual_mix is set but model.value_residual is false"),
    ({"value_residual": False, "value_residual_first": 0.3},
     "model.value_residual_first is set but model.value_residual is false"),
    ({"family": "qwen3"}, "model.value_residual=true is not available with model.family=qwen3"),
])
def test_bad_values_are_one_line_config_errors(overrides: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        tiny(**overrides)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_overrides_reach_the_config_and_the_dump_round_trips(tmp_path: Path) -> None:
    cfg = load_config("tiny", ["model.value_residual=true", "model.value_residual_mix=learned",
                               "model.value_residual_first=0.25"])
    assert cfg.model.value_residual and cfg.model.value_weights == (0.5, 0.25)
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(cfg))
    assert load_config(str(path)) == cfg
    with pytest.raises(ConfigError, match="model.value_residual must be true or false"):
        load_config("tiny", ["model.value_residual=2"])


@pytest.mark.parametrize("preset", ["vit-digits", "dit-digits"])
def test_the_vision_models_have_no_such_option(preset: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(preset, ["model.value_residual=true"])
    assert "unknown key 'model.value_residual'" in str(err.value) and "\n" not in str(err.value)


def test_the_cli_refuses_a_bad_value_in_one_line(tmp_path: Path) -> None:
    out = cli_in_process("train", "tiny", "model.value_residual=true", "model.value_residual_mix=sparse",
                         "--out", str(tmp_path / "run"))
    assert out.returncode == 2 and "model.value_residual_mix: unknown value 'sparse'" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def windows(seed: int = 0, fail_at: int | None = None) -> RandomWindows:
    """Batches of 4 random 16-token windows of a fixed token stream; a crash at call ``fail_at``."""
    return RandomWindows(ids(b=1, t=400, seed=17)[0], seed=seed, batch=4, fail_at=fail_at,
                         error=RuntimeError)


def test_resume_restores_the_learned_weights_bit_for_bit(tmp_path: Path) -> None:
    cfg = TrainConfig(steps=6, lr=3e-2, warmup=1, eval_every=10**9, checkpoint_every=3)

    def model(seed: int) -> LanguageModel:
        torch.manual_seed(seed)
        return LanguageModel(tiny(n_layers=2, value_residual_mix="learned"))

    straight = model(0)
    train_engine(straight, windows(), cfg, tmp_path / "a", seed=0)
    with pytest.raises(RuntimeError):
        train_engine(model(0), windows(fail_at=5), cfg, tmp_path / "b", seed=0)
    resumed = model(3)
    train_engine(resumed, windows(seed=5), cfg, tmp_path / "b", seed=0, resume=True)
    weights = [n for n in straight.state_dict() if "value_mix" in n]
    assert weights and straight.state_dict()[weights[0]].item() != 0.5
    for name, p in straight.state_dict().items():
        assert torch.equal(p, resumed.state_dict()[name]), name


# ---- integrations -------------------------------------------------------------------------------
def test_the_hugging_face_model_carries_it(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    import siamesenorm.hf as H

    torch.manual_seed(0)
    hf_config = H.SiameseNormConfig.from_lm_config(tiny(value_residual_mix="learned"))
    m = transformers.AutoModelForCausalLM.from_config(hf_config).eval()
    randomize(m.model, seed=18)
    m.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.to_lm_config() == m.config.to_lm_config()
    assert loaded.model.config.value_residual and loaded.model.sublayers[2].value_mix.learned
    tokens = ids()
    torch.testing.assert_close(loaded(tokens).logits, m.model(tokens).logits, rtol=0, atol=1e-6)
    prompt = ids(b=2, t=5, seed=19)
    theirs = loaded.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=True)
    assert torch.equal(theirs, m.model.generate(prompt, 10, greedy=True, use_cache=False))
    with pytest.raises(ConfigError, match="model.value_residual_mix: unknown value"):
        H.SiameseNormConfig(value_residual=True, value_residual_mix="sparse")


# OLMo-core's refusal: tests/test_olmo_core.py (where the olmo extra is installed, as in CI)
