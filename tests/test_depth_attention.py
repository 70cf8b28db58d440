"""Depth-Attention (arXiv 2606.05014) in the language model.

The equations, written out below independently of the library: attention layer ``l`` has the
source layers ``S(l) = {j < l : j mod s == 0}``; at every position and key/value head ``g`` the
mean query of the heads of group ``g`` scores the keys of those layers and its own (each as its
attention reads it, ``/ sqrt(head_dim)``), and the softmax of the scores weighs their values, the
sources' already mixed, its own as projected; the mixed value is what its attention reads.
"""

from __future__ import annotations

import math
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from helpers import cli_in_process, raises_value_error
from siamesenorm.errors import ConfigError
from siamesenorm.models import DiT, LanguageModel, LMConfig, VisionTransformer, ViTConfig
from siamesenorm.models.checkpointing import set_activation_checkpointing
from siamesenorm.models.dit_config import DIT_SIZES, DiTConfig
from siamesenorm.nn.attention import Attention
from siamesenorm.nn.depth_attention import DepthKeysValues
from siamesenorm.tasks import load_config
from siamesenorm.train import build_optimizer
from test_value_residual import ids, randomize, rms, rope

F64 = torch.float64


def tiny(**overrides) -> LMConfig:
    options = dict(vocab_size=29, dim=24, n_layers=4, n_heads=4, n_kv_heads=2, max_seq_len=32,
                   tie_embeddings=False, depth_attention=True)
    options.update(overrides)
    return LMConfig(**options)


# ---- the paper's equations, by hand -----------------------------------------------------------
def reference_logits(model: LanguageModel, tokens: torch.Tensor, stride: int) -> torch.Tensor:
    """Pre-Norm Llama-style decoder with Depth-Attention, position by position along depth."""
    cfg, scheme, subs = model.config, model.scheme, model.sublayers
    b, t = tokens.shape
    h, hk, hd, eps = cfg.n_heads, cfg.kv_heads, cfg.head_dim, cfg.norm_eps
    group = h // hk
    x = model.embed.weight[tokens]
    future = torch.ones(t, t, dtype=torch.bool).triu(1)
    keys, values = [], []                     # per layer: (B, Hkv, T, hd), the value mixed
    for layer in range(cfg.n_layers):
        attn, mlp = subs[2 * layer], subs[2 * layer + 1]
        u = rms(x, scheme.pre_norm[2 * layer].weight, eps)
        q = (u @ attn.q_proj.weight.T).reshape(b, t, h, hd)
        k = (u @ attn.k_proj.weight.T).reshape(b, t, hk, hd)
        if cfg.qk_norm:
            q, k = rms(q, attn.q_norm.weight, eps), rms(k, attn.k_norm.weight, eps)
        q, k = rope(q.transpose(1, 2), cfg.rope_theta), rope(k.transpose(1, 2), cfg.rope_theta)
        v = (u @ attn.v_proj.weight.T).reshape(b, t, hk, hd).transpose(1, 2)
        sources = [j for j in range(layer) if j % stride == 0]
        mixed = torch.empty_like(v)
        for g in range(hk):
            qbar = q[:, g * group:(g + 1) * group].mean(1)             # (B, T, hd)
            cand_k = [keys[j][:, g] for j in sources] + [k[:, g]]
            cand_v = [values[j][:, g] for j in sources] + [v[:, g]]
            scores = torch.stack([(qbar * kj).sum(-1) / math.sqrt(hd) for kj in cand_k], -1)
            weights = scores.softmax(-1)                                 # (B, T, n)
            mixed[:, g] = sum(weights[..., n, None] * vj for n, vj in enumerate(cand_v))
        keys.append(k)
        values.append(mixed)
        heads = []
        for head in range(h):
            g = head // group
            scores = q[:, head] @ k[:, g].transpose(-1, -2) / math.sqrt(hd)
            heads.append(scores.masked_fill(future, float("-inf")).softmax(-1) @ mixed[:, g])
        x = x + torch.stack(heads, dim=2).reshape(b, t, cfg.dim) @ attn.out_proj.weight.T
        u = rms(x, scheme.pre_norm[2 * layer + 1].weight, eps)
        gated = torch.nn.functional.silu(u @ mlp.gate_proj.weight.T) * (u @ mlp.up_proj.weight.T)
        x = x + gated @ mlp.down_proj.weight.T
    return rms(x, scheme.final_norm.weight, eps) @ model.lm_head.weight.T


