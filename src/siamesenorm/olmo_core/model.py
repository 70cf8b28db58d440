"""Every residual scheme of the package as an OLMo-core ``Transformer``: OLMo-core builds each
block's attention and feed-forward; the residual wiring and every norm on it are one of our schemes
(``model.scheme``), whose state travels from block to block::

    state = scheme.enter(embeddings(input_ids))           # SchemeTransformer.forward
    for block in blocks:                                  # SchemeBlock.forward, block b:
        state = scheme.step(state, 2 b, attention)
        state = scheme.step(state, 2 b + 1, feed_forward)
    logits = lm_head(scheme.exit(state))                  # the LM head has no norm of its own
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from fnmatch import fnmatch
from functools import lru_cache, partial
from typing import Any, cast

import torch
from olmo_core.distributed.utils import distribute_like, get_local_tensor
from olmo_core.nn.attention import Attention, AttentionConfig
from olmo_core.nn.buffer_cache import BufferCache
from olmo_core.nn.feed_forward import FeedForwardConfig
from olmo_core.nn.layer_norm import LayerNormConfig, LayerNormType
from olmo_core.nn.lm_head import LMHeadConfig, LMLossImplementation
from olmo_core.nn.transformer import Transformer, TransformerBlockBase, TransformerBlockConfig
from olmo_core.nn.transformer.config import (
    TransformerActivationCheckpointingMode,
    TransformerConfig,
    TransformerDataParallelWrappingStrategy,
    resolve_block_configs,
)
from olmo_core.utils import mark_dynamic
from torch import Tensor, nn
from torch.distributed import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_module
from torch.distributed.tensor.parallel import RowwiseParallel, SequenceParallel, parallelize_module

from ..errors import UserError
from ..models.config_checks import MAX_EXPERTS, buildable, positive_int
from ..models.host import BranchWeight, honour_requirements, needs_qkv_norm
from ..models.lm_config import refusal
from ..schemes import ResidualScheme, build_scheme, get_scheme_class
from .views import SchemeBlockView, like_a_block_output

__all__ = ["QKVNormAttention", "SchemeBlock", "SchemeBlockConfig", "SchemeTransformer",
           "SchemeTransformerConfig", "head_norm_config"]

# The mixture-of-experts pieces, which .moe (imported with the package) registers here: "check"
# (an MoEConfig), "block" (SchemeMoEBlock) and "model" (SchemeMoETransformer). A dict, not an import,
# since .moe subclasses this module's block and model.
MOE: dict[str, Any] = {}

# Pipeline parallelism is refused (docs/olmo-core.md, "Parallelism").
PP_REFUSAL = ("pipeline parallelism of a SchemeTransformer is not supported: OLMo-core's stages pass one "
              "tensor (a scheme's state may be several) and its pipeline schedules need CUDA, so a "
              "packed state could not be tested")


def refuse_dyt(norm: str) -> None:
    """Refuse the norm kinds LMConfig declares OLMo-core cannot carry (DyT, Derf)."""
    rule = refusal("olmo_core", "norm")
    if norm not in rule.allowed:
        raise UserError(f"norm={norm!r} is not available in OLMo-core models ({rule.why}); use "
                        f"{' or '.join(rule.allowed)} there")


def head_norm_config(norm: str, eps: float) -> LayerNormConfig:
    """OLMo-core's config of the per-head q/k/v norm that is our ``build_norm(norm, head_dim, eps)``:
    RMSNorm with a weight and no bias, or LayerNorm with a weight and a bias."""
    if norm == "rmsnorm":
        return LayerNormConfig(name=LayerNormType.rms, eps=eps, bias=False)
    if norm == "layernorm":
        return LayerNormConfig(name=LayerNormType.default, eps=eps, bias=True)
    raise UserError(f"unknown norm {norm!r}; choose rmsnorm or layernorm")


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
            raise UserError(f"QKV-norm needs OLMo-core's default attention, got {type(att).__name__}")
        if not att.use_head_qk_norm or att.q_norm is None:
            raise UserError("QKV-norm needs per-head q/k norms (use_head_qk_norm=True)")
        att.__class__ = cls
        att.v_norm = v_norm.build(size=att.head_dim, init_device=init_device)
        return cast(QKVNormAttention, att)

    def _prepare_qkv(self, x: Tensor, **kwargs: Any) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v = super()._prepare_qkv(x, **kwargs)
        return q, k, self.v_norm(v)

    def apply_tp(self, tp_mesh: DeviceMesh, input_layout: Placement | None = None,
                 output_layout: Placement | None = None, use_local_output: bool = True,
                 float8_enabled: bool = False) -> None:
        """OLMo-core's plan (q, k, v projections column-parallel, so each rank holds whole heads,
        ``n_heads / tp`` of them), and ``v_norm`` on the local heads: v arrives as a local
        ``(B, T, local heads, head_dim)`` tensor, is read as a DTensor sharded over the heads
        (``Shard(2)``) and normalised over ``head_dim`` with ``v_norm``'s weight replicated over
        the TP group, so the weight's gradient (a sum over every head) is reduced over the group."""
        super().apply_tp(tp_mesh, input_layout=input_layout, output_layout=output_layout,
                         use_local_output=use_local_output, float8_enabled=float8_enabled)
        parallelize_module(self.v_norm, device_mesh=tp_mesh, parallelize_plan=SequenceParallel(
            sequence_dim=2, use_local_output=True))


