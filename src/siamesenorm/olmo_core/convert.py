"""Between our ``LanguageModel`` and the OLMo-core :class:`~.model.SchemeTransformer`, both ways:
the configuration, field by field as LMConfig declares it, and the parameters, block by block
(``sublayers.{2b}.q_proj`` <-> ``blocks.{b}.attention.w_q``, ...; the tables: docs/olmo-core.md).
OLMo-core's tied head is the embedding's parameter, listed twice in its state dict. Tensors pass
through uncopied (but the experts' gate and up matrices); an unknown name raises ``KeyError``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import fields, replace
from functools import partial
from types import SimpleNamespace
from typing import Any

import torch
from olmo_core.config import DType
from olmo_core.nn.attention import AttentionConfig
from olmo_core.nn.feed_forward import ActivationFunction, FeedForwardConfig
from olmo_core.nn.lm_head import LMHeadConfig
from olmo_core.nn.moe import MoEConfig, MoELoadBalancingLossGranularity, MoERouterConfig, MoEType
from olmo_core.nn.moe.router import MoERouterGatingFunction, MoERouterType
from olmo_core.nn.rope import RoPEConfig, RoPEType
from olmo_core.nn.transformer.config import resolve_block_configs
from torch import Tensor

from ..errors import UserError
from ..models.lm import LanguageModel
from ..models.lm_config import LMConfig, carried, value_on
from ..models.lm_config import MoEConfig as OurMoEConfig
from .model import SchemeBlockConfig, SchemeTransformer, SchemeTransformerConfig, head_norm_config

__all__ = ["from_language_model", "from_siamesenorm_state_dict", "lm_config", "olmo_config",
           "olmo_moe_config", "to_language_model", "to_siamesenorm_state_dict"]

_ATTN = {"q_proj": "w_q", "k_proj": "w_k", "v_proj": "w_v", "out_proj": "w_out",
         "q_norm": "q_norm", "k_norm": "k_norm", "v_norm": "v_norm"}
_MLP = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_ATTN_BACK = {v: k for k, v in _ATTN.items()}
_MLP_BACK = {v: k for k, v in _MLP.items()}
_OURS = re.compile(r"sublayers\.(\d+)\.(\w+)\.(weight|bias)")
_THEIRS = re.compile(r"blocks\.(\d+)\.(attention|feed_forward)\.(\w+)\.(weight|bias)")
_MOE = {"router.weight": "router.weight", "w_gate": "experts.mlp.w1", "w_up": "experts.mlp.w3",
        "w_down": "experts.mlp.w2"}
_MOE_BACK = {v: k for k, v in _MOE.items()}
_OURS_MOE = re.compile(r"sublayers\.(\d+)\.(router\.weight|w_gate|w_up|w_down)")
_THEIRS_MOE = re.compile(r"blocks\.(\d+)\.feed_forward_moe\.(router\.weight|experts\.mlp\.w[123])")


# ---- configuration ---------------------------------------------------------------------------
# How a part of the config that LMConfig's declarations fill (To.where: "attention.rope.theta", ...)
# is made from its values, with the constants our model fixes (a dropless MoE, a SiLU-gated MLP).
def _makers(dtype: DType) -> dict[str, Callable[..., Any]]:
    return {"attention": partial(AttentionConfig, dtype=dtype),
            "attention.rope": partial(RoPEConfig, name=RoPEType.default),
            "attention.qk_norm": head_norm_config,
            "feed_forward": partial(FeedForwardConfig, dtype=dtype),
            "feed_forward.activation": ActivationFunction,
            "moe": partial(MoEConfig, name=MoEType.dropless, scale_loss_by_num_layers=False, dtype=dtype),
            "moe.router": MoERouterConfig}


class _Node(dict):
    """A part of the config being filled (not a value that is a dict, as ``scheme_options``)."""


def _assembled(values: dict[str, Any], dtype: DType) -> dict[str, Any]:
    """``{"d_model": 64, "attention.n_heads": 4, ...}`` as OLMo-core's config parts."""
    tree = _Node()
    for path, value in values.items():
        *parents, leaf = path.split(".")
        node = tree
        for part in parents:
            node = node.setdefault(part, _Node())
        node[leaf] = value
    makers = _makers(dtype)

    def made(node: _Node, prefix: str) -> dict[str, Any]:
        out = {}
        for key, value in node.items():
            path, make = f"{prefix}{key}", makers.get(f"{prefix}{key}")
            if isinstance(value, _Node):
                value = make(**made(value, path + "."))
            elif make is not None and value is not None:
                value = make(**value) if isinstance(value, dict) else make(value)
            out[key] = value
        return out

    return made(tree, "")


