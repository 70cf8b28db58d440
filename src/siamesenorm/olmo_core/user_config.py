"""A user's own OLMo-core ``TransformerConfig`` as a residual scheme model's config.

The scheme replaces the block's norm placement (``default`` is Pre-Norm, ``peri_norm`` Peri-LN,
``default_scaled`` LayerNorm Scaling, ``reordered_norm`` OLMo2's norm after each sublayer); every
other field travels unchanged: attention (heads, head_dim, QK-norm, RoPE, ...), feed-forward, MoE,
embedding, LM head, dtype, init. The norm kind and eps of the scheme are the block's
``layer_norm``. What a scheme block cannot carry is refused in one line naming the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any

from olmo_core.nn.layer_norm import LayerNormConfig, LayerNormType
from olmo_core.nn.moe import MoEType
from olmo_core.nn.transformer import TransformerBlockConfig, TransformerConfig
from olmo_core.nn.transformer.config import TransformerBlockType

from ..errors import UserError
from ..schemes import get_scheme_class
from .model import SchemeBlockConfig, SchemeTransformerConfig

__all__ = ["OWN_OPTIONS", "OWN_SCHEME", "from_transformer_config"]

# The scheme (with OWN_OPTIONS) that is a block type's own placement: scheme="pre" on a Llama config
# computes what OLMo-core's own model computes. OLMo2's reordered_norm, h + LN(F(h)) with no input
# norm, is Peri-LN without its input norms.
OWN_SCHEME = {TransformerBlockType.default: "pre", TransformerBlockType.moe: "pre",
              TransformerBlockType.peri_norm: "peri_ln", TransformerBlockType.default_scaled: "lns",
              TransformerBlockType.reordered_norm: "peri_ln",
              TransformerBlockType.moe_reordered_norm: "peri_ln"}
OWN_OPTIONS = {TransformerBlockType.reordered_norm: {"input_norm": False},
               TransformerBlockType.moe_reordered_norm: {"input_norm": False}}
# Block types whose norms alone the scheme replaces.
_PLACEMENTS = set(OWN_SCHEME)
_WHY_NOT = {
    TransformerBlockType.normalized: "nGPT's blocks keep the hidden states on the unit sphere with "
                                     "learned step sizes, not a norm placement",
    TransformerBlockType.moe_hybrid: "it runs a dense feed-forward beside the MoE; a scheme block has "
                                     "one feed-forward sublayer",
    TransformerBlockType.moe_hybrid_reordered_norm: "it runs a dense feed-forward beside the MoE; a "
                                                    "scheme block has one feed-forward sublayer",
    TransformerBlockType.moe_fused_v2: "its fused MoE block is not OLMo-core's MoE module",
}
_RMS = (LayerNormType.rms, LayerNormType.fused_rms)


def _norm_kind(norm: LayerNormConfig | None, where: str) -> tuple[str, float]:
    """Our norm kind and eps of OLMo-core's ``norm`` (``where`` names the field)."""
    if norm is None:
        raise UserError(f"{where} is None: the scheme takes its norm kind and eps from it; set a "
                        "LayerNormConfig")
    eps = 1e-5 if norm.eps is None else float(norm.eps)
    if norm.elementwise_affine is False:
        raise UserError(f"{where}.elementwise_affine=False: the scheme's norms have a weight")
    if norm.name in _RMS:
        if norm.bias:
            raise UserError(f"{where}: an RMSNorm with a bias; ours has a weight only")
        return "rmsnorm", eps
    if norm.name == LayerNormType.default:
        if norm.bias is False:
            raise UserError(f"{where}: a LayerNorm without a bias; ours has a weight and a bias")
        return "layernorm", eps
    raise UserError(f"{where}.name={norm.name!s}: the scheme's norms are rms, fused_rms (RMSNorm) or "
                    "default (LayerNorm)")


# Model options that an OLMo-core config settles, and why they are not options of its scheme.
_MODEL_OPTIONS = {
    "norm": "the config's block.layer_norm sets the kind (OLMo-core has LayerNorm and RMSNorm; no DyT "
            "or Derf)",
    "eps": "the config's block.layer_norm sets it",
    "depth_attention": "OLMo-core's attention reads no earlier layer's keys",
    "depth_attention_stride": "OLMo-core's attention reads no earlier layer's keys",
    "value_residual": "OLMo-core's attention takes no first layer's values",
}


def _placement(name: Any) -> tuple[str, dict]:
    return OWN_SCHEME.get(name, ""), OWN_OPTIONS.get(name, {})