@pytest.mark.parametrize("overrides, stride", [
    ({}, 2),                                             # the default: half the layers
    ({"depth_attention_stride": 1}, 1),                  # every earlier layer
    ({"depth_attention_stride": 1, "n_kv_heads": None, "qk_norm": True}, 1),
    ({"n_layers": 5, "depth_attention_stride": 2, "n_heads": 6, "n_kv_heads": 2,
      "dim": 36}, 2),                                    # GQA groups of 3; sources 0 and 2
])
def test_model_equals_the_papers_equations_in_values_and_gradients(overrides: dict,
                                                                   stride: int) -> None:
    model = randomize(LanguageModel(tiny(**overrides), dtype=F64), seed=2)
    assert model.config.depth_stride == stride
    tokens, targets = ids(), ids(seed=3)
    params = list(model.parameters())
    got = model(tokens).logits
    want = reference_logits(model, tokens, stride)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    plain = LanguageModel(replace(model.config, depth_attention=False, depth_attention_stride=None),
                          dtype=F64)
    plain.load_state_dict(model.state_dict())         # no parameters of its own
    assert not torch.allclose(plain(tokens).logits, got)
    loss = torch.nn.functional.cross_entropy
    g_got = torch.autograd.grad(loss(got.flatten(0, 1), targets.flatten()), params)
    g_want = torch.autograd.grad(loss(want.flatten(0, 1), targets.flatten()), params)
    for (name, _), a, b in zip(model.named_parameters(), g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-8, atol=1e-10, msg=name)
    assert all(g.abs().sum() > 0 for g in g_got)


@pytest.mark.parametrize("overrides", [{}, {"depth_attention_stride": 1, "qk_norm": True},
                                       {"n_kv_heads": 1, "depth_attention_stride": 1}])
def test_cached_generation_equals_uncached(overrides: dict) -> None:
    model = randomize(LanguageModel(tiny(**overrides), dtype=F64), seed=11)
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
    model = randomize(LanguageModel(tiny(scheme=scheme, depth_attention_stride=1), dtype=F64), seed=14)
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


@pytest.mark.parametrize("scheme", ["pre", "siamese", "hyper", "attn_res"])
def test_each_scheme_trains_with_it(scheme: str) -> None:
    torch.manual_seed(0)
    model = LanguageModel(tiny(scheme=scheme))
    opt = build_optimizer(model, 1e-2)
    tokens, targets = ids(t=12, seed=9), ids(t=12, seed=10)
    losses = []
    for _ in range(6):
        loss = model(tokens, targets).loss
        loss.backward()
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.1, losses


def test_attention_needs_the_earlier_layers() -> None:
    later = Attention(16, 4, layer_idx=1, depth_attention=True)
    x = torch.randn(1, 3, 16)
    with raises_value_error("needs depth_kv"):
        later(x)
    with raises_value_error("depth of layer 0, which has not run"):
        later(x, depth_kv=DepthKeysValues(1))
    with raises_value_error("stride must be at least 1"):
        DepthKeysValues(0)


