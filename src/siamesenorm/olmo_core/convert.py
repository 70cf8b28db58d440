"""Between our ``LanguageModel`` and the OLMo-core :class:`~.model.SchemeTransformer`: the
configuration and the parameters, both ways, so that a run can move from one to the other.

Parameter names (``b`` a block, ``*`` ``weight`` or ``bias``)::

    ours (LanguageModel)                 OLMo-core (SchemeTransformer)
    embed.weight                         embeddings.weight
    sublayers.{2b}.q_proj.*              blocks.{b}.attention.w_q.*      (k_proj: w_k, v_proj: w_v,
    sublayers.{2b}.out_proj.*            blocks.{b}.attention.w_out.*     out_proj: w_out)
    sublayers.{2b}.q_norm.*              blocks.{b}.attention.q_norm.*   (k_norm, v_norm alike)
    sublayers.{2b+1}.gate_proj.*         blocks.{b}.feed_forward.w1.*    (SwiGLU: w2(silu(w1 x) * w3 x))
    sublayers.{2b+1}.up_proj.*           blocks.{b}.feed_forward.w3.*
    sublayers.{2b+1}.down_proj.*         blocks.{b}.feed_forward.w2.*
    scheme.<anything>                    scheme.<anything>               (the same scheme object)
    lm_head.weight                       lm_head.w_out.weight            (untied)
    (tied: none)                         lm_head.w_out.weight = embeddings.weight

Tied embeddings: OLMo-core ties by making ``lm_head.w_out.weight`` the embedding's parameter, so
its state dict lists it twice; ours has ``embed.weight`` alone. The maps pass tensors through
(no copy); an unknown name raises ``KeyError``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch
from olmo_core.config import DType
from olmo_core.nn.attention import AttentionConfig
from olmo_core.nn.feed_forward import ActivationFunction, FeedForwardConfig
from olmo_core.nn.lm_head import LMHeadConfig
from olmo_core.nn.rope import RoPEConfig, RoPEType
from torch import Tensor

from ..errors import ConfigError
from ..models.lm import LanguageModel
from ..models.lm_config import LMConfig
from ..nn.mlp import default_mlp_hidden
from .model import SchemeBlockConfig, SchemeTransformer, SchemeTransformerConfig, head_norm_config

__all__ = ["from_language_model", "from_siamesenorm_state_dict", "lm_config", "olmo_config",
           "to_language_model", "to_siamesenorm_state_dict"]

_ATTN = {"q_proj": "w_q", "k_proj": "w_k", "v_proj": "w_v", "out_proj": "w_out",
         "q_norm": "q_norm", "k_norm": "k_norm", "v_norm": "v_norm"}
_MLP = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_ATTN_BACK = {v: k for k, v in _ATTN.items()}
_MLP_BACK = {v: k for k, v in _MLP.items()}
_OURS = re.compile(r"sublayers\.(\d+)\.(\w+)\.(weight|bias)")
_THEIRS = re.compile(r"blocks\.(\d+)\.(attention|feed_forward)\.(\w+)\.(weight|bias)")


# ---- configuration ---------------------------------------------------------------------------
def olmo_config(cfg: LMConfig, *, dtype: DType | str = DType.float32, **kwargs: Any
                ) -> SchemeTransformerConfig:
    """The :class:`~.model.SchemeTransformerConfig` of the model that ``cfg`` describes: same
    width, depth, heads and kv heads, SwiGLU hidden size, RoPE theta, per-head QK-norm, biases,
    vocabulary, tied or untied embeddings, scheme (with its options, ``norm`` and ``norm_eps``).
    ``kwargs`` go to the config (``init_method``, ``init_std``, ``init_seed``, ...).

    Refused: GELU MLPs (OLMo-core's feed-forward is gated), dropout (OLMo-core drops other
    things than we do), mixture-of-experts blocks (not implemented yet), a Hugging Face
    ``family``. ``cfg.init`` and
    ``cfg.max_seq_len`` have no counterpart: OLMo-core initialises by its ``init_method``, and
    takes the sequence length from its train module.
    """
    if cfg.mlp != "swiglu":
        raise ConfigError(f"OLMo-core's feed-forward is gated: model.mlp must be swiglu, got {cfg.mlp!r}")
    if cfg.dropout:
        raise ConfigError("model.dropout must be 0 for the OLMo-core model (its dropout differs)")
    if cfg.moe.every:
        raise NotImplementedError("mixture-of-experts models are not mapped to OLMo-core yet")
    if getattr(cfg, "family", ""):
        raise ConfigError(f"model.family={cfg.family} builds a Hugging Face family model, not our "
                          "LanguageModel: it has no OLMo-core counterpart here")
    dtype = DType(dtype)
    theta = int(cfg.rope_theta) if float(cfg.rope_theta).is_integer() else cfg.rope_theta
    head_norm = head_norm_config(cfg.norm, cfg.norm_eps)
    attention = AttentionConfig(
        n_heads=cfg.n_heads, n_kv_heads=cfg.n_kv_heads, bias=cfg.bias,
        rope=RoPEConfig(name=RoPEType.default, theta=theta),
        qk_norm=head_norm if cfg.qk_norm else None, use_head_qk_norm=True if cfg.qk_norm else None,
        dtype=dtype)
    block = SchemeBlockConfig(
        sequence_mixer=attention,
        feed_forward=FeedForwardConfig(hidden_size=cfg.hidden_dim, bias=cfg.bias, dtype=dtype,
                                       activation=ActivationFunction.silu))
    return SchemeTransformerConfig(
        d_model=cfg.dim, vocab_size=cfg.vocab_size, n_layers=cfg.n_layers, block=block,
        lm_head=LMHeadConfig(layer_norm=None, bias=False, dtype=dtype), dtype=dtype,
        tie_word_embeddings=cfg.tie_embeddings, scheme=cfg.scheme,
        scheme_options=dict(cfg.scheme_options), norm=cfg.norm, norm_eps=cfg.norm_eps, **kwargs)


def lm_config(config: SchemeTransformerConfig, *, max_seq_len: int = 2048, **kwargs: Any) -> LMConfig:
    """Our ``LMConfig`` of the model ``config`` describes (the inverse of :func:`olmo_config`);
    ``max_seq_len`` and ``kwargs`` (``init``, ...) are ours alone. A feed-forward of the default
    SwiGLU size gives ``mlp_hidden=None``; kv heads left unset stay unset."""
    block = config.block
    if not isinstance(block, SchemeBlockConfig) or config.block_overrides or config.block_pattern:
        raise ConfigError("lm_config maps one SchemeBlockConfig for every block")
    att, ff = block.sequence_mixer, block.feed_forward
    if not isinstance(att, AttentionConfig) or ff is None:
        raise ConfigError("lm_config needs an attention and a feed-forward")
    head_dim = config.d_model // att.n_heads
    problems = [
        what for what, bad in (
            ("head_dim other than d_model // n_heads", att.head_dim not in (None, head_dim)),
            ("attention options we do not have (gate, clip_qkv, sliding window, sinks, softmax "
             "scaling)", att.gate is not None or att.clip_qkv is not None
             or att.sliding_window is not None or att.attention_sinks or att.scalable_softmax),
            ("no RoPE or a scaled RoPE", att.rope is None or att.rope.scaling is not None
             or att.rope.partial_rotary_factor != 1.0),
            ("QK-norm over the whole width (ours is per head)",
             att.qk_norm is not None and not att.use_head_qk_norm),
            ("a QK-norm kind other than the scheme's norm", att.qk_norm is not None
             and att.qk_norm != head_norm_config(config.norm, config.norm_eps)),
            ("a feed-forward other than SwiGLU", ff.activation != ActivationFunction.silu),
            ("biases on some linears and not others", bool(att.bias) != bool(ff.bias)),
            ("an LM head with a bias or a norm", bool(config.lm_head.bias)
             or config.lm_head.layer_norm is not None),
            ("an embedding norm or scale", config.embedding_norm is not None
             or config.embed_scale is not None),
            ("dropout", bool(block.dropout) or bool(att.dropout)))
        if bad]
    if problems:
        raise ConfigError("the OLMo-core config has no LMConfig counterpart: " + "; ".join(problems))
    return LMConfig(
        vocab_size=config.vocab_size, dim=config.d_model, n_layers=config.n_layers,
        n_heads=att.n_heads, n_kv_heads=att.n_kv_heads, mlp="swiglu",
        mlp_hidden=None if ff.hidden_size == default_mlp_hidden("swiglu", config.d_model)
        else ff.hidden_size,
        max_seq_len=max_seq_len, rope_theta=float(att.rope.theta), qk_norm=att.qk_norm is not None,
        tie_embeddings=config.tie_word_embeddings, bias=bool(att.bias), norm=config.norm,
        norm_eps=config.norm_eps, scheme=config.scheme,
        scheme_options=dict(config.scheme_options), **kwargs)


# ---- parameters ------------------------------------------------------------------------------
def _tied(state: Mapping[str, Tensor]) -> bool:
    head, embed = state.get("lm_head.w_out.weight"), state["embeddings.weight"]
    if head is None or head is embed:
        return True
    if head.is_meta or embed.is_meta:
        return False
    if head.device == embed.device and head.data_ptr() == embed.data_ptr() and head.shape == embed.shape:
        return True
    return head.shape == embed.shape and torch.equal(head, embed)


def to_siamesenorm_state_dict(olmo_state: Mapping[str, Tensor], *,
                              tie_embeddings: bool | None = None) -> dict[str, Tensor]:
    """A :class:`~.model.SchemeTransformer` state dict as our ``LanguageModel``'s.

    ``tie_embeddings=None`` reads tying off the state: tied when ``lm_head.w_out.weight`` is
    absent, is the embedding's tensor, or equals it.
    """
    if "embeddings.weight" not in olmo_state:
        raise KeyError("embeddings.weight: not an OLMo-core Transformer state dict")
    tied = _tied(olmo_state) if tie_embeddings is None else tie_embeddings
    out: dict[str, Tensor] = {}
    for name, tensor in olmo_state.items():
        if name == "embeddings.weight":
            out["embed.weight"] = tensor
        elif name == "lm_head.w_out.weight":
            if not tied:
                out["lm_head.weight"] = tensor
        elif name.startswith("scheme."):
            out[name] = tensor
        elif m := _THEIRS.fullmatch(name):
            block, kind, module, param = int(m[1]), m[2], m[3], m[4]
            table = _ATTN_BACK if kind == "attention" else _MLP_BACK
            if module not in table:
                raise KeyError(f"{name}: no counterpart in our LanguageModel")
            sub = 2 * block + (kind == "feed_forward")
            out[f"sublayers.{sub}.{table[module]}.{param}"] = tensor
        else:
            raise KeyError(f"{name}: no counterpart in our LanguageModel")
    return out


def from_siamesenorm_state_dict(state: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Our ``LanguageModel``'s state dict as a :class:`~.model.SchemeTransformer`'s (tied when it
    has no ``lm_head.weight``: then ``lm_head.w_out.weight`` is the embedding's tensor, as in
    OLMo-core's own state dict)."""
    out: dict[str, Tensor] = {}
    for name, tensor in state.items():
        if name == "embed.weight":
            out["embeddings.weight"] = tensor
        elif name == "lm_head.weight":
            out["lm_head.w_out.weight"] = tensor
        elif name.startswith("scheme."):
            out[name] = tensor
        elif m := _OURS.fullmatch(name):
            sub, module, param = int(m[1]), m[2], m[3]
            kind, table = ("attention", _ATTN) if sub % 2 == 0 else ("feed_forward", _MLP)
            if module not in table:
                raise KeyError(f"{name}: no counterpart in the OLMo-core model (MoE is not mapped yet)")
            out[f"blocks.{sub // 2}.{kind}.{table[module]}.{param}"] = tensor
        else:
            raise KeyError(f"{name}: no counterpart in the OLMo-core model")
    if "embeddings.weight" in out and "lm_head.w_out.weight" not in out:
        out["lm_head.w_out.weight"] = out["embeddings.weight"]
    return out


