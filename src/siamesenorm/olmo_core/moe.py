"""Mixture-of-experts scheme blocks: OLMo-core's dropless MoE as the feed-forward sublayer, run by the
scheme (docs/olmo-core.md, "Mixture of experts")."""

from __future__ import annotations

import warnings
from typing import Any, cast

import torch
from olmo_core.nn.attention import AttentionConfig
from olmo_core.nn.buffer_cache import BufferCache
from olmo_core.nn.layer_norm import LayerNormConfig
from olmo_core.nn.moe import DroplessMoE, MoEBase, MoEConfig, MoEType
from olmo_core.nn.moe.parallel_mlp import ParallelDroplessMLP
from olmo_core.nn.moe.router import MoELinearRouter
from olmo_core.nn.transformer import MoETransformer
from olmo_core.nn.transformer.config import (
    TransformerActivationCheckpointingMode,
    TransformerDataParallelWrappingStrategy,
)
from olmo_core.ops import moe as moe_ops
from torch import Tensor
from torch.distributed import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import UserError
from ..models.host import BranchWeight
from .model import MOE, SchemeBlock, SchemeTransformer

__all__ = ["CheckpointSafeRouter", "PortableDroplessMLP", "SchemeMoEBlock", "SchemeMoETransformer",
           "check_moe_config"]


def check_moe_config(config: MoEConfig) -> None:
    """Refuse an MoE config a scheme block cannot run (one line each)."""
    if not isinstance(config, MoEConfig):
        raise UserError(f"feed_forward_moe must be an OLMo-core MoEConfig, got {type(config).__name__}")
    if config.name != MoEType.dropless:
        raise UserError(f"MoE scheme blocks are dropless (MoEType.dropless), got {config.name!r}: "
                          "the capacity-factor MoE drops tokens and needs OLMo-core's Triton kernels")


# ---- the router -------------------------------------------------------------------------------
class CheckpointSafeRouter(MoELinearRouter):
    """OLMo-core's linear router, whose running sums (tokens per expert, the losses the metrics report)
    do not count a forward twice when activation checkpointing recomputes it."""

    @classmethod
    def adopt(cls, moe: MoEBase) -> MoEBase:
        if type(moe.router) is not MoELinearRouter:
            raise UserError(f"expected OLMo-core's linear router, got {type(moe.router).__name__}")
        moe.router.__class__ = cls
        return moe

    def _running_sums(self) -> list[Tensor]:
        sums = (self.batch_size_per_expert, self.load_balancing_loss, self.z_loss,
                self.score_bias_batch_size_per_expert)
        return [t for t in sums if t is not None]

    def forward(self, x: Tensor, **kwargs: Any):
        if torch._C._current_graph_task_id() == -1:     # a forward pass, not a recomputation
            return super().forward(x, **kwargs)
        # kept and restored out of sight of selective checkpointing, which replays the forward's ops
        with torch.no_grad(), _disable_current_modes():
            kept = [t.clone() for t in self._running_sums()]
        out = super().forward(x, **kwargs)
        with torch.no_grad(), _disable_current_modes():
            for t, k in zip(self._running_sums(), kept):
                t.copy_(k)
        return out


