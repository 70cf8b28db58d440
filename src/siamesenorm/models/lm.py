"""Decoder-only language model: embedding, a residual scheme over bare attention/MLP sublayers
(``ResidualStack``'s one loop), and a head. The scheme owns every norm and residual add."""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..nn.attention import Attention, KVCache
from ..nn.depth_attention import DepthKeysValues
from ..nn.mlp import build_mlp
from ..nn.moe import MoE
from ..nn.norms import set_llm_dyt_alpha0
from ..nn.value_residual import FirstValues
from .host import (
    BranchWeight,
    SchemeHost,
    branch_weights,
    build_sublayers,
    honour_requirements,
    reset_sublayer_norms,
    rng_devices,
)
from .lm_config import LMConfig
from .stack import ResidualStack

__all__ = ["LMConfig", "LMOutput", "LanguageModel", "lm_flops_per_token", "lm_loss"]


class LMOutput(NamedTuple):
    """``logits``: ``(B, T, vocab_size)``; ``loss``: mean cross-entropy or ``None``."""

    logits: Tensor
    loss: Tensor | None


def lm_loss(logits: Tensor, targets: Tensor,
            extra: Sequence[tuple[str, float, Tensor]] = ()) -> tuple[Tensor, dict[str, Tensor]]:
    """Mean cross-entropy of ``logits`` against shifted ``targets`` (``-100`` ignored), in float32
    at least, plus each ``(name, weight, loss)`` of ``extra``; returns the loss and its detached
    parts (none without ``extra``). Our model and a family's take their loss from here."""
    wide = torch.promote_types(logits.dtype, torch.float32)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(wide), targets.reshape(-1),
                           ignore_index=-100)
    if not extra:
        return loss, {}
    parts = {"ce_loss": loss.detach()} | {name: part.detach() for name, _, part in extra}
    for _, weight, part in extra:
        loss = loss + weight * part
    return loss, parts


def lm_flops_per_token(config: LMConfig, non_embedding_params: int,
                       seq_len: int | None = None) -> float:
    """Training FLOPs per token at context ``seq_len``: ``6 * N + 12 * n_layers * n_heads *
    head_dim * seq_len``, ``N`` the non-embedding parameters plus a tied output projection."""
    seq_len = config.max_seq_len if seq_len is None else seq_len
    n = non_embedding_params + (config.vocab_size * config.dim if config.tie_embeddings else 0)
    return float(6 * n + 12 * config.n_layers * config.n_heads * config.head_dim * seq_len)


def _normal(weight: Tensor, std: float, truncated: bool) -> None:
    if truncated:
        nn.init.trunc_normal_(weight, 0.0, std, -3.0 * std, 3.0 * std)
    else:
        nn.init.normal_(weight, 0.0, std)