def check_tp_degree(block: nn.Module, degree: int) -> None:
    """Refuse a TP degree that does not divide the block's heads, kv heads or SwiGLU width."""
    att, ff = block.attention, getattr(block, "feed_forward", None)
    sizes = [("heads", att.n_heads), ("kv heads", att.n_kv_heads)]
    if ff is not None:
        sizes.append(("feed-forward hidden size", ff.hidden_size))
    for what, n in sizes:
        if n % degree:
            raise UserError(f"tensor parallelism of degree {degree} does not divide the {n} {what}")


def map_state(fn: Callable[[Tensor], Tensor], state: Any) -> Any:
    """``fn`` on every tensor of a scheme's state (a tensor, or a tuple of tensors and Nones)."""
    if isinstance(state, tuple):
        return tuple(fn(t) if isinstance(t, Tensor) else t for t in state)
    return fn(state) if isinstance(state, Tensor) else state


def replicated(mesh: DeviceMesh | None, t: Tensor) -> Tensor:
    """``t`` (the same on every rank of ``mesh``) as a DTensor replicated over ``mesh``."""
    if mesh is None or isinstance(t, DTensor):
        return t
    return DTensor.from_local(t, mesh, (Replicate(),), run_check=False)


def local(t: Tensor) -> Tensor:
    """A replicated DTensor's whole tensor (a plain tensor as it is)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


class SchemeBlock(TransformerBlockBase):
    """Block ``block_idx``: OLMo-core's attention and feed-forward (sublayers ``2 b`` and ``2 b + 1``),
    bare, run by the model's scheme (held by reference, so FSDP shards it with the root) through
    the block's ``view`` of it (one compiled graph per kind of block). Under tensor parallelism
    the state enters and leaves as plain tensors, a replicated DTensor inside."""

    _tp_mesh: DeviceMesh | None = None

    def __init__(self, *, d_model: int, block_idx: int, n_layers: int,
                 sequence_mixer: AttentionConfig, feed_forward: FeedForwardConfig | None,
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
        if feed_forward is not None:   # None: an MoE block (.moe.SchemeMoEBlock) builds its own
            self.feed_forward = feed_forward.build(d_model=d_model, init_device=init_device)
        self.dropout = nn.Dropout(dropout) if dropout > 0.0 else None
        self._scheme: tuple[ResidualScheme, ...] = ()
        self.view: SchemeBlockView | None = None

    def bind_scheme(self, scheme: ResidualScheme) -> None:
        """Run under ``scheme`` (held by reference, not registered as a submodule), through this
        block's view of it (:class:`~siamesenorm.olmo_core.views.SchemeBlockView`)."""
        if scheme.n_layers != self.n_layers:
            raise UserError(f"the scheme has {scheme.n_layers} blocks, the model {self.n_layers}")
        self._scheme = (scheme,)
        self.view = SchemeBlockView(scheme, self.block_idx)

    @property
    def scheme(self) -> ResidualScheme:
        if not self._scheme:
            raise RuntimeError("SchemeBlock has no scheme: the SchemeTransformer binds it")
        return self._scheme[0]

    def _view_scheme(self) -> ResidualScheme:
        if self.view is None:
            raise RuntimeError("SchemeBlock has no scheme: the SchemeTransformer binds it")
        return self.view.scheme

    def _branch(self, module: nn.Module, kwargs: dict[str, Any]):
        fn = partial(module, **kwargs) if kwargs else module
        if self.dropout is None:
            return fn
        return lambda u: self.dropout(fn(u))

    def forward(self, x: Any, *, loss_div_factor: Tensor | float | None = None, **kwargs: Any) -> Any:
        del loss_div_factor
        scheme, i, mesh = self._view_scheme(), self.view.first, self._tp_mesh
        state = x if mesh is None else map_state(partial(replicated, mesh), x)
        state = scheme.step(state, i, self._branch(self.attention, kwargs))
        state = scheme.step(state, i + 1, self._branch(self.feed_forward, {}))
        return state if mesh is None else map_state(local, state)

    def apply_tp(self, tp_mesh: DeviceMesh, *, input_layout: Placement | None = None,
                 float8_enabled: bool = False) -> None:
        """Tensor parallelism of the attention and the feed-forward; the scheme's state stays
        replicated (see :meth:`SchemeTransformer.apply_tp`). Each sublayer reads the replicated
        state as it is (its first projections are column-parallel) and returns a replicated
        DTensor (its row-parallel output projection ends in an all-reduce). Between blocks the
        state travels as plain tensors: FSDP's hooks and activation checkpointing then see the
        tensors they expect (FSDP hands a zero gradient, as a plain tensor, to a stream that a
        block passes on unused, which a DTensor could not take)."""
        if input_layout not in (None, Replicate()):
            raise UserError(f"a scheme block takes the scheme's state replicated over the TP group, "
                              f"not {input_layout}")
        if self.dropout is not None:
            raise UserError("tensor parallelism of scheme blocks with dropout is not supported: "
                              "the replicated streams would need one mask on every rank")
        check_tp_degree(self, tp_mesh.size())
        for sublayer in (self.attention, self.feed_forward):
            sublayer.apply_tp(tp_mesh, input_layout=Replicate(), output_layout=Replicate(),
                              use_local_output=False, float8_enabled=float8_enabled)
        self._tp_mesh = tp_mesh

    def apply_cp(self, cp_mesh: DeviceMesh, ring: Any = None, uly: Any = None):
        self.attention.apply_cp(cp_mesh, ring=ring, uly=uly)

    def apply_fsdp(self, dp_mesh: DeviceMesh | None = None, prefetch_factor: int = 0,
                   wrapping_strategy: TransformerDataParallelWrappingStrategy = (
                       TransformerDataParallelWrappingStrategy.full),
                   **fsdp_kwargs: Any) -> None:
        _quiet_scheme_block_view_warning()
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