# ---- the experts' dispatcher -----------------------------------------------------------------
class PortableDroplessMLP(ParallelDroplessMLP):
    """OLMo-core's dropless expert dispatcher with a plain-PyTorch token permutation where its Triton
    kernels cannot run (CPU), with or without expert parallelism (``all_to_all_single``)."""

    @staticmethod
    def kernels_run(x: Tensor) -> bool:
        return x.is_cuda and moe_ops.kernels is not None

    @classmethod
    def adopt(cls, moe: MoEBase) -> MoEBase:
        if type(moe.experts) is not ParallelDroplessMLP:
            raise UserError(f"expected OLMo-core's ParallelDroplessMLP experts, got "
                              f"{type(moe.experts).__name__}")
        moe.experts.__class__ = cls
        return moe

    def _combine(self, out: Tensor, assignment: Tensor, weights: Tensor, tokens: int) -> Tensor:
        """Sum each expert output row, times its assignment's weight, onto its token."""
        out = out * weights[assignment].unsqueeze(-1).to(out.dtype)
        total = out.new_zeros(tokens, out.shape[-1])
        return total.index_add(0, torch.div(assignment, self.top_k, rounding_mode="floor"), out)

    def forward_once(self, x: Tensor, *, expert_weights: Tensor, expert_indices: Tensor,
                     indices: Tensor, bin_ids: Tensor, bins: Tensor,
                     batch_size_per_expert: Tensor) -> Tensor:
        if self.kernels_run(x):
            return super().forward_once(x, expert_weights=expert_weights,
                                        expert_indices=expert_indices, indices=indices,
                                        bin_ids=bin_ids, bins=bins,
                                        batch_size_per_expert=batch_size_per_expert)
        assignment = indices.long()
        rows = x[torch.div(assignment, self.top_k, rounding_mode="floor")]
        out = self.mlp(rows, batch_size_per_expert)
        return self._combine(out, assignment, expert_weights, x.shape[0])

    def parallel_forward_once(self, x: Tensor, *, expert_weights: Tensor, expert_indices: Tensor,
                              indices: Tensor, bin_ids: Tensor, bins: Tensor,
                              batch_size_per_expert: Tensor) -> Tensor:
        if self.kernels_run(x):
            return super().parallel_forward_once(
                x, expert_weights=expert_weights, expert_indices=expert_indices, indices=indices,
                bin_ids=bin_ids, bins=bins, batch_size_per_expert=batch_size_per_expert)
        if self.hidden_sharding_degree != 1:
            raise NotImplementedError("experts sharded over their hidden size are not supported here")
        world, local = self.ep_world_size, self.num_local_experts
        assignment = indices.long()
        rows = x[torch.div(assignment, self.top_k, rounding_mode="floor")]
        # Rank r holds experts r * local .. (r + 1) * local - 1, so the rows, sorted by expert, are
        # already grouped by the rank they go to. Counts first: received[s, e] = the rows rank s
        # sends to local expert e.
        with torch.no_grad():
            sent = batch_size_per_expert.to(torch.long)
            received = torch.empty_like(sent)
            torch.distributed.all_to_all_single(received, sent, group=self.ep_pg)
            sent, received = sent.view(world, local), received.view(world, local)
            send_splits, recv_splits = sent.sum(1).tolist(), received.sum(1).tolist()
            # the received rows come grouped by source rank, then expert: sort them by expert
            expert_of_row = torch.arange(local, device=x.device).repeat(world).repeat_interleave(
                received.flatten(), output_size=sum(recv_splits))
            order = expert_of_row.argsort(stable=True)
            unorder = order.argsort()
        incoming, handle = moe_ops.all_to_all(rows, recv_splits, send_splits, group=self.ep_pg,
                                              async_op=True)
        handle.wait()
        out = self.mlp(incoming[order], received.sum(0))[unorder]
        back, handle = moe_ops.all_to_all(out, send_splits, recv_splits, group=self.ep_pg,
                                          async_op=True)
        handle.wait()
        return self._combine(back, assignment, expert_weights, x.shape[0])