# ---- whole models ----------------------------------------------------------------------------
def to_language_model(model: SchemeTransformer, config: SchemeTransformerConfig, *,
                      max_seq_len: int = 2048, **kwargs: Any) -> LanguageModel:
    """Our ``LanguageModel`` with the weights of ``model`` (built from ``config``; on its device,
    in its dtype). ``max_seq_len`` and ``kwargs`` go to :func:`lm_config`."""
    lm = LanguageModel(lm_config(config, max_seq_len=max_seq_len, **kwargs),
                       device=model.embeddings.weight.device, dtype=model.embeddings.weight.dtype)
    lm.load_state_dict(to_siamesenorm_state_dict(model.state_dict(),
                                                 tie_embeddings=config.tie_word_embeddings))
    return lm


def from_language_model(lm: LanguageModel, **kwargs: Any) -> tuple[SchemeTransformer,
                                                                    SchemeTransformerConfig]:
    """The OLMo-core model with the weights of our ``lm``, and its config; ``kwargs`` go to
    :func:`olmo_config`. Note: a ``TransformerTrainModule`` re-initialises the weights of the model
    it is given (``init_weights``); load these weights after building it
    (``train_module.model.load_state_dict(model.state_dict())`` or a checkpoint)."""
    weight = lm.embed.weight
    config = olmo_config(lm.config, dtype=_olmo_dtype(weight.dtype), **kwargs)
    model = config.build(init_device=str(weight.device))
    model.load_state_dict(from_siamesenorm_state_dict(lm.state_dict()))
    return model, config


def _olmo_dtype(dtype: torch.dtype) -> DType:
    for d in DType:
        if d.as_pt() == dtype:
            return d
    raise ConfigError(f"OLMo-core has no dtype {dtype}")
