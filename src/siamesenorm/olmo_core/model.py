"""Every residual scheme of the package as an OLMo-core ``Transformer``.

OLMo-core builds the attention and the feed-forward of each block (its modules, kernels, init and
FLOP count); the residual wiring and every norm on the residual path are one of our schemes
(:func:`siamesenorm.schemes.build_scheme`), owned by the model as ``model.scheme``. The forward
pass is the scheme's loop, split over OLMo-core's blocks::

    state = scheme.enter(embeddings(input_ids))           # SchemeTransformer.forward
    for block in blocks:                                  # SchemeBlock.forward, block b:
        state = scheme.step(state, 2 b, attention)        #   sublayer 2b: attention
        state = scheme.step(state, 2 b + 1, feed_forward) #   sublayer 2b + 1: feed-forward
    logits = lm_head(scheme.exit(state))                  # the LM head has no norm of its own

The state (one tensor, a tuple of streams, or stacked streams) travels from block to block; a
block never looks inside it. OLMo-core's block and model types are enums that cannot be extended
from outside, so the pieces are subclasses: :class:`SchemeBlockConfig` builds
:class:`SchemeBlock`, :class:`SchemeTransformerConfig` builds :class:`SchemeTransformer`, which a
``TransformerTrainModuleConfig.build(model)`` trains like any OLMo-core model.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from fnmatch import fnmatch
from functools import partial
from typing import Any, cast

import torch
from olmo_core.nn.attention import Attention, AttentionConfig
from olmo_core.nn.buffer_cache import BufferCache
from olmo_core.nn.feed_forward import FeedForwardConfig
from olmo_core.nn.layer_norm import LayerNormConfig, LayerNormType
from olmo_core.nn.lm_head import LMHeadConfig
from olmo_core.nn.transformer import Transformer, TransformerBlockBase, TransformerBlockConfig
from olmo_core.nn.transformer.config import (
    TransformerConfig,
    TransformerDataParallelWrappingStrategy,
    resolve_block_configs,
)
from olmo_core.nn.transformer.init import _apply_init
from olmo_core.utils import mark_dynamic
from torch import Tensor, nn
from torch.distributed import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard

from ..errors import ConfigError
from ..schemes import ResidualScheme, build_scheme

__all__ = ["QKVNormAttention", "SchemeBlock", "SchemeBlockConfig", "SchemeTransformer",
           "SchemeTransformerConfig", "head_norm_config"]


def head_norm_config(norm: str, eps: float) -> LayerNormConfig:
    """OLMo-core's config of the per-head q/k/v norm that is our ``build_norm(norm, head_dim, eps)``:
    RMSNorm with a weight and no bias, or LayerNorm with a weight and a bias."""
    if norm == "rmsnorm":
        return LayerNormConfig(name=LayerNormType.rms, eps=eps, bias=False)
    if norm == "layernorm":
        return LayerNormConfig(name=LayerNormType.default, eps=eps, bias=True)
    raise ConfigError(f"unknown norm {norm!r}; choose rmsnorm or layernorm")


class QKVNormAttention(Attention):
    """OLMo-core's :class:`~olmo_core.nn.attention.Attention` with a per-head norm on v as well as
    q and k (HybridNorm; SiameseNorm's ``hybrid_pre``), applied in ``_prepare_qkv`` after q and k
    are normalised: ``v_norm`` (over ``head_dim``, weights shared by the heads). Made from a built
    ``Attention`` by :meth:`from_attention`, so every other option keeps OLMo-core's own code."""

    v_norm: nn.Module

    @classmethod
    def from_attention(cls, att: Attention, v_norm: LayerNormConfig,
                       init_device: str = "cpu") -> QKVNormAttention:
        if type(att) is not Attention:
            raise ConfigError(f"QKV-norm needs OLMo-core's default attention, got {type(att).__name__}")
        if not att.use_head_qk_norm or att.q_norm is None:
            raise ConfigError("QKV-norm needs per-head q/k norms (use_head_qk_norm=True)")
        att.__class__ = cls
        att.v_norm = v_norm.build(size=att.head_dim, init_device=init_device)
        return cast(QKVNormAttention, att)

    def _prepare_qkv(self, x: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = super()._prepare_qkv(x, **kwargs)
        return q, k, self.v_norm(v)

    def apply_tp(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("tensor parallelism of QKV-norm attention is not implemented")


class SchemeBlock(TransformerBlockBase):
    """Block ``block_idx``: OLMo-core's attention (sublayer ``2 * block_idx``) and feed-forward
    (sublayer ``2 * block_idx + 1``), bare, run by ``scheme.step``. The scheme is the model's
    (:meth:`bind_scheme`); it is not a submodule of the block, so FSDP shards the block's own
    attention and feed-forward with it and the scheme's parameters with the model's root.

    ``forward(state, **attention_kwargs) -> state``: the scheme's state in and out.
    """

    def __init__(self, *, d_model: int, block_idx: int, n_layers: int,
                 sequence_mixer: AttentionConfig, feed_forward: FeedForwardConfig,
                 qkv_norm: LayerNormConfig | None = None, dropout: float = 0.0,
                 init_device: str = "cpu", cache: BufferCache | None = None) -> None:
        super().__init__(n_layers=n_layers)
        self.d_model, self.block_idx = d_model, block_idx
        if qkv_norm is not None:
            sequence_mixer = replace(sequence_mixer, qk_norm=qkv_norm, use_head_qk_norm=True)
        self.attention = sequence_mixer.build(d_model, layer_idx=block_idx, n_layers=n_layers,
                                              init_device=init_device, cache=cache)
        if qkv_norm is not None:
            self.attention = QKVNormAttention.from_attention(self.attention, qkv_norm, init_device)
        self.feed_forward = feed_forward.build(d_model=d_model, init_device=init_device)
        self.dropout = nn.Dropout(dropout) if dropout > 0.0 else None
        self._scheme: tuple[ResidualScheme, ...] = ()

    def bind_scheme(self, scheme: ResidualScheme) -> None:
        """Run under ``scheme`` (held by reference, not registered as a submodule)."""
        if scheme.n_layers != self.n_layers:
            raise ConfigError(f"the scheme has {scheme.n_layers} blocks, the model {self.n_layers}")
        self._scheme = (scheme,)

    @property
    def scheme(self) -> ResidualScheme:
        if not self._scheme:
            raise RuntimeError("SchemeBlock has no scheme: the SchemeTransformer binds it")
        return self._scheme[0]

    def _branch(self, module: nn.Module, kwargs: dict[str, Any]):
        fn = partial(module, **kwargs) if kwargs else module
        if self.dropout is None:
            return fn
        return lambda u: self.dropout(fn(u))

    def forward(self, x: Any, *, loss_div_factor: Tensor | float | None = None, **kwargs: Any) -> Any:
        del loss_div_factor
        scheme, i = self.scheme, 2 * self.block_idx
        state = scheme.step(x, i, self._branch(self.attention, kwargs))
        return scheme.step(state, i + 1, self._branch(self.feed_forward, {}))

    def apply_tp(self, tp_mesh: DeviceMesh, *, input_layout: Any, float8_enabled: bool = False):
        raise NotImplementedError("tensor parallelism of scheme blocks is not implemented yet")

    def apply_cp(self, cp_mesh: DeviceMesh, ring: Any = None, uly: Any = None):
        self.attention.apply_cp(cp_mesh, ring=ring, uly=uly)

    def apply_fsdp(self, dp_mesh: DeviceMesh | None = None, prefetch_factor: int = 0,
                   wrapping_strategy: TransformerDataParallelWrappingStrategy = (
                       TransformerDataParallelWrappingStrategy.full),
                   **fsdp_kwargs: Any) -> None:
        if wrapping_strategy == TransformerDataParallelWrappingStrategy.fine_grained:
            att = cast(FSDPModule, fully_shard(self.attention, mesh=dp_mesh, **fsdp_kwargs))
            mlp = cast(FSDPModule, fully_shard(self.feed_forward, mesh=dp_mesh, **fsdp_kwargs))
            root = cast(FSDPModule, fully_shard(self, mesh=dp_mesh, **fsdp_kwargs))
            if prefetch_factor > 0:
                root.set_modules_to_forward_prefetch([att])
                att.set_modules_to_forward_prefetch([mlp])
        else:
            fully_shard(self, mesh=dp_mesh, **fsdp_kwargs)

    def num_flops_per_token(self, seq_len: int) -> int:
        return (self.attention.num_flops_per_token(seq_len)
                + self.feed_forward.num_flops_per_token(seq_len))


@dataclass
class SchemeBlockConfig(TransformerBlockConfig):
    """Builds a :class:`SchemeBlock` from ``sequence_mixer`` (an ``AttentionConfig``) and
    ``feed_forward``. ``layer_norm`` must stay unset: the scheme owns every norm. ``qkv_norm``
    (set by :class:`SchemeTransformer` on the blocks whose QKV-norm the scheme requires) is the
    per-head norm of q, k and v there. ``dropout`` drops each branch's output while training."""

    qkv_norm: LayerNormConfig | None = None

    def __post_init__(self, attention: AttentionConfig | None = None) -> None:
        super().__post_init__(attention)
        if self.layer_norm is not None:
            raise ConfigError("SchemeBlockConfig.layer_norm must be None: the scheme owns the norms")
        if self.feed_forward_moe is not None:
            raise NotImplementedError("mixture-of-experts scheme blocks are not implemented yet")
        if self.feed_forward is None:
            raise ConfigError("SchemeBlockConfig needs feed_forward")
        if not isinstance(self.sequence_mixer, AttentionConfig):
            raise ConfigError("SchemeBlockConfig needs an AttentionConfig as sequence_mixer, got "
                              f"{type(self.sequence_mixer).__name__}")
        for name in ("attention_residual_alpha", "feed_forward_residual_alpha"):
            if getattr(self, name) not in (None, 1.0):
                raise ConfigError(f"SchemeBlockConfig.{name} is not supported: the scheme scales")

    def build(self, *, d_model: int, block_idx: int, n_layers: int, init_device: str = "cpu",
              cache: BufferCache | None = None) -> SchemeBlock:
        assert self.feed_forward is not None
        return SchemeBlock(d_model=d_model, block_idx=block_idx, n_layers=n_layers,
                           sequence_mixer=cast(AttentionConfig, self.sequence_mixer),
                           feed_forward=self.feed_forward, qkv_norm=self.qkv_norm,
                           dropout=self.dropout or 0.0, init_device=init_device, cache=cache)

    def num_params(self, d_model: int) -> int:
        mixer = cast(AttentionConfig, self.sequence_mixer)
        extra = 0
        if self.qkv_norm is not None:
            mixer = replace(mixer, qk_norm=self.qkv_norm, use_head_qk_norm=True)
            extra = self.qkv_norm.num_params(mixer.head_dim or d_model // mixer.n_heads)
        assert self.feed_forward is not None
        return mixer.num_params(d_model) + extra + self.feed_forward.num_params(d_model)

    def num_active_params(self, d_model: int) -> int:
        return self.num_params(d_model)


def _scheme_block_configs(n_layers: int, block: Any, block_overrides: dict | None,
                          block_pattern: list | None, scheme: ResidualScheme,
                          norm: str, norm_eps: float) -> dict[int, SchemeBlockConfig]:
    """Every block's config, with ``qkv_norm`` set where the scheme requires QKV-norm."""
    if isinstance(block, dict) or block_pattern is not None:
        raise NotImplementedError("named block patterns are not supported by SchemeTransformer yet")
    configs = resolve_block_configs(n_layers=n_layers, block=block, block_overrides=block_overrides)
    out = {}
    for i, cfg in enumerate(configs):
        if not isinstance(cfg, SchemeBlockConfig):
            raise ConfigError(f"block {i}: SchemeTransformer needs SchemeBlockConfig blocks, got "
                              f"{type(cfg).__name__}")
        if i in scheme.requires.qkv_norm_blocks and cfg.qkv_norm is None:
            cfg = replace(cfg, qkv_norm=head_norm_config(norm, norm_eps))
        out[i] = cfg
    return out


class SchemeTransformer(Transformer):
    """OLMo-core's ``Transformer`` whose blocks are :class:`SchemeBlock` and whose residual
    scheme is ``self.scheme`` (any of :func:`siamesenorm.list_schemes`, built with ``norm``,
    ``norm_eps`` and ``scheme_options``). The LM head must have no norm (the scheme's ``exit``
    ends in the final norm). The other arguments are ``Transformer``'s.

    Weight init is OLMo-core's (``init_method``, ``init_std``) for the embedding, attention,
    feed-forward and head, and the scheme's own ``reset_parameters`` for its norms and mixing
    parameters; where the scheme requires it (DeepNorm) the branch weights are then Xavier-normal
    with its ``branch_gain``. Not supported: pipeline and tensor parallelism (the pipeline stages of
    OLMo-core pass one tensor; a scheme's state may be several), MoE blocks, named block patterns.
    """

    def __init__(self, *, scheme: str = "pre", scheme_options: dict[str, Any] | None = None,
                 norm: str = "rmsnorm", norm_eps: float = 1e-5, d_model: int, n_layers: int,
                 block: SchemeBlockConfig, lm_head: LMHeadConfig, init_device: str = "cpu",
                 dtype: torch.dtype = torch.float32, block_overrides: dict | None = None,
                 block_pattern: list | None = None, **kwargs: Any) -> None:
        if lm_head.layer_norm is not None:
            raise ConfigError("SchemeTransformer: lm_head.layer_norm must be None (the scheme's exit "
                              "applies the final norm)")
        # Built before the blocks: its requirements decide which attentions get QKV-norm.
        scheme_module = build_scheme(scheme, d_model, n_layers, norm=norm, eps=norm_eps,
                                     device=init_device, dtype=dtype, **(scheme_options or {}))
        configs = _scheme_block_configs(n_layers, block, block_overrides, block_pattern,
                                        scheme_module, norm, norm_eps)
        super().__init__(d_model=d_model, n_layers=n_layers, block=block, lm_head=lm_head,
                         init_device=init_device, dtype=dtype,
                         block_overrides={i: c for i, c in configs.items() if c is not block} or None,
                         **kwargs)
        self.scheme = scheme_module
        for b in self.blocks.values():
            cast(SchemeBlock, b).bind_scheme(scheme_module)
        # Transformer caches its parameter counts before the scheme was attached.
        for name in ("num_params", "num_non_embedding_params"):
            self.__dict__.pop(name, None)

    def _validate_block(self, block: TransformerBlockBase) -> TransformerBlockBase:
        if not isinstance(block, SchemeBlock):
            raise ConfigError(f"SchemeTransformer needs SchemeBlock blocks, got {type(block).__name__}")
        return block

    # ---- initialisation ----------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, **kwargs: Any) -> torch.Generator:
        """OLMo-core's ``init_weights`` (which also resets the scheme), then the scheme's
        requirements on the branch weights (DeepNorm: Xavier-normal, gain ``branch_gain`` on v,
        out and the feed-forward; any other ``branch_gain`` != 1 multiplies those weights)."""
        generator = super().init_weights(**kwargs)
        requires = self.scheme.requires
        if requires.init != "xavier" and requires.branch_gain == 1.0:
            return generator
        for block in self.blocks.values():
            att, ff = block.attention, block.feed_forward
            for linear, gained in ((att.w_q, False), (att.w_k, False), (att.w_v, True),
                                   (att.w_out, True), (ff.w1, True), (ff.w3, True), (ff.w2, True)):
                gain = requires.branch_gain if gained else 1.0
                if requires.init == "xavier":
                    _apply_init(nn.init.xavier_normal_, linear.weight, gain=gain, generator=generator)
                    if linear.bias is not None:
                        nn.init.zeros_(linear.bias)
                elif gain != 1.0:
                    linear.weight.mul_(gain)
        return generator

    # ---- forward -----------------------------------------------------------------------------
    def _mark_dynamic(self, state: Any) -> None:
        for t in state if isinstance(state, tuple) else (state,):
            if isinstance(t, Tensor):
                mark_dynamic(t, (0, 1), strict=False)

    def forward(self, input_ids: Tensor, *, input_embeddings: Tensor | None = None,
                labels: Tensor | None = None, ignore_index: int = -100,
                loss_reduction: str = "mean", z_loss_multiplier: float | None = None,
                loss_div_factor: Tensor | float | None = None, return_logits: bool | None = None,
                logits_to_keep: int | Tensor = 0, **kwargs: Any):
        """``Transformer.forward`` with the scheme's loop: ``enter`` after the embedding, the
        blocks carry its state, ``exit`` before the LM head. Returns what ``Transformer``
        returns (logits, or an ``LMOutputWithLoss`` with ``labels``)."""
        if self.embeddings is None or self.lm_head is None:
            raise NotImplementedError("a SchemeTransformer runs whole: pipeline stages carry one "
                                      "tensor, a scheme's state may be several")
        if input_embeddings is not None and self._cp_load_balancer is not None:
            raise RuntimeError("`input_embeddings` is not supported with context parallelism")
        input_ids, labels, all_block_kwargs, per_block_kwargs, lm_head_kwargs = self._prepare_inputs(
            input_ids, labels, ignore_index=ignore_index, loss_reduction=loss_reduction,
            z_loss_multiplier=z_loss_multiplier, loss_div_factor=loss_div_factor,
            return_logits=return_logits, logits_to_keep=logits_to_keep, **kwargs)
        if input_embeddings is not None:
            h = input_embeddings.to(self.device)
        else:
            h = self.embeddings(input_ids)
            if self.embed_scale is not None:
                h = h * self.embed_scale
            if self.embedding_norm is not None:
                h = self.embedding_norm(h)
        state = self.scheme.enter(h)
        for key, block in self.blocks.items():
            if self.compile_enabled:
                self._mark_dynamic(state)
            state = block(state, **all_block_kwargs, **per_block_kwargs.get(int(key), {}))
        h = self.scheme.exit(state)
        if self.compile_enabled:
            mark_dynamic(h, (0, 1), strict=False)
            if labels is not None:
                mark_dynamic(labels, (0, 1), strict=False)
        if labels is not None:
            lm_head_kwargs["labels"] = labels
        return self.lm_head(h, **lm_head_kwargs)

    def apply_pp(self, pp_mesh: DeviceMesh):
        raise NotImplementedError("pipeline parallelism of a SchemeTransformer is not implemented: "
                                  "OLMo-core's stages pass one tensor, a scheme's state may be several")

    def apply_tp(self, tp_mesh: DeviceMesh, float8_enabled: bool | None = None):
        raise NotImplementedError("tensor parallelism of a SchemeTransformer is not implemented yet")


@dataclass
class SchemeTransformerConfig(TransformerConfig):
    """``TransformerConfig`` for a :class:`SchemeTransformer`: ``block`` is a
    :class:`SchemeBlockConfig`, ``lm_head`` has no ``layer_norm``; ``scheme``,
    ``scheme_options``, ``norm`` and ``norm_eps`` build the residual scheme. ``name`` is
    ignored. :func:`siamesenorm.olmo_core.olmo_config` makes one from our ``LMConfig``."""

    scheme: str = "pre"
    scheme_options: dict[str, Any] = field(default_factory=dict)
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5

    def _scheme_on_meta(self) -> ResidualScheme:
        return build_scheme(self.scheme, self.d_model, self.n_layers, norm=self.norm,
                            eps=self.norm_eps, device="meta", **self.scheme_options)

    @property
    def resolved_block_configs(self) -> list[TransformerBlockConfig]:
        configs = _scheme_block_configs(self.n_layers, self.block, self.block_overrides,
                                        self.block_pattern, self._scheme_on_meta(), self.norm,
                                        self.norm_eps)
        return [configs[i] for i in range(self.n_layers)]

    @property
    def num_scheme_params(self) -> int:
        """Parameters of the scheme (its norms and mixing parameters)."""
        return sum(p.numel() for p in self._scheme_on_meta().parameters())

    @property
    def num_params(self) -> int:
        return super().num_params + self.num_scheme_params

    @property
    def num_active_params(self) -> int:
        return super().num_active_params + self.num_scheme_params

    def build(self, *, init_device: str = "cpu") -> SchemeTransformer:
        model = SchemeTransformer(
            scheme=self.scheme, scheme_options=dict(self.scheme_options), norm=self.norm,
            norm_eps=self.norm_eps, d_model=self.d_model, vocab_size=self.vocab_size,
            n_layers=self.n_layers, block=cast(SchemeBlockConfig, self.block),
            lm_head=self.lm_head, embedding_norm=self.embedding_norm, dtype=self.dtype.as_pt(),
            init_method=self.init_method, init_device=init_device, init_seed=self.init_seed,
            init_std=self.init_std, embedding_init_std=self.embedding_init_std,
            block_overrides=self.block_overrides, block_pattern=self.block_pattern,
            embed_scale=self.embed_scale, tie_word_embeddings=self.tie_word_embeddings)
        for name, param in model.named_parameters():
            if any(fnmatch(name, pattern) for pattern in self.freeze_params or ()):
                param.requires_grad = False
        return model