# ---- the block -------------------------------------------------------------------------------
class SchemeMoEBlock(SchemeBlock):
    """Block ``block_idx`` with OLMo-core's dropless MoE as sublayer ``2 * block_idx + 1``; the MoE gets
    the train module's ``loss_div_factor`` for its auxiliary losses."""

    def __init__(self, *, d_model: int, block_idx: int, n_layers: int,
                 sequence_mixer: AttentionConfig, feed_forward_moe: MoEConfig,
                 qkv_norm: LayerNormConfig | None = None, dropout: float = 0.0,
                 init_device: str = "cpu", cache: BufferCache | None = None) -> None:
        check_moe_config(feed_forward_moe)
        super().__init__(d_model=d_model, block_idx=block_idx, n_layers=n_layers,
                         sequence_mixer=sequence_mixer, feed_forward=None, qkv_norm=qkv_norm,
                         dropout=dropout, init_device=init_device, cache=cache)
        with warnings.catch_warnings():
            if not torch.cuda.is_available():   # grouped_gemm is a CUDA kernel: no loss on CPU
                warnings.filterwarnings("ignore", message="Grouped GEMM not available")
            moe = feed_forward_moe.build(d_model, n_layers=n_layers, init_device=init_device,
                                         cache=cache)
        self.feed_forward_moe = cast(DroplessMoE, CheckpointSafeRouter.adopt(PortableDroplessMLP.adopt(moe)))
        self._ep_enabled = False

    @property
    def is_moe(self) -> bool:
        return True

    @property
    def ep_enabled(self) -> bool:
        return self._ep_enabled

    @property
    def tp_enabled(self) -> bool:
        return False

    def compute_metrics(self, reset: bool = True) -> dict[str, tuple[Tensor, Any]]:
        return self.feed_forward_moe.compute_metrics(reset=reset)

    def reset_metrics(self) -> None:
        self.feed_forward_moe.reset_metrics()

    def forward(self, x: Any, *, loss_div_factor: Tensor | float | None = None, **kwargs: Any) -> Any:
        scheme, i = self._view_scheme(), self.view.first
        state = scheme.step(x, i, self._branch(self.attention, kwargs))
        moe_kwargs = {} if loss_div_factor is None else {"loss_div_factor": loss_div_factor}
        return scheme.step(state, i + 1, self._branch(self.feed_forward_moe, moe_kwargs))

    def apply_ep(self, ep_mesh: DeviceMesh, **kwargs: Any) -> None:
        """OLMo-core's expert parallelism: whole experts sharded over ``ep_mesh``, the router replicated."""
        self.feed_forward_moe.apply_ep(ep_mesh, **kwargs)
        self._ep_enabled = True

    def apply_tp(self, tp_mesh: DeviceMesh, *, input_layout: Any = None, float8_enabled: bool = False):
        raise NotImplementedError("tensor parallelism of MoE scheme blocks is not supported; use "
                                  "expert parallelism (OLMo-core has no TP together with EP)")

    def apply_cp(self, cp_mesh: DeviceMesh, ring: Any = None, uly: Any = None):
        self.attention.apply_cp(cp_mesh, ring=ring, uly=uly)
        self.feed_forward_moe.apply_cp(cp_mesh)

    def apply_fsdp(self, dp_mesh: DeviceMesh | None = None, prefetch_factor: int = 0,
                   wrapping_strategy: TransformerDataParallelWrappingStrategy = (
                       TransformerDataParallelWrappingStrategy.full),
                   **fsdp_kwargs: Any) -> None:
        if wrapping_strategy == TransformerDataParallelWrappingStrategy.fine_grained:
            att = cast(FSDPModule, fully_shard(self.attention, mesh=dp_mesh, **fsdp_kwargs))
            moe = cast(FSDPModule, fully_shard(self.feed_forward_moe, mesh=dp_mesh, **fsdp_kwargs))
            root = cast(FSDPModule, fully_shard(self, mesh=dp_mesh, **fsdp_kwargs))
            if prefetch_factor > 0:
                root.set_modules_to_forward_prefetch([att])
                att.set_modules_to_forward_prefetch([moe])
        else:
            fully_shard(self, mesh=dp_mesh, **fsdp_kwargs)

    def num_flops_per_token(self, seq_len: int) -> int:
        return (self.attention.num_flops_per_token(seq_len)
                + self.feed_forward_moe.num_flops_per_token(seq_len))


# ---- the model -------------------------------------------------------------------------------
class SchemeMoETransformer(SchemeTransformer, MoETransformer):
    """A :class:`SchemeTransformer` with MoE blocks; also an OLMo-core ``MoETransformer`` (metrics, expert
    parallelism, the router's ``post_batch``)."""

    def branch_weights(self) -> list[BranchWeight]:
        """:class:`SchemeTransformer`'s, then each MoE block's router (gain 1) and its experts' w1, w3, w2,
        one matrix per expert."""
        out = super().branch_weights()
        for b, block in self.blocks.items():
            if not isinstance(block, SchemeMoEBlock):
                continue
            moe = block.feed_forward_moe
            router, mlp = moe.router, moe.experts.mlp
            out.append(BranchWeight(router.weight, None, False, 2 * int(b) + 1, "router",
                                    (router.num_experts, router.d_model)))
            out += [BranchWeight(w, None, True, 2 * int(b) + 1, name, (mlp.hidden_size, mlp.d_model))
                    for name, w in (("w1", mlp.w1), ("w3", mlp.w3), ("w2", mlp.w2))]
        return out

    def apply_tp(self, tp_mesh: DeviceMesh, float8_enabled: bool | None = None) -> None:
        raise NotImplementedError("tensor parallelism of MoE scheme models is not supported; use "
                                  "expert parallelism (OLMo-core has no TP together with EP)")

    def apply_activation_checkpointing(self, mode: TransformerActivationCheckpointingMode,
                                       block_interval: int | None = None,
                                       modules: list[str] | None = None, **kwargs: Any) -> None:
        """OLMo-core's activation checkpointing, MoE blocks included; ``selected_modules`` must not name a
        whole MoE module (OLMo-core's rule)."""
        if mode == TransformerActivationCheckpointingMode.selected_modules:
            from fnmatch import fnmatch
            names = [n for n, m in self.named_modules() if isinstance(m, MoEBase)]
            hit = sorted({p for p in modules or () for n in names if fnmatch(n, p)})
            if hit:
                raise UserError(f"activation checkpointing modules {hit} match whole MoE modules, "
                                  "which OLMo-core does not wrap; name modules inside them")
        super().apply_activation_checkpointing(mode, block_interval=block_interval, modules=modules,
                                               **kwargs)


MOE.update(check=check_moe_config, block=SchemeMoEBlock, model=SchemeMoETransformer)
