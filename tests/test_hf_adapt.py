"""``siamesenorm.hf.adapt``: a scheme inside a transformers model of a supported family.

References are the family's own model (``adapt(model, *native)`` of it, ``pre`` for a Pre-Norm
family and ``peri_ln`` for OLMo2, OLMo3 and Gemma3, computes the same logits, cache, generation,
hidden states, router logits) and, for SiameseNorm, its equations written out
below in float64 from the paper's notes (/work/shared/reference/papers.md, section 1.3 (a)),
calling the family's own attention and MLP modules as the sublayers F.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("siamesenorm.hf.adapt needs transformers 5", allow_module_level=True)

import siamesenorm.hf as H  # noqa: E402
from siamesenorm import ConfigError, list_schemes  # noqa: E402
from siamesenorm.hf.families import FAMILIES as TABLE  # noqa: E402
from siamesenorm.models.checkpointing import saved_activation_bytes  # noqa: E402
from siamesenorm.schemes import get_scheme_class  # noqa: E402

V = 97
DENSE = tuple(name for name, family in TABLE.items() if not family.moe)
MOE = tuple(name for name, family in TABLE.items() if family.moe)
FAMILIES = DENSE + MOE


pytestmark = pytest.mark.usefixtures("one_thread")


def family_config(family: str, attn: str = "sdpa", experts: str | None = None, **kw):
    """A tiny configuration of ``family`` (2 layers, width 64) with its features switched on:
    GQA everywhere, RoPE scaling and tied embeddings (Llama), sliding windows (Mistral: every
    layer; Qwen2 and Qwen3: layer 1 of 2; OLMo3, Gemma3: layer 0), QK-norm (Qwen3, OLMoE, Gemma3;
    OLMo2/3 over the whole width), MoE (Qwen3-MoE, OLMoE), Gemma3's logit soft-capping."""
    common = dict(vocab_size=V, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
                  pad_token_id=0)
    extra = {
        "llama": dict(head_dim=16, tie_word_embeddings=True,
                      rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
        "mistral": dict(head_dim=16, sliding_window=4),
        "qwen2": dict(use_sliding_window=True, sliding_window=4, max_window_layers=1),
        "qwen3": dict(head_dim=16, use_sliding_window=True, sliding_window=4, max_window_layers=1),
        "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32),
        "olmoe": dict(num_experts=4, num_experts_per_tok=2, intermediate_size=32),
        "olmo": dict(),
        "olmo2": dict(head_dim=16),
        "olmo3": dict(head_dim=16, sliding_window=4, layer_types=["sliding_attention", "full_attention"]),
        "gemma3_text": dict(head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
                            layer_types=["sliding_attention", "full_attention"],
                            final_logit_softcapping=30.0),
    }[family]
    cfg = getattr(transformers, TABLE[family].config_class)(**(common | extra | kw))
    cfg._attn_implementation = attn
    if experts is not None:                 # "eager" for float64 (grouped_mm has no float64)
        cfg._experts_implementation = experts
    return cfg


def family_model(family: str, attn: str = "sdpa", seed: int = 0, experts: str | None = None, **kw):
    """The family's own causal LM, its norm weights randomised (so that copying them matters)."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(family_config(family, attn, experts, **kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(1.0, 0.3)
    return model.eval()


def native(family: str) -> tuple[str, dict]:
    """The scheme (and options) that computes what ``family`` computes."""
    scheme, options = TABLE[family].native
    return scheme, dict(options)


def ids(b: int = 2, t: int = 9, seed: int = 1) -> torch.Tensor:
    return torch.randint(1, V, (b, t), generator=torch.Generator().manual_seed(seed))


def left_padded() -> tuple[torch.Tensor, torch.Tensor]:
    x = ids(3, 8)
    mask = torch.ones_like(x)
    mask[0, :3] = 0
    mask[2, :5] = 0
    return x.masked_fill(mask == 0, 0), mask


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-6) -> None:
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


# ---- Pre-Norm: the family's own model -------------------------------------------------------------
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", FAMILIES)
def test_the_native_scheme_computes_what_the_family_model_computes(family, attn):
    m = family_model(family, attn)
    scheme, options = native(family)
    a = H.adapt(m, scheme, **options)
    assert type(a).__name__.endswith("SchemeForCausalLM") and isinstance(a, type(m))
    assert a.config._attn_implementation == attn
    assert not any(n.endswith("layernorm.weight") for n, _ in a.named_parameters())
    x, mask = left_padded()
    labels = x.masked_fill(mask == 0, -100)
    with torch.no_grad():
        ref = m(x, attention_mask=mask, labels=labels, output_hidden_states=True)
        out = a(x, attention_mask=mask, labels=labels, output_hidden_states=True)
    close(out.logits, ref.logits)
    close(out.loss, ref.loss)
    assert len(out.hidden_states) == len(ref.hidden_states) == 3
    for h, r in zip(out.hidden_states, ref.hidden_states):
        close(h, r)
    # with the cache: a prefix, then one token at a time, past the sliding windows
    x = ids(2, 10)

    def cached(model):
        out = model(x[:, :6], use_cache=True)
        steps, cache = [out.logits], out.cache
        for t in range(6, 10):
            out = model(x[:, t:t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.cache
        assert cache.get_seq_length() == 10
        return torch.cat(steps, 1)

    with torch.no_grad():
        ours, theirs = cached(a), cached(m)
        close(ours, theirs)
        close(ours, a(x).logits, 1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_greedy_generate_with_left_padding_matches_the_family(family):
    m = family_model(family)
    scheme, options = native(family)
    a = H.adapt(m, scheme, **options)
    x, mask = left_padded()
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = m.generate(x, **kw)
        out = a.generate(x, **kw)
    assert torch.equal(out, ref)
    assert out.shape == (3, 14)


@pytest.mark.parametrize("scheme, options", [("siamese", {}), ("attn_res", {"block_size": 3})])
@pytest.mark.parametrize("family", ["qwen3", "olmoe"])
def test_a_scheme_generates_the_same_with_and_without_the_cache(family, scheme, options):
    a = H.adapt(family_model(family), scheme, **options)
    if scheme == "attn_res":       # non-zero pseudo-queries: the mixes are not plain means
        with torch.no_grad():
            a.scheme.pseudo_query.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))
    x, mask = left_padded()
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert torch.equal(a.generate(x, **kw), a.generate(x, use_cache=False, **kw))


def test_a_fresh_model_is_initialised_as_the_family_initialises_it():
    cfg = family_config("qwen3")
    torch.manual_seed(3)
    ref = transformers.Qwen3ForCausalLM(cfg).eval()
    torch.manual_seed(3)
    a = H.adapt(cfg, "pre").eval()
    assert a.config.siamesenorm == {"scheme": "pre", "scheme_options": {}}
    assert not hasattr(cfg, "siamesenorm")             # the caller's configuration is untouched
    with torch.no_grad():
        close(a(ids()).logits, ref(ids()).logits)


def test_adapt_copies_the_model_so_training_one_leaves_the_other():
    """The README's A/B pattern: two schemes from one base; a step on one moves neither the
    other nor the base."""
    m = family_model("qwen3")
    x = ids()
    pre, sia = H.adapt(m, "pre"), H.adapt(m, "siamese")
    with torch.no_grad():
        base_before, pre_before = m(x).logits, pre(x).logits
    assert sia.model.embed_tokens.weight is not m.model.embed_tokens.weight
    assert sia.model.stack.sublayers[2].q_proj.weight is not pre.model.stack.sublayers[2].q_proj.weight
    optimizer = torch.optim.AdamW(sia.parameters(), lr=1e-2)
    sia(x, labels=x).loss.backward()
    optimizer.step()
    with torch.no_grad():
        close(m(x).logits, base_before, 0)
        close(pre(x).logits, pre_before, 0)
        assert not torch.equal(sia.model.embed_tokens.weight, m.model.embed_tokens.weight)


def test_share_true_builds_from_the_models_own_modules():
    m = family_model("qwen3")
    x = ids()
    with torch.no_grad():
        before = m(x).logits
    pre, sia = H.adapt(m, "pre", share=True), H.adapt(m, "siamese", share=True)
    for adapted in (pre, sia):
        assert adapted.model.embed_tokens.weight is m.model.embed_tokens.weight
        assert adapted.lm_head.weight is m.lm_head.weight
        assert adapted.model.stack.sublayers[2].q_proj.weight is m.model.layers[1].self_attn.q_proj.weight
        assert adapted.model.stack.sublayers[3].down_proj.weight is m.model.layers[1].mlp.down_proj.weight
        assert adapted.model.stack.sublayers[0].config is adapted.config
    with torch.no_grad():
        sia(x, output_attentions=True)
        close(m(x).logits, before, 0)
    # the norms: copied into the scheme (pre), not shared
    assert torch.equal(pre.scheme.pre_norm[3].weight, m.model.layers[1].post_attention_layernorm.weight)
    assert pre.scheme.pre_norm[3].weight is not m.model.layers[1].post_attention_layernorm.weight
    assert torch.equal(pre.scheme.final_norm.weight, m.model.norm.weight)
    assert torch.equal(sia.scheme.pre_norm[0].weight, m.model.layers[0].input_layernorm.weight)
    assert torch.equal(sia.scheme.post_norm[0].weight, torch.ones(64))     # no counterpart


def test_share_true_with_a_qkv_norm_leaves_the_models_attention_as_it_was():
    m = family_model("llama")
    x = ids()
    with torch.no_grad():
        before = m(x).logits
    a = H.adapt(m, "siamese", form="hybrid_pre", share=True)
    assert a.model.stack.sublayers[0].v_proj is m.model.layers[0].self_attn.v_proj
    assert type(m.model.layers[0].self_attn) is transformers.models.llama.modeling_llama.LlamaAttention
    assert not any("head_norm" in n for n, _ in m.named_modules())
    with torch.no_grad():
        a(x)
        close(m(x).logits, before, 0)


def test_output_attentions_are_recorded_once_per_layer():
    m = family_model("qwen3", "eager")
    a = H.adapt(m, "siamese")
    with torch.no_grad():
        ref = m(ids(), output_attentions=True)          # installs the model's hooks first
        out = a(ids(), output_attentions=True)
        ref = m(ids(), output_attentions=True)
    assert len(out.attentions) == len(ref.attentions) == 2
    assert out.attentions[0].shape == (2, 4, 9, 9)
    with torch.no_grad():
        pre = H.adapt(m, "pre")(ids(), output_attentions=True)
    for ours, theirs in zip(pre.attentions, ref.attentions, strict=True):
        close(ours, theirs)


def test_the_attention_implementation_is_the_adapted_models_own():
    m = family_model("qwen3", "sdpa")
    a = H.adapt(m, "pre")
    x = ids()
    with torch.no_grad():
        before = a(x).logits
        a.set_attn_implementation("eager")
        assert a.config._attn_implementation == "eager" and m.config._attn_implementation == "sdpa"
        out = a(x, output_attentions=True)
    assert out.attentions[0] is not None and out.attentions[0].shape == (2, 4, 9, 9)
    close(out.logits, before, 1e-5)


@pytest.mark.parametrize("scheme", [n for n in list_schemes()
                                    if get_scheme_class(n).role_norm_names != (None, None)])
def test_scheme_norms_with_a_model_norms_role_start_as_copies_of_it(scheme):
    m = family_model("llama")
    a = H.adapt(m, scheme)
    per, head = a.scheme.role_norms()
    assert per or head is not None
    for i, norm in per.items():
        layer = m.model.layers[i // 2]
        src = layer.input_layernorm if i % 2 == 0 else layer.post_attention_layernorm
        assert torch.equal(norm.weight, src.weight) and norm.weight is not src.weight
    if head is not None:
        assert torch.equal(head.weight, m.model.norm.weight)


# ---- SiameseNorm: the paper's equations ----------------------------------------------------------
def _norm(family: str, x: torch.Tensor, module, eps: float) -> torch.Tensor:
    if family == "olmo":           # LayerNorm without parameters
        assert module.weight is None
        return (x - x.mean(-1, keepdim=True)) / torch.sqrt(x.var(-1, unbiased=False, keepdim=True) + 1e-5)
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * module.weight


def _masks(t: int, window: int | None) -> dict[str, torch.Tensor]:
    q, k = torch.arange(t)[:, None], torch.arange(t)[None, :]
    full = torch.zeros(t, t, dtype=torch.float64).masked_fill(k > q, -math.inf)
    out = {"full_attention": full[None, None]}
    if window is not None:
        out["sliding_attention"] = full.masked_fill(q - k >= window, -math.inf)[None, None]
    return out


def siamese_reference(family: str, m, scheme, x: torch.Tensor) -> torch.Tensor:
    """Logits of SiameseNorm (``post_pre``, the official DeiT block, with normalised input and
    depth scaling; head ``LN(LN(X) + LN(Y))``) around ``m``'s own attention and MLP, per block
    ``b`` with ``c = sqrt(2 (b + 1))`` and, per sublayer ``i``::

        X = LN^X_i(X);  O = F_i(LN^in_i(X + LN^Y_i(Y)));  X = X + O / c;  Y = Y + O
    """
    cfg = m.config
    eps = getattr(cfg, "rms_norm_eps", 1e-5)
    t = x.shape[1]
    h = m.model.embed_tokens(x)
    pos = torch.arange(t)[None]
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    if TABLE[family].rope_per_layer_type:
        ropes = {kind: m.model.rotary_emb(h, pos, kind) for kind in set(types)}
    else:
        ropes = dict.fromkeys(set(types) | {"sliding_attention"}, m.model.rotary_emb(h, pos))
    if family == "mistral":
        types = ["sliding_attention"] * cfg.num_hidden_layers
    masks = _masks(t, getattr(cfg, "sliding_window", None))
    X = Y = h
    for b, layer in enumerate(m.model.layers):
        c = math.sqrt(2 * (b + 1))
        subs = (lambda u, layer=layer, b=b: layer.self_attn(
                    hidden_states=u, position_embeddings=ropes[types[b]],
                    attention_mask=masks[types[b]])[0],
                layer.mlp)
        for j, F in enumerate(subs):
            i = 2 * b + j
            X = _norm(family, X, scheme.post_norm[i], eps)
            u = _norm(family, X + _norm(family, Y, scheme.pre_norm[i], eps), scheme.input_norm[i], eps)
            out = F(u)
            X, Y = X + out / c, Y + out
    merged = _norm(family, X, scheme.merge_norm_x, eps) + _norm(family, Y, scheme.merge_norm_y, eps)
    logits = m.lm_head(_norm(family, merged, scheme.final_norm, eps))
    cap = getattr(cfg, "final_logit_softcapping", None)     # Gemma3's head
    return logits if cap is None else cap * torch.tanh(logits / cap)


@pytest.mark.parametrize("family", FAMILIES)
def test_siamese_computes_the_papers_equations(family):
    m = family_model(family, "eager", experts="eager").double()
    a = H.adapt(m, "siamese")
    with torch.no_grad():
        for p in a.scheme.parameters():     # every scheme norm its own random weight
            p.normal_(1.0, 0.3)
    x = ids(2, 9)
    with torch.no_grad():
        out = a(x).logits
        ref = siamese_reference(family, m, a.scheme, x)
    assert out.dtype == torch.float64
    close(out, ref, 1e-10)
    assert (out - m(x).logits).abs().max() > 1e-3                  # not the family's own wiring


# ---- every scheme on every family -----------------------------------------------------------------
SCHEMES = [(s, {}) for s in list_schemes()] + [("siamese", {"form": "hybrid_pre"})]


@pytest.mark.parametrize("scheme,options", SCHEMES, ids=[s + ("-" + "-".join(o.values()) if o else "")
                                                         for s, o in SCHEMES])
def test_every_scheme_builds_on_every_family_and_takes_a_training_step(scheme, options):
    for family in FAMILIES:
        torch.manual_seed(0)
        a = H.adapt(family_config(family), scheme, **options).train()
        assert a.scheme.name == scheme
        norms = [n for n in a.scheme.modules() if type(n).__name__ in ("LayerNorm", "RMSNorm")]
        if family == "olmo":     # OLMo's norms have no parameters; so have the scheme's
            assert all(n.weight is None and n.eps == 1e-5 for n in norms
                       if type(n).__name__ == "LayerNorm"), scheme
        else:                    # RMSNorm with the configuration's eps
            assert {(type(n).__name__, n.eps) for n in norms} == {("RMSNorm", a.config.rms_norm_eps)}, scheme
        x = ids(2, 8)
        opt = torch.optim.AdamW(a.parameters(), lr=1e-3)
        loss = a(x, labels=x).loss
        loss.backward()
        opt.step()
        assert torch.isfinite(loss), (family, scheme)
        assert all(torch.isfinite(p).all() for p in a.parameters()), (family, scheme)
        with torch.no_grad():
            assert torch.isfinite(a(x, labels=x).loss)


@pytest.mark.parametrize("family, normed", [("qwen3", ["v"]), ("olmo2", ["v"]), ("gemma3_text", ["v"]),
                                            ("llama", ["q", "k", "v"])])
def test_hybrid_pre_normalises_q_k_v_per_head_where_the_family_does_not(family, normed):
    """The projections stay the family's Linear modules under their own names; the per-head norms
    are siblings (``v_head_norm``) that the attention applies to each projection's output."""
    m = family_model(family, "eager")
    a = H.adapt(m, "siamese", form="hybrid_pre")
    attn, theirs = a.model.stack.sublayers[0], m.model.layers[0].self_attn
    assert {n for n, _ in attn.named_children()} == \
        {n for n, _ in theirs.named_children()} | {f"{k}_head_norm" for k in normed}
    assert all(type(getattr(attn, f"{k}_proj")) is torch.nn.Linear for k in "qkv")
    assert attn.v_head_norm.weight.shape == (16,)
    with torch.no_grad():
        for k in normed:
            getattr(attn, f"{k}_head_norm").weight.normal_(1.0, 0.3)
    # the reference: the family's attention with each projection's output normalised per head
    # (16 values at a time) by a hook, on the same weights
    hooks = [getattr(theirs, f"{k}_proj").register_forward_hook(
        lambda mod, args, out, k=k: getattr(attn, f"{k}_head_norm")(out.unflatten(-1, (-1, 16))).flatten(-2))
        for k in normed]
    x = torch.randn(2, 5, 64)
    kind = (getattr(m.config, "layer_types", None) or ["full_attention"])[0]
    pos = torch.arange(5)[None]
    rope = m.model.rotary_emb(x, pos, *[kind] * TABLE[family].rope_per_layer_type)
    with torch.no_grad():
        want = theirs(x, position_embeddings=rope, attention_mask=None)[0]
        for h in hooks:
            h.remove()
        plain = theirs(x, position_embeddings=rope, attention_mask=None)[0]
        got = attn(x, position_embeddings=rope, attention_mask=None)[0]
    close(got, want)
    assert (got - plain).abs().max() > 1e-3


def test_a_checkpoint_of_the_earlier_wrapped_projections_loads():
    """Before, a QKV-norm wrapped the projection (``v_proj.proj.weight``, ``v_proj.norm.weight``)."""
    a = H.adapt(family_model("llama"), "siamese", form="hybrid_pre")
    state = {}
    for key, value in a.state_dict().items():
        for k in "qkv":
            key = key.replace(f"{k}_proj.weight", f"{k}_proj.proj.weight")
            key = key.replace(f"{k}_head_norm.", f"{k}_proj.norm.")
        state[key] = value.clone() + 0.5 * ("head_norm" in key or "proj.norm" in key)
    assert "model.stack.sublayers.0.v_proj.norm.weight" in state
    b = H.adapt(family_model("llama", seed=1), "siamese", form="hybrid_pre")
    b.load_state_dict(state)
    ours, theirs = b.model.stack.sublayers[0], a.model.stack.sublayers[0]
    close(ours.v_head_norm.weight, theirs.v_head_norm.weight + 0.5, 0)
    close(b.model.stack.sublayers[2].q_proj.weight, a.model.stack.sublayers[2].q_proj.weight, 0)


def test_deepnorm_initialises_a_fresh_model_as_deepnorm_asks():
    torch.manual_seed(0)
    a = H.adapt(family_config("qwen3"), "deepnorm")
    beta = a.scheme.requires.branch_gain
    assert beta < 1
    attn, mlp = a.model.stack.sublayers[0], a.model.stack.sublayers[1]
    fan = attn.v_proj.weight.shape
    xavier = math.sqrt(2.0 / (fan[0] + fan[1]))
    assert attn.v_proj.weight.std().item() == pytest.approx(beta * xavier, rel=0.1)
    fan = attn.q_proj.weight.shape
    assert attn.q_proj.weight.std().item() == pytest.approx(math.sqrt(2.0 / (fan[0] + fan[1])), rel=0.1)
    fan = mlp.down_proj.weight.shape
    assert mlp.down_proj.weight.std().item() == pytest.approx(beta * math.sqrt(2.0 / (fan[0] + fan[1])),
                                                              rel=0.1)


# ---- activation checkpointing ---------------------------------------------------------------------
@pytest.mark.parametrize("family", ["qwen3", "olmoe"])
def test_gradient_checkpointing_gives_the_same_gradients(family):
    m = family_model(family)
    a = H.adapt(m, "siamese").train()
    x = ids(2, 8)

    def grads():
        a.zero_grad(set_to_none=True)
        loss = a(x, labels=x).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in a.named_parameters() if p.grad is not None}

    def saved():
        return saved_activation_bytes(lambda: a(x, labels=x).loss)

    loss0, g0 = grads()
    bytes0 = saved()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)     # transformers 5.2x renames these
        a.gradient_checkpointing_enable()
        assert a.is_gradient_checkpointing
        loss1, g1 = grads()
        bytes1 = saved()
        a.gradient_checkpointing_disable()
        assert not a.is_gradient_checkpointing
    close(loss1, loss0, 0)
    assert g0.keys() == g1.keys() and len(g0) > 10
    for n in g0:
        close(g1[n], g0[n], 1e-6)
    assert bytes1 < bytes0 / 2            # each step keeps only its input streams