def _olmo_values(cfg: LMConfig, moe: bool) -> dict[str, Any]:
    return {path: value_on(cfg, name, to) for name, to in carried("olmo_core")
            if moe or not name.startswith("moe.") for path in to.paths}


def olmo_config(cfg: LMConfig, *, dtype: DType | str = DType.float32, **kwargs: Any
                ) -> SchemeTransformerConfig:
    """The :class:`~.model.SchemeTransformerConfig` of the model ``cfg`` describes, field by field
    as LMConfig declares (``kwargs``: ``init_method``, ``init_std``, ...). MoE blocks
    (``cfg.moe.every``) get OLMo-core's dropless MoE, the others (``every`` > 1) stay dense
    (``block_overrides``). What OLMo-core cannot carry is refused in one line."""
    cfg.check_host("olmo_core")
    dtype = DType(dtype)
    parts = _assembled(_olmo_values(cfg, bool(cfg.moe.every)), dtype)
    block = SchemeBlockConfig(sequence_mixer=parts.pop("attention"), feed_forward=parts.pop("feed_forward"))
    overrides = None
    if cfg.moe.every:
        moe_block = replace(block, feed_forward=None, feed_forward_moe=parts.pop("moe"))
        if cfg.moe.every == 1:
            block = moe_block
        else:
            overrides = {b: moe_block for b in range(cfg.n_layers) if cfg.moe.is_moe(b)}
    return SchemeTransformerConfig(
        **parts, block=block, block_overrides=overrides,
        lm_head=LMHeadConfig(layer_norm=None, bias=False, dtype=dtype), dtype=dtype, **kwargs)


def olmo_moe_config(cfg: LMConfig, dtype: DType | str = DType.float32) -> MoEConfig:
    """OLMo-core's ``MoEConfig`` of ``cfg.moe`` (dropless, the losses weighted as ours, per MoE
    layer, over each rank's micro-batch); a shared expert is refused (OLMo-core averages it)."""
    cfg.check_host("olmo_core")
    return _assembled(_olmo_values(cfg, True), DType(dtype))["moe"]


def _our_moe(moe: MoEConfig, every: int, config: SchemeTransformerConfig) -> OurMoEConfig:
    """Our ``MoEConfig`` of OLMo-core's ``moe`` on every ``every``-th block, or a ``UserError``
    naming what has no counterpart."""
    router = moe.router
    problems = [what for what, bad in (
        ("a capacity-factor MoE (ours is dropless)", moe.name != MoEType.dropless),
        ("a shared expert (OLMo-core averages it, ours adds it)", moe.shared_mlp is not None),
        ("a latent MoE", moe.latent_moe is not None),
        ("a router other than the linear softmax top-k one (jitter, bias, sigmoid, uniform or "
         "random assignment)", router.name != MoERouterType.default or router.jitter_eps is not None
         or router.bias_gamma is not None or router.uniform_expert_assignment
         or router.random_expert_assignment or router.gating_function != MoERouterGatingFunction.softmax),
        ("expert weights normalised other than by their sum",
         router.normalize_expert_weights not in (None, 1.0)),
        ("a per-instance load-balancing loss (ours is over the batch)",
         moe.lb_loss_granularity != MoELoadBalancingLossGranularity.local_batch)) if bad]
    if problems:
        raise UserError("the OLMo-core MoE has no counterpart in our MoE: " + "; ".join(problems))
    src = SimpleNamespace(config=config, moe=moe)
    return OurMoEConfig(every=every, **_ours(src, "moe."))