class LanguageModel(ResidualStack, SchemeHost):
    """Causal language model of an :class:`LMConfig`: ``embed`` (also the head when tied),
    ``scheme``, ``sublayers`` (attention at even indices, MLP at odd), ``lm_head`` (untied, else
    ``None``), ``embed_scale`` (``config.embed_scale``'s learnable scalar, else ``None``)."""

    def __init__(self, config: LMConfig, device=None, dtype=None) -> None:
        super().__init__()
        self.config = cfg = config
        self.loss_parts: dict[str, Tensor] = {}     # an MoE model's last training loss, by part
        kw = {"device": device, "dtype": dtype}
        # Fork the generator so that the default inits below leave the caller's state to
        # reset_parameters(), exactly as a meta-device build followed by reset_parameters() does.
        with torch.random.fork_rng(**rng_devices(device)):
            self.scheme = cfg.resolved_scheme.build(cfg.dim, cfg.n_layers, norm=cfg.norm,
                                                    eps=cfg.norm_eps, **kw)
            self.embed = nn.Embedding(cfg.vocab_size, cfg.dim, **kw)
            self.sublayers = build_sublayers(
                self.scheme,
                lambda block, qkv_norm: Attention(
                    cfg.dim, cfg.n_heads, cfg.kv_heads, max_seq_len=cfg.max_seq_len,
                    rope_theta=cfg.rope_theta, qk_norm=cfg.qk_norm, qkv_norm=qkv_norm,
                    norm=cfg.norm, norm_eps=cfg.norm_eps, bias=cfg.bias, dropout=cfg.dropout,
                    layer_idx=block, value_residual=cfg.value_residual_mix if cfg.value_residual else None,
                    value_weights=cfg.value_weights, head_dim=cfg.head_size,
                    qk_norm_per_head=cfg.qk_norm_per_head, depth_attention=cfg.depth_attention,
                    **kw),
                lambda block: self._mlp(block, kw))
            self.lm_head: nn.Linear | None = None
            if not cfg.tie_embeddings:
                self.lm_head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False, **kw)
            self.embed_scale: nn.Parameter | None = None
            if cfg.embed_scale is not None:
                self.embed_scale = nn.Parameter(torch.empty(1, **kw))
        if cfg.norm == "dyt":   # the DyT paper's LLM alpha0 (attention / other, by width)
            set_llm_dyt_alpha0(self, cfg.dim)
        self.reset_parameters()

    def _mlp(self, block: int, kw: dict) -> nn.Module:
        """Block ``block``'s feed-forward: a mixture of experts where ``config.moe`` says so."""
        cfg, moe = self.config, self.config.moe
        if moe.is_moe(block):
            return MoE(cfg.dim, moe.n_experts, moe.top_k, moe.expert_hidden(cfg.dim),
                       shared_hidden=moe.shared_hidden, normalize=moe.normalize, **kw)
        return build_mlp(cfg.mlp, cfg.dim, cfg.hidden_dim, bias=cfg.bias, dropout=cfg.dropout, **kw)

    def moe_layers(self) -> list[MoE]:
        """The mixture-of-experts feed-forwards, in block order (empty for a dense model)."""
        return [m for m in self.sublayers if isinstance(m, MoE)]

    # ---- initialisation ----------------------------------------------------------------------
    def _expert_weights(self) -> list[BranchWeight]:
        """Every MoE's expert matrices (and its shared expert's), in block order, all gained."""
        out = []
        for i, moe in enumerate(self.sublayers):
            if not isinstance(moe, MoE):
                continue
            out += [BranchWeight(moe.w_gate, None, True, i, "w_gate"),
                    BranchWeight(moe.w_up, None, True, i, "w_up"),
                    BranchWeight(moe.w_down, None, True, i, "w_down")]
            if moe.shared is not None:
                out += [BranchWeight(getattr(moe.shared, name).weight, None, True, i, f"shared.{name}")
                        for name in ("gate_proj", "up_proj", "down_proj")]
        return out

    def _init_expert_weight(self, expert: BranchWeight) -> None:
        """Each expert drawn as a dense MLP's projections of the same block (``config.init``)."""
        cfg = self.config
        mitchell = cfg.init == "mitchell"
        block = self.scheme.block_of(expert.sublayer)
        down = expert.name.endswith(("w_down", "down_proj"))
        for w in expert.weight.view(-1, *expert.weight.shape[-2:]):
            if not down:
                std = 1.0 / math.sqrt(cfg.dim) if mitchell else cfg.init_std
            elif mitchell:
                std = 1.0 / math.sqrt(2 * min(w.shape) * (block + 1))
            else:
                std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
            _normal(w, std, mitchell)

    def _init_branch_weight(self, branch: BranchWeight) -> None:
        """``config.init``'s draw for one sublayer weight (see :meth:`reset_parameters`)."""
        cfg = self.config
        mitchell = cfg.init == "mitchell"
        if branch.name not in ("out_proj", "down_proj"):
            std = 1.0 / math.sqrt(cfg.dim) if mitchell else cfg.init_std
        elif mitchell:
            fan = cfg.dim if branch.name == "out_proj" else cfg.hidden_dim
            std = 1.0 / math.sqrt(2 * fan * (self.scheme.block_of(branch.sublayer) + 1))
        else:
            std = cfg.init_std / math.sqrt(2 * cfg.n_layers)
        _normal(branch.weight, std, mitchell)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Re-initialise every parameter and buffer, in a fixed order, from the torch generator.

        ``normal``: N(0, init_std), out/down projections init_std / sqrt(2 * n_layers).
        ``mitchell`` (OLMo): truncated at 3 std; 1/sqrt(dim), out/down 1/sqrt(2 * fan_in * (l + 1)).
        Biases zero, norm weights one; the scheme's requirements (DeepNorm's Xavier, a branch gain)
        override the branch weights (:func:`~.host.honour_requirements`).
        """
        cfg = self.config
        mitchell = cfg.init == "mitchell"
        head_std = 1.0 / math.sqrt(cfg.dim) if mitchell else cfg.init_std
        self.scheme.reset_parameters()
        reset_sublayer_norms(self.sublayers)
        _normal(self.embed.weight, head_std, mitchell)
        requires = self.scheme.requires
        honour_requirements(branch_weights(self.sublayers), requires, native=self._init_branch_weight)
        honour_requirements(self._expert_weights(), requires, native=self._init_expert_weight)
        if self.lm_head is not None:
            _normal(self.lm_head.weight, head_std, mitchell)
        if self.embed_scale is not None:
            self.embed_scale.fill_(cfg.embed_scale_init)

    # ---- forward -----------------------------------------------------------------------------
    def new_cache(self, batch_size: int, max_len: int | None = None) -> KVCache:
        """An empty KV cache for ``batch_size`` sequences of up to ``max_len`` (max_seq_len) tokens."""
        cfg, weight = self.config, self.embed.weight
        return KVCache(cfg.n_layers, batch_size, cfg.kv_heads, max_len or cfg.max_seq_len,
                       cfg.head_dim, device=weight.device, dtype=weight.dtype)

    def forward(self, input_ids: Tensor, targets: Tensor | None = None, *,
                cache: KVCache | None = None, pos: int = 0, attention_mask: Tensor | None = None,
                positions: Tensor | None = None, states: list | None = None) -> LMOutput:
        """Logits for ``input_ids`` (``(B, T)``) at positions ``pos .. pos + T - 1``, and the loss
        against ``targets``. ``cache``: read and extended at ``pos``. ``attention_mask`` (``(B, pos
        + T)``, 0 for padding) keeps queries off padding and numbers positions by real tokens
        (unless ``positions`` gives them). ``states`` receives the scheme's state per block."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must have shape (batch, seq), got {tuple(input_ids.shape)}")
        b, t = input_ids.shape
        if pos + t > self.config.max_seq_len:
            raise ValueError(f"{pos + t} positions exceed max_seq_len={self.config.max_seq_len}")
        if attention_mask is not None:
            if attention_mask.shape != (b, pos + t):
                raise ValueError(f"attention_mask must have shape (batch, cached + new tokens) = "
                                 f"{(b, pos + t)}, got {tuple(attention_mask.shape)}")
            if positions is None:
                positions = (attention_mask.long().cumsum(-1) - 1).clamp_min(0)[:, pos:]
        attend = {"cache": cache, "pos": pos, "positions": positions, "key_mask": attention_mask}
        if self.config.value_residual:
            attend["first_values"] = FirstValues()      # layer 0's values, for the later layers
        if self.config.depth_attention:                 # the source layers' keys and values
            attend["depth_kv"] = DepthKeysValues(self.config.depth_stride)
        x = self.embed(input_ids)
        if self.embed_scale is not None:
            x = x * self.embed_scale
        h = self.run(F.dropout(x, self.config.dropout, self.training),
                     attention_kwargs=attend, states=states)
        head = self.embed.weight if self.lm_head is None else self.lm_head.weight
        logits = F.linear(h, head)
        if cache is not None:
            cache.length = pos + t
        loss = None
        if targets is not None:
            loss, parts = lm_loss(logits, targets, self._router_losses() if self.training else ())
            if parts:
                self.loss_parts = parts
        return LMOutput(logits, loss)

    def _router_losses(self) -> list[tuple[str, float, Tensor]]:
        """The MoE layers' summed load-balancing and z-losses of the last forward, with their weights."""
        layers = self.moe_layers()
        if not layers:
            return []
        moe = self.config.moe
        return [("aux_loss", moe.aux_loss, torch.stack([m.aux_loss for m in layers]).sum()),
                ("z_loss", moe.z_loss, torch.stack([m.z_loss for m in layers]).sum())]

    # ---- accounting --------------------------------------------------------------------------
    def tokens_in(self, input_ids: Tensor) -> int:
        """Tokens in the batch ``input_ids``: every id."""
        return input_ids.numel()

    def num_parameters(self, non_embedding: bool = False) -> int:
        """Number of parameters; ``non_embedding`` leaves out the token embedding (not the head)."""
        total = sum(p.numel() for p in self.parameters())
        return total - self.embed.weight.numel() if non_embedding else total

    def active_parameters(self, non_embedding: bool = False) -> int:
        """Parameters one token uses: the experts it is not routed to left out."""
        unused = sum(m.num_experts_unused_parameters() for m in self.moe_layers())
        return self.num_parameters(non_embedding) - unused

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """:func:`lm_flops_per_token` of the parameters one token uses."""
        return lm_flops_per_token(self.config, self.active_parameters(non_embedding=True), seq_len)

    # ---- generation --------------------------------------------------------------------------
    @staticmethod
    def _pick(logits: Tensor, temperature: float, top_k: int | None, greedy: bool,
              generator: torch.Generator | None) -> Tensor:
        """Next token ``(B, 1)`` from last-position logits ``(B, vocab)``."""
        if greedy or temperature == 0:
            return logits.argmax(dim=-1, keepdim=True)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
        if top_k is not None and top_k < logits.shape[-1]:
            kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        return torch.multinomial(logits.softmax(dim=-1), 1, generator=generator)

    @torch.no_grad()
    def generate(self, input_ids: Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int | None = None, greedy: bool = False, use_cache: bool = True,
                 generator: torch.Generator | None = None) -> Tensor:
        """``input_ids`` (``(B, T)``) and ``max_new_tokens`` more: greedy, or sampled from
        ``softmax(logits / temperature)`` (the ``top_k`` likeliest) drawing from ``generator``.
        ``use_cache``: one pass over the prompt, then one token at a time through a KV cache
        (everything within max_seq_len); else the last max_seq_len tokens re-run every step."""
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"input_ids must have shape (batch, seq>0), got {tuple(input_ids.shape)}")
        if max_new_tokens < 0 or temperature < 0 or (top_k is not None and top_k <= 0):
            raise ValueError("generate needs max_new_tokens >= 0, temperature >= 0 and top_k > 0; "
                              f"got {max_new_tokens}, {temperature}, {top_k}")
        total = input_ids.shape[1] + max_new_tokens
        if use_cache and total > self.config.max_seq_len:
            raise ValueError(f"prompt + max_new_tokens = {total} exceeds max_seq_len="
                             f"{self.config.max_seq_len}; use use_cache=False to slide the window")
        was_training = self.training
        self.eval()
        try:
            pick = partial(self._pick, temperature=temperature, top_k=top_k, greedy=greedy,
                           generator=generator)
            tokens = [input_ids]
            if max_new_tokens == 0:
                return input_ids
            if use_cache:
                cache = self.new_cache(input_ids.shape[0], total)
                logits = self(input_ids, cache=cache, pos=0).logits[:, -1]
                for step in range(max_new_tokens):
                    tokens.append(pick(logits))
                    if step + 1 < max_new_tokens:
                        logits = self(tokens[-1], cache=cache, pos=cache.length).logits[:, -1]
                return torch.cat(tokens, dim=1)
            seq = input_ids
            for _ in range(max_new_tokens):
                logits = self(seq[:, -self.config.max_seq_len:]).logits[:, -1]
                seq = torch.cat((seq, pick(logits)), dim=1)
            return seq
        finally:
            self.train(was_training)