# ---- mixture of experts ---------------------------------------------------------------------------
@pytest.mark.parametrize("family", MOE)
def test_moe_router_logits_and_aux_loss_are_returned_and_the_loss_falls(family):
    m = family_model(family)
    pre = H.adapt(m, "pre")
    x = ids(2, 8)
    with torch.no_grad():
        ref = m(x, labels=x, output_router_logits=True)
        out = pre(x, labels=x, output_router_logits=True)
    assert len(out.router_logits) == len(ref.router_logits) == 2
    assert out.router_logits[0].shape == (16, 4)
    close(out.aux_loss, ref.aux_loss)
    close(out.loss, ref.loss)
    a = H.adapt(m, "siamese").train()
    opt = torch.optim.AdamW(a.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        out = a(x, labels=x, output_router_logits=True)
        assert out.aux_loss is not None and len(out.router_logits) == 2
        ce = a(x, labels=x).loss
        close(out.loss, ce + a.router_aux_loss_coef * out.aux_loss, 1e-5)
        opt.zero_grad()
        out.loss.backward()
        assert a.model.stack.sublayers[1].gate.weight.grad.abs().sum() > 0   # the router learns
        opt.step()
        losses.append(out.loss.item())
    assert losses[-1] < losses[0] - 0.1, losses


# ---- saving and loading ---------------------------------------------------------------------------
@pytest.mark.parametrize("family,scheme,options", [
    ("qwen3", "siamese", {"depth_scale": False}),
    ("qwen3_moe", "siamese", {}),
    ("olmo", "siamese", {"form": "hybrid_pre"}),
    ("llama", "pre", {}),
])
def test_save_pretrained_then_adapt_from_pretrained_round_trips(tmp_path, family, scheme, options):
    a = H.adapt(family_model(family), scheme, **options)
    with torch.no_grad():
        for p in a.scheme.parameters():
            p.normal_(1.0, 0.3)
    a.save_pretrained(tmp_path)
    b = H.adapt_from_pretrained(tmp_path).eval()
    assert type(b) is type(a)
    assert b.config.siamesenorm == {"scheme": scheme, "scheme_options": options}
    assert b.config.model_type == f"siamesenorm_{family}"
    x = ids()
    with torch.no_grad():
        close(b(x).logits, a(x).logits, 0)
    if family == "llama":                              # tied embeddings stay tied
        assert b.lm_head.weight is b.model.embed_tokens.weight


_LOAD = r"""
import json, sys, torch
import siamesenorm.hf as H
x, out = torch.tensor(json.loads(sys.argv[1])), {}
for folder in sys.argv[2:]:
    model = H.adapt_from_pretrained(folder).eval()
    with torch.no_grad():
        out[folder] = [type(model).__name__, model.config.siamesenorm, model(x).logits.tolist()]
print(json.dumps(out))
"""


def test_olmo2_olmo3_and_gemma3_save_and_load_in_a_fresh_process(tmp_path):
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    x = ids()
    want = {}
    for family, scheme, options in [("olmo2", "siamese", {}), ("olmo3", "siamese", {"form": "hybrid_pre"}),
                                    ("gemma3_text", "peri_ln", {})]:
        a = H.adapt(family_model(family), scheme, **options)
        with torch.no_grad():
            for p in a.scheme.parameters():
                p.normal_(1.0, 0.3)
            want[str(tmp_path / family)] = (type(a).__name__, a.config.siamesenorm, a(x).logits)
        a.save_pretrained(tmp_path / family)
    src = str(Path(__file__).resolve().parents[1] / "src")
    env = os.environ | {"PYTHONPATH": src, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-c", _LOAD, json.dumps(x.tolist()), *want], env=env,
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    for folder, (cls, spec, logits) in want.items():
        assert got[folder][:2] == [cls, spec]
        close(torch.tensor(got[folder][2]), logits, 1e-6)


def test_adapt_from_pretrained_refuses_a_plain_family_folder(tmp_path):
    family_model("qwen3").save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="adapt"):
        H.adapt_from_pretrained(tmp_path)


@pytest.mark.parametrize("options, match", [
    ({"device": "cpu"}, "device come\\(s\\) from the"), ({"eps": 1e-6}, "eps come"),
    (["form", "hybrid_pre"], "scheme_options must be a mapping of option names to values, got list"),
    ({"n_streams": 20000}, "option n_streams=20000 is outside \\[1, 16\\]"),
])
def test_adapt_from_pretrained_refuses_a_bad_scheme_entry_before_building(tmp_path, options, match):
    """A config.json whose scheme options hold the family's settings, a list or a size beyond any
    paper was a TypeError, or tried to allocate 38 GB (issue 37)."""
    import json

    H.adapt(family_config("qwen3"), "hyper").save_pretrained(tmp_path)
    path = tmp_path / "config.json"
    config = json.loads(path.read_text())
    config["siamesenorm"]["scheme_options"] = options
    path.write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=match) as e:
        H.adapt_from_pretrained(tmp_path)
    assert "\n" not in str(e.value)


