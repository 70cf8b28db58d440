"""Hugging Face ``transformers`` decoder families with any residual scheme: :data:`FAMILIES`."""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass

from ..errors import UserError

__all__ = ["FAMILIES", "FAMILY_NAMES", "Family", "check_family"]


@dataclass(frozen=True)
class Family:
    """What :func:`~siamesenorm.hf.adapt` needs to know of a model family.

    ``masks``: ``"full"``, ``"window"`` (sliding when ``config.sliding_window`` is set) or
    ``"layer_types"``; ``norm``: ``"rmsnorm"``, ``"olmo"`` (LayerNorm without parameters) or ``"gemma"``
    (RMSNorm by ``1 + weight``); ``inputs``, ``outputs``: a layer's norms before and after its attention
    and MLP; ``native``: the scheme and options that compute what the family computes."""

    module: str
    causal_lm: str
    masks: str
    norm: str = "rmsnorm"
    moe: bool = False
    inputs: tuple[str | None, str | None] = ("input_layernorm", "post_attention_layernorm")
    outputs: tuple[str | None, str | None] = (None, None)
    native: tuple[str, tuple[tuple[str, object], ...]] = ("pre", ())
    rope_per_layer_type: bool = False
    config_name: str = ""
    qk_norm: bool = False       # its attention norms queries and keys (its own QK-norm)

    @property
    def config_class(self) -> str:
        return self.config_name or self.causal_lm.removesuffix("ForCausalLM") + "Config"


# OLMo2 and OLMo3 norm each sublayer's output inside the branch and nothing before it: Peri-LN
# without its input norms (OLMo-core's "reordered norm" block); Gemma3 norms both sides: Peri-LN.
_NONE = (None, None)
_REORDERED = ("post_attention_layernorm", "post_feedforward_layernorm")
_OLMO2 = ("peri_ln", (("input_norm", False),))

# The supported families, by model type (``config.model_type``, the value of ``model.family``): the
# one list of them; adapt, adapted_class, family_config and check_family read it here.
FAMILIES: dict[str, Family] = {
    "llama": Family("llama", "LlamaForCausalLM", "full"),
    "mistral": Family("mistral", "MistralForCausalLM", "window"),
    "qwen2": Family("qwen2", "Qwen2ForCausalLM", "layer_types"),
    "qwen3": Family("qwen3", "Qwen3ForCausalLM", "layer_types", qk_norm=True),
    "qwen3_moe": Family("qwen3_moe", "Qwen3MoeForCausalLM", "window", moe=True, qk_norm=True),
    "olmoe": Family("olmoe", "OlmoeForCausalLM", "full", moe=True, qk_norm=True),
    "olmo": Family("olmo", "OlmoForCausalLM", "full", norm="olmo"),
    "olmo2": Family("olmo2", "Olmo2ForCausalLM", "full", inputs=_NONE, outputs=_REORDERED,
                    native=_OLMO2, qk_norm=True),
    "olmo3": Family("olmo3", "Olmo3ForCausalLM", "layer_types", inputs=_NONE, outputs=_REORDERED,
                    native=_OLMO2, rope_per_layer_type=True, qk_norm=True),
    "gemma3_text": Family("gemma3", "Gemma3ForCausalLM", "layer_types", norm="gemma",
                          inputs=("input_layernorm", "pre_feedforward_layernorm"),
                          outputs=_REORDERED, native=("peri_ln", ()), rope_per_layer_type=True,
                          config_name="Gemma3TextConfig", qk_norm=True),
}

FAMILY_NAMES = tuple(FAMILIES)      # what model.family may name


def _refuse_non_finite(value: object, key: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise UserError(f"{key}={value} must be a finite number")
    if isinstance(value, dict):
        for name, item in value.items():
            _refuse_non_finite(item, f"{key}.{name}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _refuse_non_finite(item, f"{key}[{i}]")


def check_family(family: str, options: dict) -> None:
    """Check ``model.family`` and ``model.family_options``: a known family, transformers 5, and fields of
    the family's configuration (one-line errors)."""
    if family not in FAMILIES:
        raise UserError(f"model.family: unknown value {family!r}; choose one of "
                          f"{', '.join(FAMILIES)} (or leave it empty for our own language model)")
    try:
        import transformers
        from transformers import masking_utils  # noqa: F401 - transformers 5
    except ImportError:
        raise UserError(f"model.family={family} needs transformers 5: pip install 'siamesenorm[hf]'") \
            from None
    cls = getattr(transformers, FAMILIES[family].config_class)
    accepted = set(inspect.signature(cls.__init__).parameters) | {"attn_implementation"}
    unknown = sorted(set(options) - accepted - {"self", "kwargs"})
    if unknown:
        raise UserError(f"model.family_options.{unknown[0]}: {cls.__name__} has no field {unknown[0]!r}")
    _refuse_non_finite(options, "model.family_options")