def _ours(src: Any, prefix: str) -> dict[str, Any]:
    """Our fields under ``prefix`` (``""``: the model's, ``"moe."``: its MoE's) read back from the
    OLMo-core config parts in ``src``, as LMConfig declares them."""
    out = {}
    for name, to in carried("olmo_core"):
        if name.startswith("moe.") != (prefix == "moe."):
            continue
        path = to.paths[0].split(".")
        value: Any = src if hasattr(src, path[0]) else src.config    # a part, or the model's own
        for part in path:
            value = None if value is None else getattr(value, part)
        out[name.removeprefix(prefix)] = value if to.back is None else to.back(value, src)
    return out


def _split_blocks(config: SchemeTransformerConfig) -> tuple[SchemeBlockConfig, FeedForwardConfig | None,
                                                          OurMoEConfig]:
    """One attention for every block, one dense feed-forward (or none) and one MoE (on every
    ``every``-th block, ours; ``every=0``: none), read off the block configs and overrides."""
    if not isinstance(config.block, SchemeBlockConfig) or config.block_pattern:
        raise UserError("lm_config maps SchemeBlockConfig blocks (no named block patterns)")
    blocks = resolve_block_configs(config.n_layers, config.block,
                                   block_overrides=config.block_overrides)
    if not all(isinstance(b, SchemeBlockConfig) for b in blocks):
        raise UserError("lm_config maps SchemeBlockConfig blocks only")
    moe_at = [i for i, b in enumerate(blocks) if b.feed_forward_moe is not None]
    every = moe_at[0] + 1 if moe_at else 0
    dense = [b.feed_forward for b in blocks if b.feed_forward is not None]
    def rest(b: SchemeBlockConfig) -> dict:
        return {k: v for k, v in vars(b).items() if k not in ("feed_forward", "feed_forward_moe")}

    if (any(rest(b) != rest(blocks[0]) for b in blocks) or any(d != dense[0] for d in dense)
            or any(blocks[i].feed_forward_moe != blocks[moe_at[0]].feed_forward_moe for i in moe_at)
            or moe_at != [b for b in range(config.n_layers) if every and b % every == every - 1]):
        raise UserError("lm_config maps blocks that differ only in an MoE on every n-th block "
                        "(blocks n-1, 2n-1, ...) with one MoE config")
    moe = OurMoEConfig() if not moe_at else _our_moe(blocks[moe_at[0]].feed_forward_moe, every, config)
    return blocks[0], dense[0] if dense else None, moe


def _qk_norm_difference(norm: Any, config: SchemeTransformerConfig) -> str | None:
    """How the QK-norm ``norm`` differs from the one our model builds of the scheme's norm kind
    and eps (``None``: it does not). Its parameters' dtype is no difference: ours keep float32
    parameters, OLMo-core's ``None`` means the model's."""
    if norm is None:
        return None
    ours = head_norm_config(config.norm, config.norm_eps)
    same_dtype = {None, DType.float32}
    diff = [f"{f.name}={getattr(norm, f.name)!r} (ours: {getattr(ours, f.name)!r})" for f in fields(ours)
            if getattr(norm, f.name) != getattr(ours, f.name)
            and not (f.name == "dtype" and {norm.dtype, ours.dtype} <= same_dtype)]
    return f"a QK-norm other than the scheme's norm: {', '.join(diff)}" if diff else None