def test_the_adapted_model_pickles_and_keeps_the_sources_checkpointing():
    """adapt() made the model unpicklable (transformers' output hooks, installed eagerly; now when
    an output is asked for, as in the family's own model) and dropped gradient checkpointing."""
    import io

    m = family_model("qwen3", "eager")
    a = H.adapt(m, "siamese")
    for model in (m, a):
        torch.save(model, io.BytesIO())
    assert not a.is_activation_checkpointing
    with torch.no_grad():
        assert len(a(ids(), output_attentions=True).attentions) == 2
    m.activation_checkpointing_enable()     # (which makes m itself unpicklable: transformers' hook)
    assert H.adapt(m, "siamese").is_activation_checkpointing


# ---- the rest of the transformers interface ---------------------------------------------------------
def test_resize_token_embeddings():
    m = family_model("llama")
    a = H.adapt(m, "siamese")
    a.resize_token_embeddings(V + 7)
    assert a.config.vocab_size == V + 7 and m.config.vocab_size == V
    assert a.lm_head.weight is a.model.embed_tokens.weight        # tied
    x = torch.randint(0, V + 7, (2, 6))
    assert a(x, labels=x).logits.shape == (2, 6, V + 7)
    assert m.model.embed_tokens.weight.shape[0] == m.lm_head.weight.shape[0] == V
    with torch.no_grad():
        assert m(x.clamp(max=V - 1)).logits.shape == (2, 6, V)