# A scheme block returns views in two cases: Attention Residuals pass every earlier output on
# unchanged, as the views of its inputs that FSDP2's pre-forward made; under tensor parallelism the
# state leaves a block as DTensor.to_local() views. FSDP2 then warns that an in-place op on such a
# view would skip its all-gather. No scheme writes into its state in place (each step returns new
# tensors), and tests/test_olmo_core_parallel.py checks every scheme in its plan under FSDP, TP and CP
# against one process, so the warning is ignored for scheme blocks (any other module's stays loud).
SCHEME_BLOCK_VIEW_WARNING = r"FSDP2-wrapped module \(FSDPSchemeBlock\) returned a view tensor"


def _quiet_scheme_block_view_warning() -> None:
    warnings.filterwarnings("ignore", message=SCHEME_BLOCK_VIEW_WARNING, category=UserWarning)


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
            raise UserError("SchemeBlockConfig.layer_norm must be None: the scheme owns the norms")
        if (self.feed_forward is None) == (self.feed_forward_moe is None):
            raise UserError("SchemeBlockConfig needs feed_forward or feed_forward_moe (one of them)")
        if self.feed_forward_moe is not None:
            MOE["check"](self.feed_forward_moe)
        if not isinstance(self.sequence_mixer, AttentionConfig):
            raise UserError("SchemeBlockConfig needs an AttentionConfig as sequence_mixer, got "
                              f"{type(self.sequence_mixer).__name__}")
        for name in ("attention_residual_alpha", "feed_forward_residual_alpha"):
            if getattr(self, name) not in (None, 1.0):
                raise UserError(f"SchemeBlockConfig.{name} is not supported: the scheme scales")

    def build(self, *, d_model: int, block_idx: int, n_layers: int, init_device: str = "cpu",
              cache: BufferCache | None = None) -> SchemeBlock:
        if self.feed_forward_moe is not None:
            return MOE["block"](d_model=d_model, block_idx=block_idx, n_layers=n_layers,
                                  sequence_mixer=cast(AttentionConfig, self.sequence_mixer),
                                  feed_forward_moe=self.feed_forward_moe, qkv_norm=self.qkv_norm,
                                  dropout=self.dropout or 0.0, init_device=init_device, cache=cache)
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
        ff = self.feed_forward if self.feed_forward is not None else self.feed_forward_moe
        assert ff is not None
        return mixer.num_params(d_model) + extra + ff.num_params(d_model)

    def num_active_params(self, d_model: int) -> int:
        moe = self.feed_forward_moe    # the experts a token is not routed to are inactive
        inactive = 0 if moe is None else moe.num_params(d_model) - moe.num_active_params(d_model)
        return self.num_params(d_model) - inactive


