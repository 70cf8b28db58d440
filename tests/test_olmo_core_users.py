"""A user's own OLMo-core ``TransformerConfig`` as a scheme model (``from_transformer_config``):
under the scheme that is the config's own placement, the scheme model computes what OLMo-core's
own model of the original config computes on the same weights (float64); what a scheme block
cannot carry is refused in one line naming the field; docs/olmo-core.md's example runs."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch

pytest.importorskip("olmo_core")

from olmo_core.nn.layer_norm import LayerNormConfig, LayerNormType  # noqa: E402
from olmo_core.nn.transformer import TransformerConfig  # noqa: E402
from olmo_core.nn.transformer.config import TransformerBlockType as Block  # noqa: E402

from helpers import run_docs_section  # noqa: E402
from siamesenorm.errors import UserError  # noqa: E402
from siamesenorm.olmo_core import (  # noqa: E402
    OWN_OPTIONS,
    OWN_SCHEME,
    PortableDroplessMLP,
    SchemeMoETransformer,
    SchemeTransformerConfig,
    from_transformer_config,
    lm_config,
)

VOCAB, SEQ = 64, 8


def olmo2_like(block: Block = Block.default, **kw) -> TransformerConfig:
    """OLMo2's attention at a tiny size: QK-norm over all heads, a head_dim of its own, GQA."""
    return TransformerConfig.llama_like(
        d_model=32, vocab_size=VOCAB, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=12, qk_norm=True,
        layer_norm_eps=1e-6, rope_theta=500_000, block_name=block, **kw)


CONFIGS = {   # name -> (the user's config, the OLMo-core norms' names -> ours, by block b)
    "llama2_271M": (lambda: TransformerConfig.llama2_271M(VOCAB, n_layers=1, n_heads=8),
                    {"attention_norm": "pre_norm.{a}", "feed_forward_norm": "pre_norm.{f}"}),
    "olmo2-attention": (olmo2_like, {"attention_norm": "pre_norm.{a}", "feed_forward_norm": "pre_norm.{f}"}),
    "peri_norm": (lambda: olmo2_like(Block.peri_norm),
                  {"attention_norm": "input_norm.{a}", "post_attention_norm": "output_norm.{a}",
                   "feed_forward_norm": "input_norm.{f}", "post_feed_forward_norm": "output_norm.{f}"}),
    "olmo2-reordered": (lambda: olmo2_like(Block.reordered_norm),
                        {"attention_norm": "output_norm.{a}", "feed_forward_norm": "output_norm.{f}"}),
    "default_scaled": (lambda: olmo2_like(Block.default_scaled),
                       {"attention_norm": "pre_norm.{a}", "feed_forward_norm": "pre_norm.{f}"}),
    "olmoe_1B_7B": (lambda: TransformerConfig.olmoe_1B_7B(VOCAB, d_model=32, n_layers=2, n_heads=4,
                                                         block_name=Block.moe),
                    {"attention_norm": "pre_norm.{a}", "feed_forward_norm": "pre_norm.{f}"}),
}


def _exact_norms(config: TransformerConfig) -> TransformerConfig:
    """Every norm computing in the input's dtype (OLMo-core's default casts to float32)."""
    def fix(node):
        if isinstance(node, LayerNormConfig):
            return replace(node, full_precision=False)
        if hasattr(node, "__dataclass_fields__"):
            return replace(node, **{k: fix(v) for k, v in vars(node).items()
                                    if k in node.__dataclass_fields__ and node.__dataclass_fields__[k].init})
        return node
    return fix(config)


def _theirs_to_ours(state: dict, names: dict) -> dict:
    out = {}
    for key, tensor in state.items():
        m = re.fullmatch(r"blocks\.(\d+)\.(\w+_norm)\.weight", key)
        if m:
            b = int(m[1])
            out["scheme." + names[m[2]].format(a=2 * b, f=2 * b + 1) + ".weight"] = tensor
        elif key.endswith(".ln_scale"):        # LayerNorm Scaling's constant: the scheme's own
            continue
        elif key == "lm_head.norm.weight":
            out["scheme.final_norm.weight"] = tensor
        else:
            out[key] = tensor
    return out


def _portable(model) -> None:
    """OLMo-core's MoE permutes tokens with CUDA kernels; on CPU the plain-PyTorch dispatcher
    (tested against them in test_olmo_core_moe.py) stands in, in both models."""
    for block in model.blocks.values():
        moe = getattr(block, "feed_forward_moe", None)
        if moe is not None and type(moe.experts) is not PortableDroplessMLP:
            PortableDroplessMLP.adopt(moe)


@pytest.mark.parametrize("name", CONFIGS)
def test_the_configs_own_scheme_computes_olmo_cores_own_model(name):
    make, norm_names = CONFIGS[name]
    user = _exact_norms(make())
    scheme, options = OWN_SCHEME[user.block.name], OWN_OPTIONS.get(user.block.name)
    torch.manual_seed(0)
    # built on the CPU, not init_weights: in OLMo-core 3.0.0 that leaves default_scaled's ln_scale
    # buffer uninitialised (our lns scheme computes the scale from the block's index)
    theirs = user.build(init_device="cpu").double()
    with torch.no_grad():                 # norms off their ones: a swapped norm would show
        for key, p in theirs.named_parameters():
            if "norm" in key:
                p.add_(0.1 * torch.randn_like(p))
    converted = from_transformer_config(user, scheme=scheme, options=options)
    ours = converted.build(init_device="cpu").double()
    ours.load_state_dict(_theirs_to_ours(theirs.state_dict(), norm_names))
    _portable(theirs)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = theirs.eval()(ids), ours.eval()(ids)
    assert got.dtype == torch.float64
    # default_scaled's 1/sqrt(layer) is a float32 buffer in OLMo-core, a float64 number in ours
    tolerance = 1e-7 if name == "default_scaled" else 1e-10
    assert (got - want).abs().max() <= tolerance * want.abs().max(), name
    # every field but the block, the LM head's norm and the scheme travels unchanged
    assert converted.block.sequence_mixer == user.block.sequence_mixer
    assert (converted.block.feed_forward, converted.block.feed_forward_moe) == \
        (user.block.feed_forward, user.block.feed_forward_moe)
    assert replace(converted.lm_head, layer_norm=user.lm_head.layer_norm) == user.lm_head
    assert (converted.d_model, converted.n_layers, converted.init_std, converted.dtype) == \
        (user.d_model, user.n_layers, user.init_std, user.dtype)
    assert isinstance(ours, SchemeMoETransformer) == (user.block.feed_forward_moe is not None)