def _block(block: Any, where: str) -> tuple[SchemeBlockConfig, tuple[str, float]]:
    if isinstance(block, SchemeBlockConfig):
        raise UserError(f"{where} is already a SchemeBlockConfig; give the user's TransformerConfig")
    if not isinstance(block, TransformerBlockConfig):
        raise UserError(f"{where} must be a TransformerBlockConfig, got {type(block).__name__}")
    if block.name not in _PLACEMENTS:
        why = _WHY_NOT.get(block.name, "no scheme block stands for it")
        raise UserError(f"{where}.name={block.name!s} has no scheme counterpart: {why}")
    if block.feed_forward_moe is not None and block.feed_forward_moe.name != MoEType.dropless:
        raise UserError(f"{where}.feed_forward_moe.name={block.feed_forward_moe.name!s}: scheme blocks run "
                        "OLMo-core's dropless MoE (MoEType.dropless); the capacity-factor one drops tokens")
    kind = _norm_kind(block.layer_norm, f"{where}.layer_norm")
    try:
        converted = SchemeBlockConfig(sequence_mixer=block.sequence_mixer, feed_forward=block.feed_forward,
                                      feed_forward_moe=block.feed_forward_moe, dropout=block.dropout,
                                      attention_residual_alpha=block.attention_residual_alpha,
                                      feed_forward_residual_alpha=block.feed_forward_residual_alpha)
    except UserError as error:
        raise UserError(f"{where}: {error}") from None
    return converted, kind


def from_transformer_config(config: TransformerConfig, scheme: str,
                            options: Mapping[str, Any] | None = None) -> SchemeTransformerConfig:
    """The :class:`~.model.SchemeTransformerConfig` of ``config`` (any dense or MoE OLMo-core
    ``TransformerConfig``) under ``scheme`` with its ``options``; see the module docstring.

    The LM head's norm becomes the scheme's final norm: its kind and eps must be the blocks'; an LM
    head without a norm sets the option ``final_norm=False`` unless ``options`` names it.
    ``OWN_SCHEME[block.name]`` with ``OWN_OPTIONS.get(block.name)`` is the scheme that computes what
    OLMo-core's own model computes."""
    if isinstance(config, SchemeTransformerConfig) or not isinstance(config, TransformerConfig):
        raise UserError(f"from_transformer_config takes an OLMo-core TransformerConfig, got "
                        f"{type(config).__name__}")
    get_scheme_class(scheme)
    for key in sorted(set(options or {}) & set(_MODEL_OPTIONS)):
        raise UserError(f"options: {key}={options[key]!r} is not a scheme option here: {_MODEL_OPTIONS[key]}")
    if isinstance(config.block, dict) or config.block_pattern is not None:
        raise UserError("config.block_pattern: named block patterns have no scheme counterpart yet; "
                        "give one block and block_overrides")
    block, kind = _block(config.block, "config.block")
    overrides = {}
    for i, other in sorted((config.block_overrides or {}).items()):
        overrides[i], other_kind = _block(other, f"config.block_overrides[{i}]")
        if _placement(other.name) != _placement(config.block.name):
            raise UserError(f"config.block_overrides[{i}].name={other.name!s} places its norms unlike "
                            f"config.block.name={config.block.name!s}: a scheme places every block's norms "
                            "one way")
        if other_kind != kind:
            raise UserError(f"config.block_overrides[{i}].layer_norm is {other_kind[0]} eps={other_kind[1]}, "
                            f"config.block's {kind[0]} eps={kind[1]}: a scheme has one norm kind")
    options = dict(options or {})
    head_norm = config.lm_head.layer_norm
    if head_norm is None:
        options.setdefault("final_norm", False)
    elif (head_kind := _norm_kind(head_norm, "config.lm_head.layer_norm")) != kind:
        raise UserError(f"config.lm_head.layer_norm is {head_kind[0]} eps={head_kind[1]}, the blocks' "
                        f"{kind[0]} eps={kind[1]}: the scheme's final norm is of the blocks' kind")
    kept = {f.name: getattr(config, f.name) for f in fields(TransformerConfig) if f.init}
    kept.update(block=block, block_overrides=overrides or None,
                lm_head=replace(config.lm_head, layer_norm=None))
    out = SchemeTransformerConfig(**kept, scheme=scheme, scheme_options=options, norm=kind[0],
                                  norm_eps=kind[1])
    out.resolved_block_configs  # noqa: B018 - builds the scheme on meta: its options checked now
    return out
