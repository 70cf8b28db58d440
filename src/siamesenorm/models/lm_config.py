"""The decoder-only language model's configuration, described once.

Each field declares beside its default (:func:`lm_field`): its check (from
:mod:`.config_checks`), how each other host of an LMConfig carries it (a Hugging Face family's
config, ``model.family``; OLMo-core's ``TransformerConfig``, both ways), which of its values a
host refuses and why, and its command-line help. The family config, the OLMo-core conversion, the
hosts' refusals and the help are made from these declarations (:func:`carried`, :meth:`check_host`,
:func:`help_lines`); a new option is declared here and used where it acts, nowhere else.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import textwrap
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import UserError
from ..nn.depth_attention import depth_stride
from ..nn.mlp import MLP_KINDS, default_mlp_hidden
from ..nn.norms import NORM_KINDS
from ..nn.value_residual import VALUE_RESIDUAL_MIXES
from . import config_checks as check
from .config_checks import MAX_EXPERT_LAYERS, MAX_EXPERTS, buildable, is_finite, linear

INIT_KINDS = ("normal", "mitchell")

# Where an LMConfig builds a model besides our LanguageModel, and how each names itself: a Hugging
# Face family's model (model.family; siamesenorm.hf.family_lm) and OLMo-core's (siamesenorm.olmo_core).
HOSTS = {"family": ("model.family={family}", "use our model (no model.family)"),
         "olmo_core": ("the OLMo-core model", "train it with our model")}


# ---- how a host carries a field ----------------------------------------------------------------
@dataclass(frozen=True)
class To:
    """Carried as ``where`` in the host's config: a family config's field, or a dotted path in
    OLMo-core's (``d_model``; ``attention.*``, ``feed_forward.*``, ``moe.*``: a block's parts; a
    tuple: several). ``value(cfg)`` is the value there (default: ours); ``back(value, src)`` ours
    from OLMo-core's (``src``: its config and block parts; default: the value as it is)."""

    where: str | tuple[str, ...]
    value: Callable[[Any], Any] | None = None
    back: Callable[[Any, Any], Any] | None = None

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.where,) if isinstance(self.where, str) else self.where


@dataclass(frozen=True)
class Refused:
    """Values the host cannot carry: any but ``allowed`` (``None``: any but the default)."""

    why: str
    allowed: tuple | None = None


@dataclass(frozen=True)
class Elsewhere:
    """Not a field of the host's config: the host decides it, or takes it in another way (why)."""

    why: str


Carriage = To | Refused | Elsewhere


@dataclass(frozen=True)
class LMField:
    """One field's description: its check (``owner`` names it in errors), each host's carriage."""

    check: check.Check
    owner: str
    family: tuple[Carriage, ...]
    olmo_core: tuple[Carriage, ...]
    needs: str = ""         # a flag field that must be true for this one to differ from its default
    help: str = ""


