"""A Hugging Face family model as a language model of our commands (``model.family``): the family's
causal LM adapted to ``model.scheme`` (:func:`siamesenorm.hf.adapt`), its configuration made from
the ``model`` fields as LMConfig declares them (:func:`family_config`) with ``model.family_options``
on top. Data, training and diagnostics are ours (:class:`FamilyLM`).
"""

from __future__ import annotations

import inspect
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from ..errors import UserError
from ..models.host import SchemeHost
from ..models.lm import lm_flops_per_token, lm_loss
from ..models.lm_config import carried, value_on
from ..nn.fused import POINTWISE_KINDS
from .adapted import adapt, adapted_class
from .families import FAMILIES

__all__ = ["OWN_FIELDS", "FamilyLM", "check_family_config", "family_config"]

# The family's configuration fields a run's ``model`` section sets (family field -> our key), as
# LMConfig declares them: ``model.family_options`` may not restate them (the run would train one
# size while its header and config.yaml say another).
OWN_FIELDS = {to.where: f"model.{name}" for name, to in carried("family")}


class FamilyOutput(NamedTuple):
    logits: Tensor
    loss: Tensor | None


def family_config(cfg: Any) -> Any:
    """The transformers configuration of ``cfg`` (an :class:`~siamesenorm.models.LMConfig` with
    ``family`` set): our fields in the family's names, then ``family_options`` on top."""
    import transformers

    family = FAMILIES[cfg.family]
    cls = getattr(transformers, family.config_class)
    accepted = set(inspect.signature(cls.__init__).parameters)
    values = {to.where: value_on(cfg, name, to) for name, to in carried("family")
              if family.moe or not name.startswith("moe.")}
    values.update(hidden_act="silu", use_cache=False)
    if family.moe:
        values["mlp_only_layers"] = []
        if cfg.family == "olmoe":       # OLMoE's experts are intermediate_size wide
            values["intermediate_size"] = cfg.moe.expert_hidden(cfg.dim)
    if family.norm == "gemma":          # q scaled by 1 / sqrt(head_dim) (its MLP: gated GELU)
        values["query_pre_attn_scalar"] = cfg.head_dim
    values = {k: v for k, v in values.items() if k in accepted or k == "rope_theta"}
    options = dict(cfg.family_options)      # checked with the configuration (check_family)
    attn = options.pop("attn_implementation", "sdpa")
    config = cls(**{**values, **options})
    config._attn_implementation = attn
    return config


def _norm(cfg: Any) -> str | None:
    """``adapt``'s ``norm``: DyT or Derf replace the family's norms; rmsnorm and layernorm name its
    own (``None``), and layernorm only a family whose own norms are LayerNorms."""
    if cfg.norm == "layernorm" and FAMILIES[cfg.family].norm != "olmo":
        raise UserError(f"model.norm=layernorm: {cfg.family}'s own norms are RMSNorm; model.norm names "
                        "them (rmsnorm) or replaces them (dyt, derf)")
    return cfg.norm if cfg.norm in POINTWISE_KINDS else None


def check_family_config(cfg: Any) -> None:
    """Refuse, in one line and before anything is built, ``model.family_options`` that restate a
    ``model.*`` field, an attention implementation this machine cannot run (a missing FlashAttention,
    an unknown name, a kernel from the Hub, which is never fetched), and values the family's
    configuration rejects (a ``layer_types`` of the wrong length)."""
    family = FAMILIES[cfg.family]
    _norm(cfg)
    if cfg.qk_norm and not family.qk_norm:      # it was dropped without a word
        with_one = ", ".join(name for name, f in FAMILIES.items() if f.qk_norm)
        raise UserError(f"model.qk_norm=true is not available with model.family={cfg.family} (its "
                        f"attention has no QK-norm; {with_one} have their own); set model.qk_norm=false "
                        "or choose one of those")
    restated = sorted(set(cfg.family_options) & set(OWN_FIELDS))
    if restated:
        key = restated[0]
        raise UserError(f"model.family_options.{key} restates {OWN_FIELDS[key]}: set {OWN_FIELDS[key]} "
                        "instead (family_options hold only what the model section does not set)")
    try:
        config = family_config(cfg)
    except Exception as error:      # transformers' validators raise ValueError, TypeError or their own
        first = (str(error).strip().splitlines() or [type(error).__name__])[-1].strip()
        raise UserError(f"model.family_options: {family.config_class} refuses them: {first}") from None
    attn = config._attn_implementation
    if "/" in attn:
        raise UserError(f"model.family_options.attn_implementation={attn}: a kernel from the Hugging Face "
                        "Hub is not fetched; give eager, sdpa, flex_attention or an installed "
                        "flash_attention_N")
    causal = adapted_class(cfg.family)._family_class
    probe = causal.__new__(causal)          # its class's checks, without building the model
    nn.Module.__init__(probe)
    probe.config = config
    try:
        probe._check_and_adjust_attn_implementation(attn, is_init_check=True)
    except (ValueError, ImportError) as error:
        first = str(error).strip().splitlines()[0]
        raise UserError(f"model.family_options.attn_implementation={attn}: {first}") from None