def test_the_comparison_sees_a_norm_left_out():
    make, norm_names = CONFIGS["olmo2-attention"]
    user = _exact_norms(make())
    torch.manual_seed(0)
    theirs = user.build(init_device="cpu")
    ours = from_transformer_config(user, scheme="pre").build(init_device="cpu")
    state = _theirs_to_ours(theirs.state_dict(), norm_names)
    with torch.no_grad():
        state["blocks.1.attention.q_norm.weight"] = 1.5 * state["blocks.1.attention.q_norm.weight"]
    ours.load_state_dict(state)
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert (ours.eval()(ids) - theirs.eval()(ids)).abs().max() > 1e-3


def test_olmo2_1b_converts_under_any_scheme_and_maps_to_our_lm_config():
    user = TransformerConfig.olmo2_1B(vocab_size=100_352)
    config = from_transformer_config(user, "siamese", {"form": "hybrid_pre"})
    assert isinstance(config, SchemeTransformerConfig) and (config.norm, config.norm_eps) == ("rmsnorm", 1e-6)
    model = config.build(init_device="meta")
    att = model.blocks["0"].attention
    assert att.v_norm.weight.shape == (128,)           # hybrid_pre's per-head QKV-norm
    pre = from_transformer_config(user, "pre").build(init_device="meta").blocks["0"].attention
    assert pre.q_norm.weight.shape == (2048,) and not pre.use_head_qk_norm   # OLMo2's, kept
    ours = lm_config(from_transformer_config(user, "pre"), max_seq_len=4096)
    assert (ours.qk_norm, ours.qk_norm_per_head, ours.mlp_hidden, ours.rope_theta, ours.norm_eps) == \
        (True, False, 8192, 500_000.0, 1e-6)


def test_a_config_without_a_final_norm_gets_final_norm_false():
    user = olmo2_like()
    user = replace(user, lm_head=replace(user.lm_head, layer_norm=None))
    assert from_transformer_config(user, "pre").scheme_options == {"final_norm": False}
    assert from_transformer_config(user, "pre", {"final_norm": True}).scheme_options == {"final_norm": True}


def _with(config: TransformerConfig, **block) -> TransformerConfig:
    return replace(config, block=replace(config.block, **block))


@pytest.mark.parametrize("make, says", [
    (lambda: TransformerConfig.smallmoe(VOCAB), "config.block.feed_forward_moe.name=default: scheme "
     "blocks run OLMo-core's dropless MoE"),
    (lambda: TransformerConfig.small_hybrid_moe(VOCAB), "config.block.name=moe_hybrid_reordered_norm has "
     "no scheme counterpart: it runs a dense feed-forward beside the MoE"),
    (lambda: TransformerConfig.ngpt_271M(VOCAB), "config.block.name=normalized has no scheme counterpart"),
    (lambda: replace(olmo2_like(), lm_head=replace(olmo2_like().lm_head, layer_norm=LayerNormConfig(
        name=LayerNormType.rms, eps=1e-5, bias=False))),
     "config.lm_head.layer_norm is rmsnorm eps=1e-05, the blocks' rmsnorm eps=1e-06"),
    (lambda: _with(olmo2_like(), layer_norm=LayerNormConfig(name=LayerNormType.default, bias=False)),
     "config.block.layer_norm: a LayerNorm without a bias"),
    (lambda: _with(olmo2_like(), layer_norm=LayerNormConfig(name=LayerNormType.l2_norm)),
     "config.block.layer_norm.name=l2_norm"),
    (lambda: _with(olmo2_like(), attention_residual_alpha=0.5),
     "config.block: SchemeBlockConfig.attention_residual_alpha is not supported"),
    (lambda: replace(olmo2_like(), block_overrides={1: replace(olmo2_like().block, layer_norm=LayerNormConfig(
        name=LayerNormType.rms, eps=1e-5, bias=False))}),
     "config.block_overrides[1].layer_norm is rmsnorm eps=1e-05, config.block's rmsnorm eps=1e-06"),
])
def test_what_a_scheme_block_cannot_carry_is_refused_in_one_line(make, says):
    with pytest.raises(UserError) as error:
        from_transformer_config(make(), "siamese")
    message = str(error.value)
    assert says in message and "\n" not in message, message


def test_a_scheme_config_or_a_bad_scheme_is_refused():
    with pytest.raises(UserError, match="unknown scheme"):
        from_transformer_config(olmo2_like(), "nope")
    with pytest.raises(UserError, match="form='x'"):
        from_transformer_config(olmo2_like(), "siamese", {"form": "x"})
    with pytest.raises(UserError, match="takes an OLMo-core TransformerConfig, got SchemeTransformerConfig"):
        from_transformer_config(from_transformer_config(olmo2_like(), "pre"), "siamese")


def test_the_docs_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_docs_section("olmo-core.md", "Your own TransformerConfig")