def _check_block_sizes(owner: str, block: Any) -> None:
    """The sizes of one block config (see :meth:`SchemeTransformerConfig.check_sizes`); what is not
    a block config is left to the checks that refuse it by kind."""
    mixer = getattr(block, "sequence_mixer", None)
    if isinstance(mixer, AttentionConfig):
        positive_int(f"{owner}.sequence_mixer", "n_heads", mixer.n_heads)
        for name in ("n_kv_heads", "head_dim"):
            if getattr(mixer, name) is not None:
                positive_int(f"{owner}.sequence_mixer", name, getattr(mixer, name))
    ff = getattr(block, "feed_forward", None)
    if isinstance(ff, FeedForwardConfig):
        positive_int(f"{owner}.feed_forward", "hidden_size", ff.hidden_size)
    moe = getattr(block, "feed_forward_moe", None)
    if moe is not None:
        where = f"{owner}.feed_forward_moe"
        for name in ("num_experts", "hidden_size"):
            positive_int(where, name, getattr(moe, name, None))
        if moe.num_experts > MAX_EXPERTS:
            raise UserError(f"{where}.num_experts={moe.num_experts:,} is beyond what this library builds "
                            f"(at most {MAX_EXPERTS:,} per layer; the largest published mixtures have a "
                            "few hundred)")
        positive_int(f"{where}.router", "top_k", getattr(getattr(moe, "router", None), "top_k", None))


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
            raise UserError(f"block {i}: SchemeTransformer needs SchemeBlockConfig blocks, got "
                              f"{type(cfg).__name__}")
        if needs_qkv_norm(scheme, i) and cfg.qkv_norm is None:
            cfg = replace(cfg, qkv_norm=head_norm_config(norm, norm_eps))
        out[i] = cfg
    return out


def recompile_limit_for(n_blocks: int) -> int:
    """Dynamo's recompile limit that compiles each of ``n_blocks`` blocks once if it must (one
    entry per kind of block on their shared code, at most one per block, and room for a few
    shape changes)."""
    return n_blocks + 8