def lm_field(default: Any = dataclasses.MISSING, *, check: check.Check, family: Any, olmo_core: Any,
             owner: str = "LMConfig", needs: str = "", help: str = "",
             factory: Callable[[], Any] | None = None) -> Any:
    """A dataclass field with its :class:`LMField` description."""
    def many(c: Any) -> tuple[Carriage, ...]:
        return c if isinstance(c, tuple) else (c,)

    meta = {"lm": LMField(check, owner, many(family), many(olmo_core), needs, help)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@functools.cache
def description(cls: type) -> tuple[tuple[str, dataclasses.Field, LMField], ...]:
    """``(dotted name, field, description)`` of every field of ``cls``, a section's (``moe``)
    after it with its name as prefix."""
    out = []
    for f in dataclasses.fields(cls):
        if "lm" not in f.metadata:
            raise TypeError(f"{cls.__name__}.{f.name} is not declared with lm_field")
        out.append((f.name, f, f.metadata["lm"]))
        section = f.default_factory
        if isinstance(section, type) and dataclasses.is_dataclass(section):
            out += [(f"{f.name}.{name}", inner, spec) for name, inner, spec in description(section)]
    return tuple(out)


def carried(host: str) -> Iterator[tuple[str, To]]:
    """``(dotted name, To)`` of every LMConfig field ``host`` carries in its config."""
    for name, _, spec in description(LMConfig):
        for c in getattr(spec, host):
            if isinstance(c, To):
                yield name, c


def value_on(cfg: LMConfig, name: str, to: To) -> Any:
    """The value ``to`` carries of field ``name`` (dotted) of ``cfg``."""
    return to.value(cfg) if to.value is not None else _get(cfg, name)


def refusal(host: str, name: str) -> Refused | None:
    """What ``host`` refuses of the field ``name`` (dotted), if anything."""
    spec = next(s for n, _, s in description(LMConfig) if n == name)
    return next((c for c in getattr(spec, host) if isinstance(c, Refused)), None)


def help_lines() -> str:
    """The command-line help of the fields that have some, one entry each, wrapped."""
    out = []
    for name, _, spec in description(LMConfig):
        if spec.help:
            key = f"  model.{name}:"
            text = spec.help.replace("arXiv ", "arXiv\0")       # a citation stays on one line
            out.append(textwrap.fill(text, 100, initial_indent=f"{key:<25}", subsequent_indent=" " * 25,
                                     break_on_hyphens=False).replace("\0", " "))
    return "\n".join(out)


def _get(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        obj = getattr(obj, part)
    return obj


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


# ---- checks of our own ------------------------------------------------------------------------
# Upper bounds of the model's scales: past them a model builds with infinite weights (a value above
# float32's 3.4e38 is infinite when stored) or computes infinities in its first step. Each is far
# beyond what any recipe uses (shown beside it).
MAX_INIT_STD = 1.0                # GPT-2's 0.02; from 1 on, every layer multiplies by sqrt(dim)
MAX_EMBED_SCALE = 1e4             # the DyT paper's sqrt(dim): 64 at dim 4096
MAX_VALUE_RESIDUAL_WEIGHT = 100.0  # ResFormer's 0.5 and 0.5
MAX_LOSS_WEIGHT = 100.0           # OLMoE's 0.01 and 0.001 on its load-balancing and z-losses


def _embed_scale(owner: str, name: str, value: Any) -> None:
    if value is None or value == "sqrt_dim":
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not is_finite(value) \
            or not value > 0:
        raise UserError(f"{owner}.{name} must be a positive number, sqrt_dim or null, got {value!r}")
    if value > MAX_EMBED_SCALE:
        raise UserError(f"{owner}.{name} must be at most {MAX_EMBED_SCALE:g} (the start of the "
                        f"embedding's scale; the DyT paper's is sqrt(dim): sqrt_dim), got {value!r}")


def _family_name(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, str):
        raise UserError(f"{owner}.{name} must be a family name or empty, got {value!r}")


def _moe_section(owner: str, name: str, value: Any) -> None:
    if not isinstance(value, MoEConfig):
        raise UserError(f"{owner}.{name} must be an MoEConfig, got {value!r}")


def _check(config: Any) -> None:
    """Each field's own check, then that a field set away from its default has its flag on."""
    for name, _, spec in description(type(config)):
        if "." not in name:
            spec.check(spec.owner, name, getattr(config, name))
    for name, f, spec in description(type(config)):
        if "." not in name and spec.needs and not getattr(config, spec.needs) \
                and getattr(config, name) != _default(f):
            raise UserError(f"model.{name} is set but model.{spec.needs} is false; add "
                            f"model.{spec.needs}=true")


# ---- the mixture of experts -------------------------------------------------------------------
def _loss_weight_back(per_token: bool) -> Callable[[Any, Any], float]:
    """Our loss weight from OLMo-core's: undone its division over ``top_k`` (the load-balancing
    loss: its ``E / k * sum f P`` against our ``E * sum f P``) and, when it scales by depth, over
    the layers; rounded off the float noise. ``None`` (no loss) is 0."""
    def back(value: Any, src: Any) -> float:
        if value is None:
            return 0.0
        depth = src.config.n_layers if src.moe.scale_loss_by_num_layers else 1
        per = src.moe.router.top_k if per_token else 1
        return float(f"{value / depth / per:.15g}")
    return back


_MOE = "model.moe"
_LOSS_WEIGHT = check.Bounded(0, MAX_LOSS_WEIGHT, low_open=False,
                             what=" (a weight on the training loss; OLMoE's are 0.01 and 0.001)")
_NO_SHARED = "no family here has a shared expert"


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts feed-forward (:class:`~siamesenorm.nn.moe.MoE`, OLMoE arXiv 2409.02060).

    The MLP of every ``every``-th block (blocks ``every-1, 2*every-1, ...``; 0: none) is
    ``n_experts`` SwiGLU experts of size ``hidden`` (``None``: ``dim // 2``), ``top_k`` per token,
    renormalised when ``normalize``, plus a shared expert of size ``shared_hidden`` (0: none).
    ``aux_loss`` and ``z_loss`` weigh the load-balancing and router z-losses. Defaults: OLMoE's.
    """

    every: int = lm_field(0, check=check.Count("dense"), owner=_MOE,
                          family=To("decoder_sparse_step", lambda c: max(c.moe.every, 1)),
                          olmo_core=Elsewhere("the blocks given feed_forward_moe (block_overrides)"))
    n_experts: int = lm_field(64, check=check.positive_int, owner=_MOE, family=To("num_experts"),
                              olmo_core=To("moe.num_experts"))
    top_k: int = lm_field(8, check=check.positive_int, owner=_MOE, family=To("num_experts_per_tok"),
                          olmo_core=To("moe.router.top_k"))
    hidden: int | None = lm_field(
        None, check=check.positive_int_or_null, owner=_MOE,
        family=To("moe_intermediate_size", lambda c: c.moe.expert_hidden(c.dim)),
        olmo_core=To("moe.hidden_size", lambda c: c.moe.expert_hidden(c.dim),
                     lambda v, src: None if v == default_expert_hidden(src.config.d_model) else v))
    shared_hidden: int = lm_field(
        0, check=check.Count("none"), owner=_MOE, family=Refused(_NO_SHARED),
        olmo_core=Refused("OLMo-core averages a shared expert with the routed ones, "
                          "shared/(k+1) + routed*k/(k+1); ours adds them"))
    normalize: bool = lm_field(True, check=check.boolean, owner=_MOE, family=To("norm_topk_prob"),
                               olmo_core=To("moe.router.normalize_expert_weights",
                                            lambda c: 1.0 if c.moe.normalize else None,
                                            lambda v, src: v is not None))
    aux_loss: float = lm_field(0.01, check=_LOSS_WEIGHT, owner=_MOE, family=To("router_aux_loss_coef"),
                               olmo_core=To("moe.lb_loss_weight", lambda c: c.moe.aux_loss * c.moe.top_k,
                                            _loss_weight_back(True)))
    z_loss: float = lm_field(0.001, check=_LOSS_WEIGHT, owner=_MOE,
                             family=Elsewhere("the families' routers have no z-loss"),
                             olmo_core=To("moe.z_loss_weight", lambda c: c.moe.z_loss or None,
                                          _loss_weight_back(False)))

    def __post_init__(self) -> None:
        _check(self)
        if self.top_k > self.n_experts:
            raise UserError(f"model.moe.top_k ({self.top_k}) exceeds model.moe.n_experts "
                            f"({self.n_experts})")

    def expert_hidden(self, dim: int) -> int:
        return default_expert_hidden(dim) if self.hidden is None else self.hidden

    def is_moe(self, block: int) -> bool:
        """Whether block ``block``'s MLP is an MoE."""
        return self.every > 0 and block % self.every == self.every - 1


def default_expert_hidden(dim: int) -> int:
    return max(1, dim // 2)


# ---- the language model -----------------------------------------------------------------------
_OWN_ATTENTION = "the family's own attention"
_ADAPTED = "an argument of adapt(), which mixes the family's values along depth"
_NO_FIRST_VALUES = "its attention takes no first layer's values"
_NO_DEPTH = "its attention reads no earlier layer's keys"
_ADAPTED = "siamesenorm.hf.adapt builds it into the family's model"
_M = "model"


def _qk_norm(c: LMConfig) -> dict | None:
    return {"norm": c.norm, "eps": c.norm_eps} if c.qk_norm else None


def _rope_theta(c: LMConfig) -> int | float:
    return int(c.rope_theta) if float(c.rope_theta).is_integer() else c.rope_theta


# The check of both value-residual weights.
_VR_WEIGHT = check.Bounded(-MAX_VALUE_RESIDUAL_WEIGHT, MAX_VALUE_RESIDUAL_WEIGHT, low_open=False,
                           what=" (a weight on a layer's values; the paper's is 0.5)")


@dataclass(frozen=True)
class LMConfig:
    """Decoder-only Transformer language model; each field's declaration says what it does.

    ``None`` sizes take defaults: ``n_kv_heads`` is ``n_heads``, ``mlp_hidden`` 8/3 * dim rounded
    up to 64 (SwiGLU) or 4 * dim (GELU), ``head_size`` ``dim // n_heads``. ``family`` builds that
    Hugging Face family's model instead (:mod:`siamesenorm.hf.family_lm`), ``family_options``
    adding its other fields. The scheme and its options are checked once, here
    (:attr:`resolved_scheme`).
    """

    vocab_size: int = lm_field(256, check=check.positive_int, family=To("vocab_size"),
                               olmo_core=To("vocab_size"))
    dim: int = lm_field(256, check=check.positive_int, family=To("hidden_size"), olmo_core=To("d_model"))
    n_layers: int = lm_field(6, check=check.positive_int, family=To("num_hidden_layers"),
                             olmo_core=To("n_layers"))
    n_heads: int = lm_field(4, check=check.positive_int, family=To("num_attention_heads"),
                            olmo_core=To("attention.n_heads"))
    n_kv_heads: int | None = lm_field(None, check=check.positive_int_or_null,
                                      family=To("num_key_value_heads", lambda c: c.kv_heads),
                                      olmo_core=To("attention.n_kv_heads"))
    mlp: str = lm_field("swiglu", check=check.OneOf(MLP_KINDS),
                        family=Refused("it has its own gated MLP", ("swiglu",)),
                        olmo_core=(Refused("OLMo-core's feed-forward is gated", ("swiglu",)),
                                   To("feed_forward.activation", lambda c: "silu",
                                      lambda v, src: "swiglu")))
    mlp_hidden: int | None = lm_field(
        None, check=check.positive_int_or_null, family=To("intermediate_size", lambda c: c.hidden_dim),
        olmo_core=To("feed_forward.hidden_size", lambda c: c.hidden_dim,
                     lambda v, src: None if v in (None, default_mlp_hidden("swiglu", src.config.d_model))
                     else v))
    max_seq_len: int = lm_field(256, check=check.positive_int, family=To("max_position_embeddings"),
                                olmo_core=Elsewhere("OLMo-core takes the sequence length from its "
                                                    "train module"))
    rope_theta: float = lm_field(10000.0, check=check.positive_number, owner=_M, family=To("rope_theta"),
                                 olmo_core=To("attention.rope.theta", _rope_theta, lambda v, src: float(v)))
    qk_norm: bool = lm_field(False, check=check.boolean, owner=_M,
                             family=Elsewhere("the family decides its QK-norm; true is refused "
                                              "where it has none"),
                             olmo_core=To("attention.qk_norm", _qk_norm, lambda v, src: v is not None))
    qk_norm_per_head: bool = lm_field(
        True, check=check.boolean, owner=_M, needs="qk_norm",
        family=Refused("the family decides its QK-norm"),
        olmo_core=To("attention.use_head_qk_norm", lambda c: c.qk_norm_per_head if c.qk_norm else None,
                     lambda v, src: src.attention.qk_norm is None or bool(v)))
    head_size: int | None = lm_field(
        None, check=check.positive_int_or_null,
        family=(Refused("the family's attention takes head_dim from model.family_options"),
                To("head_dim", lambda c: c.head_dim)),
        olmo_core=To("attention.head_dim", None,
                     lambda v, src: None if v in (None, src.config.d_model // src.attention.n_heads)
                     else v))
    tie_embeddings: bool = lm_field(True, check=check.boolean, owner=_M, family=To("tie_word_embeddings"),
                                    olmo_core=To("tie_word_embeddings"))
    bias: bool = lm_field(False, check=check.boolean, owner=_M, family=To("attention_bias"),
                          olmo_core=To(("attention.bias", "feed_forward.bias"), None,
                                       lambda v, src: bool(v)))
    norm: str = lm_field(
        "rmsnorm", check=check.OneOf(NORM_KINDS),
        family=Elsewhere("adapt(norm=): dyt and derf replace the family's norms; rmsnorm and "
                         "layernorm name its own"),
        olmo_core=(Refused("OLMo-core's per-head norms have no DyT or Derf", ("rmsnorm", "layernorm")),
                   To("norm")),
        help="layernorm, rmsnorm, dyt (DyT, gamma * tanh(alpha x) + beta, arXiv 2503.10622) or derf "
             "(Derf, gamma * erf(alpha x + s) + beta, arXiv 2512.10938): every norm a scheme or the "
             "attention owns")
    norm_eps: float = lm_field(1e-5, check=check.positive_number, owner=_M, family=To("rms_norm_eps"),
                               olmo_core=To("norm_eps"))
    scheme: str = lm_field("pre", check=check.scheme_name, family=Elsewhere(_ADAPTED),
                           olmo_core=To("scheme"))
    scheme_options: dict[str, Any] = lm_field(
        check=check.scheme_options, factory=dict, family=Elsewhere(_ADAPTED),
        olmo_core=To("scheme_options", lambda c: dict(c.scheme_options), lambda v, src: dict(v)))
    init: str = lm_field("normal", check=check.OneOf(INIT_KINDS),
                         family=Elsewhere("the family initialises its own weights"),
                         olmo_core=Elsewhere("OLMo-core initialises by its init_method"))
    init_std: float = lm_field(
        0.02, check=check.Bounded(0, MAX_INIT_STD, what=" (the weights' standard deviation; GPT-2's is "
                                                          "0.02)"), owner=_M,
        family=To("initializer_range"),
        olmo_core=Elsewhere("OLMo-core's own init_std (olmo_config's keyword arguments)"))
    dropout: float = lm_field(0.0, check=check.probability, family=To("attention_dropout"),
                              olmo_core=Refused("OLMo-core drops other things than we do"))
    moe: MoEConfig = lm_field(check=_moe_section, factory=MoEConfig,
                              family=Elsewhere("its fields, for a family with experts"),
                              olmo_core=Elsewhere("its fields, on the blocks with experts"))
    family: str = lm_field("", check=_family_name, family=Elsewhere("it names the family"),
                           olmo_core=Refused("a Hugging Face family's model has no OLMo-core "
                                             "counterpart"))
    family_options: dict[str, Any] = lm_field(
        check=check.MappingOf("the family's configuration fields"), factory=dict,
        family=Elsewhere("set on top of the fields above"),
        olmo_core=Elsewhere("a Hugging Face family's alone"))
    value_residual: bool = lm_field(
        False, check=check.boolean, owner=_M, family=Refused(_OWN_ATTENTION),
        olmo_core=Refused(_NO_FIRST_VALUES),
        help="true mixes the first layer's values into every later attention layer's, own * V_n + "
             "first * V_1 (ResFormer, arXiv 2410.17897; language models; model.value_residual_mix: "
             "fixed or learned, model.value_residual_own and model.value_residual_first: the weights, "
             "0.5 and 0.5)")
    value_residual_mix: str = lm_field("fixed", check=check.OneOf(VALUE_RESIDUAL_MIXES), owner=_M,
                                       needs="value_residual", family=Refused(_OWN_ATTENTION),
                                       olmo_core=Refused(_NO_FIRST_VALUES))
    value_residual_own: float = lm_field(
        0.5, check=_VR_WEIGHT,
        owner=_M, needs="value_residual", family=Refused(_OWN_ATTENTION),
        olmo_core=Refused(_NO_FIRST_VALUES))
    value_residual_first: float = lm_field(
        0.5, check=_VR_WEIGHT,
        owner=_M, needs="value_residual", family=Refused(_OWN_ATTENTION),
        olmo_core=Refused(_NO_FIRST_VALUES))
    depth_attention: bool = lm_field(
        False, check=check.boolean, owner=_M, family=Elsewhere(_ADAPTED),
        olmo_core=Refused(_NO_DEPTH),
        help="true: each attention layer's query mixes, per position, the values of layers 0, s, 2s, "
             "... before it into its own by a softmax over their keys and its own (Depth-Attention, "
             "arXiv 2606.05014; LM, ViT, DiT; not with value_residual; model.depth_attention_stride: "
             "s, by default half the layers)")
    depth_attention_stride: int | None = lm_field(None, check=check.positive_int_or_null, owner=_M,
                                                  needs="depth_attention", family=Elsewhere(_ADAPTED),
                                                  olmo_core=Refused(_NO_DEPTH))
    embed_scale: float | str | None = lm_field(
        None, check=_embed_scale, owner=_M, family=Refused("the family's own embedding"),
        olmo_core=Refused("its embedding has no learnable scale"),
        help="a learnable scalar on the token embedding, started at a number or sqrt_dim, as the DyT "
             "and Derf papers' language models have (null: none)")

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):
            unknown = sorted(set(self.moe) - {f.name for f in dataclasses.fields(MoEConfig)})
            if unknown:
                raise UserError(f"unknown key 'model.moe.{unknown[0]}'")
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        _check(self)
        if self.head_size is None:
            check.divisible("LMConfig", "dim", self.dim, "LMConfig.n_heads", self.n_heads)
        if self.head_dim % 2:
            raise UserError(f"LMConfig head size {self.head_dim} must be even for rotary "
                            "embeddings (LMConfig.head_size, or dim / n_heads)")
        check.divisible("LMConfig", "n_heads", self.n_heads, "LMConfig.n_kv_heads", self.kv_heads)
        if self.moe.every and self.mlp != "swiglu":
            raise UserError(f"model.moe needs model.mlp=swiglu (its experts are SwiGLU), got "
                            f"{self.mlp!r}")
        if self.depth_attention and self.value_residual:
            raise UserError("model.depth_attention and model.value_residual both rewrite the values "
                            "attention reads, and Depth-Attention defines no combination; choose one")
        if self.family:
            self.check_host("family")
        buildable("LMConfig", self.n_layers, self.estimated_parameters())
        if self.moe_layers and self.moe.n_experts > MAX_EXPERTS:
            raise UserError(f"model.moe.n_experts={self.moe.n_experts:,} is beyond what this library "
                            f"builds (at most {MAX_EXPERTS:,} per layer; the largest published "
                            "mixtures have a few hundred)")
        if self.moe_layers * self.moe.n_experts > MAX_EXPERT_LAYERS:
            raise UserError(f"{self.moe_layers} MoE layers of {self.moe.n_experts} experts are beyond "
                            f"what this library builds (at most {MAX_EXPERT_LAYERS:,} experts in all: "
                            "each runs in turn); fewer layers, experts, or a larger model.moe.every")
        check.resolve_model_scheme(self)

    @property
    def resolved_scheme(self) -> Any:
        """The scheme's class and its options, every one filled and checked
        (:class:`~siamesenorm.schemes.ResolvedScheme`)."""
        return check.resolved_scheme(self)

    def check_host(self, host: str) -> None:
        """Refuse, in one line, the first value the model on ``host`` (a key of :data:`HOSTS`)
        cannot carry."""
        where, fix = HOSTS[host]
        for name, f, spec in description(LMConfig):
            rule = next((c for c in getattr(spec, host) if isinstance(c, Refused)), None)
            if rule is None:
                continue
            value = _get(self, name)
            if (value != _default(f)) if rule.allowed is None else (value not in rule.allowed):
                allowed = "" if rule.allowed is None else f", choose {' or '.join(rule.allowed)}"
                value = str(value).lower() if isinstance(value, bool) else value
                raise UserError(f"model.{name}={value} is not available with "
                                f"{where.format(family=self.family)} ({rule.why}{allowed}); {fix}")

    @property
    def embed_scale_init(self) -> float | None:
        """The learnable embedding scale's start (sqrt(dim) for ``"sqrt_dim"``); ``None``: none."""
        if self.embed_scale is None:
            return None
        return math.sqrt(self.dim) if self.embed_scale == "sqrt_dim" else float(self.embed_scale)

    @property
    def value_weights(self) -> tuple[float, float]:
        """``(own, first)``: the value residual's weights on a layer's own and the first values."""
        return float(self.value_residual_own), float(self.value_residual_first)

    @property
    def depth_stride(self) -> int:
        """``depth_attention_stride``, or half the layers (at least 1)."""
        return depth_stride(self.depth_attention_stride, self.n_layers)

    def estimated_parameters(self) -> int:
        """The embedding's, every block's attention and MLP (or experts') and an untied head's
        parameters from the sizes alone (norms and the scheme's left out): what
        :func:`~.config_checks.buildable` bounds."""
        d, kv, bias, moe = self.dim, self.kv_heads * self.head_dim, self.bias, self.moe
        q = self.n_heads * self.head_dim
        attention = linear(d, q, bias) + linear(q, d, bias) + 2 * linear(d, kv, bias)
        per_hidden = 3 if self.mlp == "swiglu" else 2
        dense = per_hidden * d * self.hidden_dim + ((2 if per_hidden == 3 else 1) * self.hidden_dim + d
                                                     if bias else 0)
        experts = d * moe.n_experts + 3 * moe.n_experts * d * moe.expert_hidden(d) \
            + 3 * d * moe.shared_hidden
        moe_layers = self.moe_layers
        blocks = self.n_layers * attention + (self.n_layers - moe_layers) * dense + moe_layers * experts
        return self.vocab_size * d * (1 if self.tie_embeddings else 2) + blocks

    @property
    def moe_layers(self) -> int:
        """How many blocks have a mixture of experts."""
        return self.n_layers // self.moe.every if self.moe.every else 0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads if self.head_size is None else self.head_size

    @property
    def kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def hidden_dim(self) -> int:
        return default_mlp_hidden(self.mlp, self.dim) if self.mlp_hidden is None else self.mlp_hidden