# ---- configuration ------------------------------------------------------------------------------
@pytest.mark.parametrize("overrides, fragment", [
    ({"depth_attention": "yes"}, "model.depth_attention must be true or false"),
    ({"depth_attention_stride": 0}, "model.depth_attention_stride must be a positive integer or null"),
    ({"depth_attention": False, "depth_attention_stride": 2},
     "model.depth_attention_stride is set but model.depth_attention is false"),
    ({"value_residual": True}, "model.depth_attention and model.value_residual both rewrite the values"),
])
def test_bad_values_are_one_line_config_errors(overrides: dict, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        tiny(**overrides)
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_olmo_core_refuses_it_in_one_line() -> None:
    with pytest.raises(ConfigError) as err:
        tiny().check_host("olmo_core")
    assert "model.depth_attention=true is not available with the OLMo-core model" in str(err.value)
    tiny(depth_attention=False).check_host("olmo_core")


def test_overrides_reach_the_config() -> None:
    cfg = load_config("tiny", ["model.depth_attention=true", "model.depth_attention_stride=1"])
    assert cfg.model.depth_attention and cfg.model.depth_stride == 1
    assert load_config("tiny", ["model.depth_attention=true"]).model.depth_stride == \
        max(1, cfg.model.n_layers // 2)


def test_the_cli_refuses_it_with_value_residuals_in_one_line(tmp_path: Path) -> None:
    out = cli_in_process("train", "tiny", "model.depth_attention=true", "model.value_residual=true",
                         "--out", str(tmp_path / "run"))
    assert out.returncode == 2 and "model.depth_attention and model.value_residual" in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1 and "Traceback" not in out.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_hugging_face_model_carries_it(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    import siamesenorm.hf as H

    torch.manual_seed(0)
    m = transformers.AutoModelForCausalLM.from_config(H.SiameseNormConfig.from_lm_config(tiny())).eval()
    randomize(m.model, seed=18)
    m.save_pretrained(tmp_path)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.model.config.depth_attention
    prompt = ids(b=2, t=5, seed=19)
    theirs = loaded.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=True)
    assert torch.equal(theirs, m.model.generate(prompt, 10, greedy=True, use_cache=False))


def test_the_schemes_listing_names_it() -> None:
    tail = cli_in_process("schemes", "-v").stdout
    assert "model.depth_attention:" in tail and "arXiv 2606.05014" in tail


# ---- the vision models: the same attention, each token mixing along depth on its own ------------
def vision(kind: str, depth_attention: bool, **overrides):
    options = {"depth_attention": depth_attention, **overrides}
    if kind == "vit":
        return VisionTransformer(ViTConfig.from_size("digits", **options), dtype=F64)
    return DiT(DiTConfig(**DIT_SIZES["digits"], **options), dtype=F64)


def vision_loss(model, kind: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(2, 1, 8, 8, generator=gen, dtype=F64)
    labels = torch.tensor([3, 7])
    if kind == "vit":
        return model(x, labels).loss
    return model(x, torch.tensor([5.0, 500.0], dtype=F64), labels).square().mean()


@pytest.mark.parametrize("mode", ["sublayer", "selective"])
@pytest.mark.parametrize("kind", ["vit", "dit"])
def test_the_vision_models_carry_it_through_checkpointing(kind: str, mode: str) -> None:
    """In training (checkpointing applies only there; DiT's label dropout draws from the seed)."""
    model = randomize(vision(kind, True, depth_attention_stride=1), seed=22).train()
    plain = vision(kind, False).train()
    plain.load_state_dict(model.state_dict())       # no parameters of its own
    torch.manual_seed(0)
    loss = vision_loss(model, kind)
    torch.manual_seed(0)
    assert torch.isfinite(loss) and not torch.allclose(loss, vision_loss(plain, kind))
    want = torch.autograd.grad(loss, list(model.parameters()), allow_unused=True)
    set_activation_checkpointing(model, mode)
    torch.manual_seed(0)
    got = torch.autograd.grad(vision_loss(model, kind), list(model.parameters()), allow_unused=True)
    for (name, _), a, b in zip(model.named_parameters(), got, want):
        if b is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("preset", ["vit-digits", "dit-digits"])
def test_the_vision_presets_take_it(preset: str) -> None:
    cfg = load_config(preset, ["model.depth_attention=true", "model.depth_attention_stride=2"])
    assert cfg.model.depth_attention and cfg.model.depth_attention_stride == 2
    with pytest.raises(ConfigError) as err:
        load_config(preset, ["model.depth_attention_stride=2"])
    assert "model.depth_attention_stride is set but model.depth_attention is false" in str(err.value)


# ---- the lean path ------------------------------------------------------------------------------
@pytest.mark.parametrize("groups,per_group,sources,dtype", [
    (2, 3, 2, F64), (4, 1, 1, F64), (1, 4, 3, F64), (2, 2, 2, torch.bfloat16)])
def test_the_lean_mix_equals_the_plain_one_in_values_and_gradients(groups, per_group, sources, dtype):
    from siamesenorm.compute import use_path
    from siamesenorm.nn.depth_attention import depth_mix

    g = torch.Generator().manual_seed(groups * 10 + sources)
    shape = (2, groups, 7, 8)
    made = [torch.randn(2, groups * per_group, 7, 8, generator=g, dtype=F64)]
    made += [torch.randn(shape, generator=g, dtype=F64) for _ in range(2 + 2 * sources)]
    grad = torch.randn(shape, generator=g, dtype=F64).to(dtype)

    def run(plain: bool):
        leaves = [t.to(dtype).requires_grad_() for t in made]
        q, k, v, rest = leaves[0], leaves[1], leaves[2], leaves[3:]
        with use_path("reference" if plain else "kernels"):
            out = depth_mix(q, k, v, rest[:sources], rest[sources:])
        return out, torch.autograd.grad(out, leaves, grad)

    (lean, lean_grads), (plain, plain_grads) = run(False), run(True)
    tol = dict(atol=1e-12, rtol=1e-12) if dtype == F64 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(lean, plain, **tol)
    for a, b in zip(lean_grads, plain_grads):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_the_lean_path_keeps_about_what_pre_norm_keeps(qk_norm: bool) -> None:
    """On the meta device (the bytes a forward keeps for backward, no memory used): the plain mix
    keeps stacked copies of the keys and values (+21-24% at this size); the lean one keeps its
    inputs, which attention keeps or recomputes anyway, but for each layer's unmixed values (one
    tensor of the values' size a layer, +5%), the depth weights and the source layers' keys."""
    from siamesenorm.compute import use_path
    from siamesenorm.models.checkpointing import saved_activation_bytes

    def saved(depth: bool, plain: bool = False) -> int:
        cfg = LMConfig(vocab_size=256, dim=256, n_layers=12, n_heads=4, max_seq_len=256,
                       qk_norm=qk_norm, depth_attention=depth)
        model = LanguageModel(cfg, device="meta")
        x = torch.zeros(8, 257, dtype=torch.long, device="meta")
        with use_path("reference" if plain else "kernels"):
            return saved_activation_bytes(lambda: model(x[:, :-1], x[:, 1:]).loss)

    pre = saved(False)
    assert saved(True) / pre <= 1.06
    assert saved(True, plain=True) / saved(False, plain=True) > 1.15