def lm_config(config: SchemeTransformerConfig, *, max_seq_len: int = 2048, **kwargs: Any) -> LMConfig:
    """Our ``LMConfig`` of the model ``config`` describes (the inverse of :func:`olmo_config`);
    ``max_seq_len`` and ``kwargs`` (``init``, ...) are ours alone. Default sizes come back as
    ``None`` (``mlp_hidden``, ``moe.hidden``, ``head_size``)."""
    if isinstance(config, SchemeTransformerConfig):
        config.check_sizes()        # before its blocks are resolved: n_layers of them
    block, ff, moe = _split_blocks(config)
    att = block.sequence_mixer
    if not isinstance(att, AttentionConfig):
        raise UserError("lm_config needs an attention")
    problems = [
        what for what, bad in (
            ("d_model not divisible by n_heads with no head_dim of its own",
             att.head_dim is None and config.d_model % att.n_heads != 0),
            ("attention options we do not have (gate, clip_qkv, sliding window, sinks, softmax "
             "scaling)", att.gate is not None or att.clip_qkv is not None
             or att.sliding_window is not None or att.attention_sinks or att.scalable_softmax),
            ("no RoPE or a scaled RoPE", att.rope is None or att.rope.scaling is not None
             or att.rope.partial_rotary_factor != 1.0),
            ("a QK-norm gain per head (ours share one gain over the heads)",
             att.qk_norm is not None and bool(att.qk_norm_per_head_gains)),
            (_qk_norm_difference(att.qk_norm, config), att.qk_norm is not None
             and _qk_norm_difference(att.qk_norm, config) is not None),
            ("a feed-forward other than SwiGLU", ff is not None and ff.activation != ActivationFunction.silu),
            ("biases on some linears and not others", ff is not None and bool(att.bias) != bool(ff.bias)),
            ("an LM head with a bias or a norm", bool(config.lm_head.bias)
             or config.lm_head.layer_norm is not None),
            ("an embedding norm or scale", config.embedding_norm is not None
             or config.embed_scale is not None),
            ("dropout", bool(block.dropout) or bool(att.dropout)))
        if bad]
    if problems:
        raise UserError("the OLMo-core config has no LMConfig counterpart: " + "; ".join(problems))
    src = SimpleNamespace(config=config, attention=att, feed_forward=ff)
    return LMConfig(**_ours(src, ""), moe=moe, max_seq_len=max_seq_len, **kwargs)


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


def _olmo_moe_tensor(ours: str, tensor: Tensor) -> Tensor:
    """Our MoE tensor ``ours`` in OLMo-core's layout: the router flat, the experts' matrices
    stacked along the rows as ``(experts * hidden, width)`` (gate and up transposed)."""
    if ours == "router.weight":
        return tensor.reshape(-1)
    if ours == "w_down":
        return tensor.reshape(-1, tensor.shape[-1])
    return tensor.transpose(1, 2).reshape(-1, tensor.shape[1])


def _ours_moe_tensor(olmo_state: Mapping[str, Tensor], block: int, theirs: str, tensor: Tensor) -> Tensor:
    """OLMo-core's MoE tensor ``theirs`` of ``block`` in our layout; the number of experts is read
    off the block's router (``experts * width`` values) and the embedding's width."""
    width = olmo_state["embeddings.weight"].shape[1]
    router = olmo_state.get(f"blocks.{block}.feed_forward_moe.router.weight")
    if router is None:
        raise KeyError(f"blocks.{block}.feed_forward_moe.router.weight: missing, needed to map the "
                       "block's experts")
    experts = router.numel() // width
    if theirs == "router.weight":
        return tensor.view(experts, width)
    stacked = tensor.view(experts, -1, width)                  # (experts, hidden, width)
    return stacked if theirs == "experts.mlp.w2" else stacked.transpose(1, 2)


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
        elif m := _THEIRS_MOE.fullmatch(name):
            out[f"sublayers.{2 * int(m[1]) + 1}.{_MOE_BACK[m[2]]}"] = _ours_moe_tensor(
                olmo_state, int(m[1]), m[2], tensor)
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
        elif (m := _OURS_MOE.fullmatch(name)) and int(m[1]) % 2 == 1:
            out[f"blocks.{int(m[1]) // 2}.feed_forward_moe.{_MOE[m[2]]}"] = _olmo_moe_tensor(m[2], tensor)
        elif m := _OURS.fullmatch(name):
            sub, module, param = int(m[1]), m[2], m[3]
            kind, table = ("attention", _ATTN) if sub % 2 == 0 else ("feed_forward", _MLP)
            if module not in table:
                raise KeyError(f"{name}: no counterpart in the OLMo-core model")
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
    raise UserError(f"OLMo-core has no dtype {dtype}")
