"""Our language model as a Hugging Face ``transformers`` model, any scheme."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from ..errors import UserError
from ..models.config_checks import MAX_SEQ_LEN
from ..models.lm import LanguageModel
from ..models.lm_config import LMConfig, MoEConfig
from ..models.stack import hidden_at
from .common import BaseConfig, SchemeCheckpointing, cache_keyword, derive_buffers

MODEL_TYPE = "siamesenorm"
_CACHE_FIELD = cache_keyword(CausalLMOutputWithPast)       # the output's cache field
# every field of our own language model's configuration (a Hugging Face family, model.family, is
# exported as that family, not as this model)
_LM_FIELDS = [f.name for f in dataclasses.fields(LMConfig) if f.name not in ("family", "family_options")]

__all__ = ["MODEL_TYPE", "SiameseNormCausalLMOutput", "SiameseNormConfig", "SiameseNormForCausalLM"]


class SiameseNormConfig(BaseConfig):
    """Every :class:`~siamesenorm.models.LMConfig` field (``moe`` as a dict), with Hugging Face's names
    as aliases (``hidden_size`` = ``dim``, ...), checked as :class:`LMConfig` checks them."""

    model_type = MODEL_TYPE
    attribute_map = {"hidden_size": "dim", "num_hidden_layers": "n_layers",
                     "num_attention_heads": "n_heads", "max_position_embeddings": "max_seq_len"}

    def __init__(self, use_cache: bool = True, **kwargs: Any) -> None:
        for alias, name in self.attribute_map.items():     # Hugging Face's names, as ours
            if alias in kwargs:
                kwargs.setdefault(name, kwargs.pop(alias))
        values = {name: kwargs.pop(name, _default(name)) for name in _LM_FIELDS}
        if isinstance(values["moe"], MoEConfig):
            values["moe"] = dataclasses.asdict(values["moe"])
        values["moe"] = dict(values["moe"] or {})
        values["scheme_options"] = dict(values["scheme_options"] or {})
        _lm_config(values)                           # refuse what LMConfig refuses, now
        if isinstance(values["max_seq_len"], int) and values["max_seq_len"] > MAX_SEQ_LEN:
            raise UserError(f"max_seq_len={values['max_seq_len']:,} is beyond what this library "
                            f"builds (at most {MAX_SEQ_LEN:,} positions: the RoPE tables are built to it)")
        for name, value in values.items():
            setattr(self, name, value)
        self.use_cache = use_cache
        kwargs.setdefault("tie_word_embeddings", values["tie_embeddings"])
        super().__init__(**kwargs)

    @property
    def num_key_value_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def head_dim(self) -> int:
        return self.head_size or self.dim // self.n_heads

    @classmethod
    def from_lm_config(cls, config: LMConfig, **kwargs: Any) -> SiameseNormConfig:
        values = {name: getattr(config, name) for name in _LM_FIELDS}
        values["moe"] = dataclasses.asdict(config.moe)
        return cls(**values, **kwargs)

    def to_lm_config(self) -> LMConfig:
        return _lm_config({name: getattr(self, name) for name in _LM_FIELDS})


def _default(name: str) -> Any:
    f = LMConfig.__dataclass_fields__[name]
    value = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return dataclasses.asdict(value) if isinstance(value, MoEConfig) else value


def _lm_config(values: dict) -> LMConfig:
    values = dict(values)
    values["moe"] = MoEConfig(**(values.get("moe") or {}))
    values["scheme_options"] = dict(values.get("scheme_options") or {})
    return LMConfig(**values)


@dataclasses.dataclass
class SiameseNormCausalLMOutput(CausalLMOutputWithPast):
    """``CausalLMOutputWithPast`` plus ``streams``: per block boundary, the scheme's residual streams by
    name (with ``output_hidden_states``)."""

    streams: tuple[dict[str, Tensor], ...] | None = None


class _CacheLayers:
    """Our attention's cache protocol over one of ``transformers``' cache classes."""

    def __init__(self, cache: Any) -> None:
        self.cache, self.length = cache, 0

    def update(self, layer: int, k: Tensor, v: Tensor, pos: int) -> tuple[Tensor, Tensor]:
        return self.cache.update(k, v, layer)


class SiameseNormPreTrainedModel(PreTrainedModel):
    config_class = SiameseNormConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _supports_cache_class = True
    _no_split_modules: list[str] = []

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """Our initialisation (``LMConfig.init``) for a whole model; for a loaded one, the buffers no state
        dict holds."""
        if isinstance(module, LanguageModel):
            module.reset_parameters()
        else:
            derive_buffers(module)


class SiameseNormForCausalLM(SchemeCheckpointing, SiameseNormPreTrainedModel, GenerationMixin):
    """Our :class:`~siamesenorm.models.LanguageModel` (as ``model``) with Hugging Face's interface:
    ``labels`` (shifted inside), left padding, transformers' caches, ``generate``. Hidden states: one
    per block boundary, a multi-stream scheme's exit applied there."""

    def __init__(self, config: SiameseNormConfig) -> None:
        super().__init__(config)
        self.model = LanguageModel(config.to_lm_config())
        self.gradient_checkpointing = False
        self.post_init()

    # ---- embeddings --------------------------------------------------------------------------
    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embed = value

    def get_output_embeddings(self) -> nn.Linear | None:
        return self.model.lm_head        # None when tied: the head is the embedding itself

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.model.lm_head = value

    def resize_token_embeddings(self, *args: Any, **kwargs: Any) -> nn.Embedding:
        """``PreTrainedModel.resize_token_embeddings``; our model's configuration follows."""
        out = super().resize_token_embeddings(*args, **kwargs)
        vocab = self.model.embed.num_embeddings
        self.config.vocab_size = vocab
        self.model.config = dataclasses.replace(self.model.config, vocab_size=vocab)
        return out

    # ---- activation checkpointing (SchemeCheckpointing: every scheme step) --------------------
    @property
    def scheme(self):
        return self.model.scheme

    # ---- forward -----------------------------------------------------------------------------
    def forward(self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None, past_key_values: Any = None,
                inputs_embeds: Tensor | None = None, labels: Tensor | None = None,
                use_cache: bool | None = None, output_hidden_states: bool | None = None,
                return_dict: bool | None = None, logits_to_keep: int | Tensor = 0,
                cache: Any = None, **kwargs: Any) -> SiameseNormCausalLMOutput | tuple:
        """Logits (and the loss of ``labels``) for ``input_ids``; ``cache`` is ``past_key_values`` under
        transformers 5's name."""
        if cache is not None:
            if past_key_values is not None and past_key_values is not cache:
                raise ValueError("give cache or past_key_values, not both")
            past_key_values = cache
        if attention_mask is not None and attention_mask.dim() != 2:
            raise ValueError("SiameseNormForCausalLM takes a 2-D attention_mask (batch, tokens: 1 "
                             f"for a token, 0 for padding), got shape {tuple(attention_mask.shape)}")
        if inputs_embeds is not None:
            raise ValueError("SiameseNormForCausalLM takes input_ids, not inputs_embeds")
        if input_ids is None:
            raise ValueError("input_ids is required")
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if self.training and self.gradient_checkpointing:
            use_cache = False
        if output_hidden_states is None:
            output_hidden_states = getattr(self.config, "output_hidden_states", False)
        hidden = bool(output_hidden_states)
        if return_dict is None:
            return_dict = getattr(self.config, "return_dict", True)
        if use_cache and past_key_values is None:
            from transformers import DynamicCache
            past_key_values = DynamicCache()
        pos = past_key_values.get_seq_length() if past_key_values is not None else 0
        t = input_ids.shape[1]
        if attention_mask is not None and attention_mask.shape[1] != pos + t:
            raise ValueError(f"attention_mask covers {attention_mask.shape[1]} positions; the "
                             f"cache holds {pos} and input_ids adds {t}")
        padded = attention_mask is not None and not bool(attention_mask.all())
        if not padded:
            attention_mask = None
            if position_ids is not None and not torch.equal(
                    position_ids, torch.arange(pos, pos + t, device=position_ids.device)
                    .expand_as(position_ids)):
                padded = True            # positions of the caller's own choosing
        layers = _CacheLayers(past_key_values) if past_key_values is not None else None
        targets = None
        if labels is not None:
            targets = F.pad(labels[:, 1:], (0, 1), value=-100).to(input_ids.device)
        states: list | None = [] if hidden else None
        out = self.model(input_ids, targets, cache=layers, pos=pos, attention_mask=attention_mask,
                         positions=position_ids if padded else None, states=states)
        logits = out.logits
        if isinstance(logits_to_keep, int) and logits_to_keep > 0:
            logits = logits[:, -logits_to_keep:]
        elif isinstance(logits_to_keep, Tensor):
            logits = logits[:, logits_to_keep]
        hidden_states = streams = None
        if states is not None:
            scheme = self.model.scheme
            streams = tuple(scheme.streams(s) for s in states)
            hidden_states = tuple(hidden_at(scheme, s) for s in states[:-1]) + (
                _head_input(self.model, states[-1]),)
        if not return_dict:
            return tuple(v for v in (out.loss, logits, past_key_values, hidden_states)
                         if v is not None)
        return SiameseNormCausalLMOutput(loss=out.loss, logits=logits,
                                         hidden_states=hidden_states, streams=streams,
                                         **{_CACHE_FIELD: past_key_values})


def _head_input(model: LanguageModel, state: Any) -> Tensor:
    return model.scheme.exit(state)