class SchemeTransformer(Transformer):
    """OLMo-core's ``Transformer`` of :class:`SchemeBlock` blocks and the residual scheme
    ``self.scheme`` (``scheme``, ``scheme_options``, ``norm``, ``norm_eps``); the LM head has no
    norm. Init is OLMo-core's, the scheme's own, then the scheme's requirements. Parallelism:
    FSDP/HSDP, DDP, TP (the state replicated), CP and activation checkpointing; not pipeline
    parallelism, DDP with TP, or named block patterns."""

    def __init__(self, *, scheme: str = "pre", scheme_options: dict[str, Any] | None = None,
                 norm: str = "rmsnorm", norm_eps: float = 1e-5, d_model: int, n_layers: int,
                 block: SchemeBlockConfig, lm_head: LMHeadConfig, init_device: str = "cpu",
                 dtype: torch.dtype = torch.float32, block_overrides: dict | None = None,
                 block_pattern: list | None = None, **kwargs: Any) -> None:
        if lm_head.layer_norm is not None:
            raise UserError("SchemeTransformer: lm_head.layer_norm must be None (the scheme's exit "
                              "applies the final norm)")
        refuse_dyt(norm)
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
        self._scheme_build = partial(build_scheme, scheme, d_model, n_layers, norm=norm, eps=norm_eps,
                                     dtype=dtype, **(scheme_options or {}))
        views = []
        for b in self.blocks.values():
            cast(SchemeBlock, b).bind_scheme(scheme_module)
            views.append(cast(SchemeBlock, b).view)
        self._scheme_views = tuple(views)
        # Transformer caches its parameter counts before the scheme was attached.
        for name in ("num_params", "num_non_embedding_params"):
            self.__dict__.pop(name, None)

    def _validate_block(self, block: TransformerBlockBase) -> TransformerBlockBase:
        if not isinstance(block, SchemeBlock):
            raise UserError(f"SchemeTransformer needs SchemeBlock blocks, got {type(block).__name__}")
        return block

    # ---- initialisation ----------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, **kwargs: Any) -> torch.Generator:
        """OLMo-core's ``init_weights`` (the scheme reset with it: from a fresh build's tensors once
        they are DTensors), then the scheme's requirements on :meth:`branch_weights` with
        OLMo-core's generator."""
        scheme = self.scheme
        if any(isinstance(t, DTensor) for t in (*scheme.parameters(), *scheme.buffers())):
            # shadows the method during OLMo-core's reset of every module
            scheme.reset_parameters = partial(self._reset_distributed_scheme, kwargs.get("device"))
        try:
            generator = super().init_weights(**kwargs)
        finally:
            scheme.__dict__.pop("reset_parameters", None)
        honour_requirements(self.branch_weights(), self.scheme.requires, generator=generator)
        return generator

    def branch_weights(self) -> list[BranchWeight]:
        """The weights a scheme's requirements apply to, in the order they are drawn: each
        block's q, k, v, out (gained but q and k) and its feed-forward's w1, w3, w2."""
        out = []
        for b, block in self.blocks.items():
            att, ff = block.attention, getattr(block, "feed_forward", None)   # MoE: .moe
            linears = [(att.w_q, False), (att.w_k, False), (att.w_v, True), (att.w_out, True)]
            if ff is not None:
                linears += [(ff.w1, True), (ff.w3, True), (ff.w2, True)]
            out += [BranchWeight(linear.weight, linear.bias, gained, 2 * int(b))
                    for linear, gained in linears]
        return out

    @torch.no_grad()
    def _reset_distributed_scheme(self, device: torch.device | None) -> None:
        fresh = self._scheme_build(device=device or self.device)
        values = dict(fresh.named_parameters()) | dict(fresh.named_buffers())
        for name, t in (*self.scheme.named_parameters(), *self.scheme.named_buffers()):
            value = values[name].to(t.dtype)
            if isinstance(t, DTensor):
                get_local_tensor(t).copy_(get_local_tensor(distribute_like(t, value)))
            else:
                t.copy_(value)

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
            raise NotImplementedError(PP_REFUSAL)
        if input_embeddings is not None and self._cp_load_balancer is not None:
            raise RuntimeError("`input_embeddings` is not supported with context parallelism")
        input_ids, labels, all_block_kwargs, per_block_kwargs, lm_head_kwargs = self._prepare_inputs(
            input_ids, labels, ignore_index=ignore_index, loss_reduction=loss_reduction,
            z_loss_multiplier=z_loss_multiplier, loss_div_factor=loss_div_factor,
            return_logits=return_logits, logits_to_keep=logits_to_keep, **kwargs)
        if input_embeddings is not None:
            h = replicated(self._tp_mesh, input_embeddings.to(self.device))
        else:
            h = replicated(self._tp_mesh, self.embeddings(input_ids))
            if self.embed_scale is not None:
                h = h * self.embed_scale
            if self.embedding_norm is not None:
                h = self.embedding_norm(h)
        if not torch.compiler.is_compiling():   # outside the compiled blocks (views.py)
            for view in self._scheme_views:
                view.refresh()
        state = map_state(local, self.scheme.enter(h))    # plain tensors between blocks (apply_tp)
        if self.compile_enabled:
            state = like_a_block_output(state)
        for key, block in self.blocks.items():
            if self.compile_enabled:
                self._mark_dynamic(state)
            state = block(state, **all_block_kwargs, **per_block_kwargs.get(int(key), {}))
        h = self.scheme.exit(map_state(partial(replicated, self._tp_mesh), state))
        if self.compile_enabled:
            mark_dynamic(h, (0, 1), strict=False)
            if labels is not None:
                mark_dynamic(labels, (0, 1), strict=False)
        if labels is not None:
            lm_head_kwargs["labels"] = labels
        return self.lm_head(h, **lm_head_kwargs)

    # ---- parallelism -------------------------------------------------------------------------
    def apply_pp(self, pp_mesh: DeviceMesh):
        raise NotImplementedError(PP_REFUSAL)

    def apply_tp(self, tp_mesh: DeviceMesh, float8_enabled: bool | None = None) -> None:
        """Tensor parallelism over ``tp_mesh`` with every stream of the scheme's state whole on
        every rank (a replicated DTensor where the scheme computes), rather than OLMo-core's
        sequence sharding: no scheme needs a sharding rule, at the price of the scheme's
        elementwise work undivided and an all-reduce per sublayer (docs/olmo-core.md)."""
        if self.embeddings is None or self.lm_head is None:
            raise NotImplementedError(PP_REFUSAL)
        if self.tie_word_embeddings and self.lm_head.loss_implementation == LMLossImplementation.fused_linear:
            raise UserError("tensor parallelism with tied embeddings needs the default loss, not "
                              "fused_linear (OLMo-core shards the embedding over the vocabulary)")
        if float8_enabled is None:
            float8_enabled = self.fp8_enabled
        for block in self.blocks.values():   # every refusal before anything is distributed
            check_tp_degree(block, tp_mesh.size())
        # The lookup's output is local and made a replicated DTensor in forward: the gradient then
        # reaches the vocabulary-sharded table whole (a DTensor output would hand it a partial sum,
        # which the table's masked partial placement cannot take).
        parallelize_module(self.embeddings, device_mesh=tp_mesh, parallelize_plan=RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Replicate(), use_local_output=True))
        if self.embedding_norm is not None:
            distribute_module(self.embedding_norm, tp_mesh)
        distribute_module(self.scheme, tp_mesh)     # its parameters and buffers, replicated
        for block in self.blocks.values():
            cast(SchemeBlock, block).apply_tp(tp_mesh, input_layout=Replicate(),
                                              float8_enabled=float8_enabled)
        self.lm_head.apply_tp(tp_mesh, input_layouts=(Replicate(), Replicate()))
        if self.tie_word_embeddings:   # both are sharded over the vocabulary: tie them again
            self._tie_weights()
        self._tp_enabled = True
        self._tp_mesh = tp_mesh

    def apply_ddp(self, *args: Any, **kwargs: Any) -> None:
        if self._tp_enabled:
            raise UserError("DDP of a tensor-parallel model is not supported (OLMo-core's own "
                              "Transformer trains to wrong losses that way); use FSDP or HSDP")
        super().apply_ddp(*args, **kwargs)

    def apply_compile(self) -> None:
        """OLMo-core's per-block ``torch.compile``, Dynamo's recompile limit raised to one graph per
        block (a scheme such as AttnRes has one per block; past the limit blocks run uncompiled)."""
        config = torch._dynamo.config
        config.recompile_limit = max(config.recompile_limit, recompile_limit_for(len(self.blocks)))
        super().apply_compile()

    def apply_activation_checkpointing(self, mode: TransformerActivationCheckpointingMode,
                                       block_interval: int | None = None,
                                       modules: list[str] | None = None, **kwargs: Any) -> None:
        """OLMo-core's activation checkpointing; ``modules`` may not name the scheme's modules (its
        norms are read by ``scheme.step``, not called: wrapping them checkpoints nothing)."""
        if mode == TransformerActivationCheckpointingMode.selected_modules:
            scheme_names = [n for n, _ in self.named_modules() if n == "scheme" or n.startswith("scheme.")]
            hit = sorted({p for p in modules or () for n in scheme_names if fnmatch(n, p)})
            if hit:
                raise UserError(f"activation checkpointing modules {hit} match the scheme's modules; "
                                  "name blocks or their attention/feed_forward instead")
        super().apply_activation_checkpointing(mode, block_interval=block_interval, modules=modules,
                                               **kwargs)