def test_hidden_states_of_a_two_stream_scheme_are_the_merged_streams():
    a = H.adapt(family_model("qwen3"), "siamese")
    x = ids()
    with torch.no_grad():
        out = a(x, output_hidden_states=True)
        h, states = a.model.embed_tokens(x), []
        rope = a.model.rotary_emb(h, torch.arange(9)[None])
        a.model.stack.run(h, states=states, attention_kwargs={"position_embeddings": rope},
                          wrap=lambda i, f: (lambda u: f(u, attention_mask=None)[0]) if i % 2 == 0 else f)
    assert len(out.hidden_states) == 3
    close(out.hidden_states[0], a.scheme.exit(states[0]))      # the embedding: X = Y = h
    close(out.hidden_states[1], a.scheme.exit(states[1]))
    close(a.lm_head(out.hidden_states[-1]), out.logits)


def test_trainer_runs_a_few_steps_on_an_adapted_qwen3(tmp_path):
    a = H.adapt(family_config("qwen3"), "siamese")
    before = a.model.stack.sublayers[0].q_proj.weight.detach().clone()
    data = [{"input_ids": ids(1, 12, seed=s)[0], "labels": ids(1, 12, seed=s)[0]} for s in range(8)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / "out"), report_to=[], use_cpu=True, max_steps=3,
            per_device_train_batch_size=4, learning_rate=1e-3, logging_steps=1, save_strategy="no",
            gradient_checkpointing=True, disable_tqdm=True)
        trainer = transformers.Trainer(model=a, args=args, train_dataset=data)
        result = trainer.train()
    assert result.global_step == 3 and math.isfinite(result.training_loss)
    assert not torch.equal(a.model.stack.sublayers[0].q_proj.weight, before)


# ---- refusals -------------------------------------------------------------------------------------
def test_refusals_are_one_line_config_errors():
    gpt2 = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4)
    with pytest.raises(ConfigError, match="qwen3_moe, olmoe, olmo, olmo2, olmo3, gemma3_text") as e:
        H.adapt(gpt2)
    assert "\n" not in str(e.value)
    cfg = family_config("qwen3")
    for kwargs, match in [({"scheme": "nope"}, "unknown scheme 'nope'"),
                          ({"scheme": "pre", "form": "hybrid_pre"}, "has no option 'form'"),
                          ({"scheme": "siamese", "form": "bad"}, "form='bad'"),
                          ({"scheme": "pre", "norm": "batchnorm"}, "norm must be one of"),
                          ({"scheme": "pre", "eps": 1e-6}, "eps come")]:
        with pytest.raises(ConfigError, match=match) as e:
            H.adapt(cfg, **kwargs)
        assert "\n" not in str(e.value)
    a = H.adapt(cfg, "pre")
    with pytest.raises(ConfigError, match="already"):
        H.adapt(a, "siamese")
    with pytest.raises(ConfigError, match="Qwen3ForCausalLM"):
        H.adapt(transformers.Qwen3Model(cfg), "pre")