class FamilyLM(nn.Module, SchemeHost):
    """The adapted family model (``hf``) behind the interface our engine, probes and analysis use:
    ``model(x, y)`` with already shifted targets ``y`` (``-100`` ignored) returns ``(logits,
    loss)``; in training an MoE family's loss adds its router's auxiliary loss, weighted by
    ``model.moe.aux_loss`` (``loss_parts`` keeps the parts). ``scheme`` and ``sublayers`` are the
    adapted model's own, ``embed`` and ``lm_head`` its embedding and head."""

    def __init__(self, cfg: Any, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = cfg
        with torch.device(device if device is not None else torch.get_default_device()):
            self.hf = adapt(family_config(cfg), cfg.scheme, norm=_norm(cfg),
                            depth_attention=cfg.depth_attention,
                            depth_attention_stride=cfg.depth_attention_stride, **cfg.scheme_options)
        self.moe = FAMILIES[cfg.family].moe
        self.loss_parts: dict[str, Tensor] = {}

    @property
    def scheme(self):
        return self.hf.model.stack.scheme

    @property
    def sublayers(self) -> nn.ModuleList:
        return self.hf.model.stack.sublayers

    @property
    def embed(self) -> nn.Module:
        return self.hf.model.embed_tokens

    @property
    def lm_head(self) -> nn.Module | None:
        return None if self.config.tie_embeddings else self.hf.lm_head

    def moe_layers(self) -> list:
        return []       # the family's router statistics are its own (the aux loss is logged)

    def forward(self, x: Tensor, y: Tensor | None = None) -> FamilyOutput:
        router = self.moe and self.training and y is not None
        out = self.hf(input_ids=x, output_router_logits=router) if router else self.hf(input_ids=x)
        loss = None
        if y is not None:
            extra = [("aux_loss", self.config.moe.aux_loss, out.aux_loss)] \
                if router and out.aux_loss is not None else []
            loss, parts = lm_loss(out.logits, y, extra)
            if parts:
                self.loss_parts = parts
        return FamilyOutput(out.logits, loss)

    @torch.no_grad()
    def generate(self, x: Tensor, max_new_tokens: int, *, temperature: float = 1.0,
                 top_k: int | None = None, greedy: bool = False, use_cache: bool = True,
                 generator: torch.Generator | None = None) -> Tensor:
        """``x`` and ``max_new_tokens`` more tokens, as our language model's ``generate``, through the
        family's own ``generate`` (sampling seeded from ``generator``)."""
        sample = not (greedy or temperature == 0)
        seed = int(torch.randint(0, 2**62, (1,), generator=generator)) if generator is not None else None
        with torch.random.fork_rng(devices=[]):
            if seed is not None:
                torch.manual_seed(seed)
            options = {"temperature": temperature, "top_k": top_k or 0} if sample else {}
            return self.hf.generate(x, max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                    do_sample=sample, use_cache=use_cache, pad_token_id=0,
                                    eos_token_id=None, **options)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def tokens_in(self, x: Tensor) -> int:
        return x.numel()

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """:func:`~siamesenorm.models.lm.lm_flops_per_token`, as for our language model, of the
        parameters but the embedding; an MoE counts every expert (an upper bound: a token uses
        ``top_k`` of them)."""
        return lm_flops_per_token(self.config, self.num_parameters() - self.embed.weight.numel(),
                                  seq_len)

    def reset_parameters(self) -> None:
        self.hf.init_weights()