def _meta_scheme(scheme: str, d_model: int, n_layers: int, norm: str, eps: float,
                 options: tuple) -> ResidualScheme:
    """The scheme of a config on the meta device, built (its options checked) once per distinct
    configuration: its requirements and parameter count are read from it."""
    try:
        return _cached_meta_scheme(get_scheme_class(scheme), d_model, n_layers, norm, eps, options)
    except TypeError:       # an unhashable option value
        return build_scheme(scheme, d_model, n_layers, norm=norm, eps=eps, device="meta", **dict(options))


@lru_cache(maxsize=32)
def _cached_meta_scheme(cls: type[ResidualScheme], d_model: int, n_layers: int, norm: str, eps: float,
                        options: tuple) -> ResidualScheme:
    return build_scheme(cls.name, d_model, n_layers, norm=norm, eps=eps, device="meta", **dict(options))


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

    def check_sizes(self, owner: str = "config") -> None:
        """Refuse, in one line, sizes our ``LMConfig`` refuses (``owner`` names the config), before
        OLMo-core resolves ``n_layers`` block configs."""
        for name in ("d_model", "vocab_size", "n_layers"):
            positive_int(owner, name, getattr(self, name))
        buildable(owner, self.n_layers, 0)
        overrides = self.block_overrides or {}
        if not isinstance(overrides, dict):
            raise UserError(f"{owner}.block_overrides must map block indices to block configs, got "
                            f"{type(overrides).__name__}")
        blocks = [("block", self.block)]
        for i, block in overrides.items():
            if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < self.n_layers:
                raise UserError(f"{owner}.block_overrides names block {i!r}, not one of the "
                                f"{self.n_layers} blocks (0 to {self.n_layers - 1})")
            blocks.append((f"block_overrides[{i}]", block))
        for where, block in blocks:
            _check_block_sizes(f"{owner}.{where}", block)

    def _scheme_on_meta(self) -> ResidualScheme:
        self.check_sizes()
        refuse_dyt(self.norm)
        return _meta_scheme(self.scheme, self.d_model, self.n_layers, self.norm, self.norm_eps,
                            tuple(self.scheme_options.items()))

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
        moe = any(c.feed_forward_moe is not None for c in self.resolved_block_configs)
        model = (MOE["model"] if moe else SchemeTransformer)(
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
