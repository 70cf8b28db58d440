"""Configuration of the decoder-only language model, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from ..errors import UserError
from ..nn.depth_attention import check_depth_attention, depth_stride
from ..nn.mlp import MLP_KINDS, default_mlp_hidden
from ..nn.norms import NORM_KINDS
from ..nn.value_residual import VALUE_RESIDUAL_MIXES
from .config_checks import MAX_EXPERT_LAYERS, MAX_EXPERTS, buildable, linear

INIT_KINDS = ("normal", "mitchell")


@dataclass(frozen=True)
class Unsupported:
    """A value of field ``name`` that the model built on ``host`` cannot carry: any but
    ``allowed`` (``None``: any but the field's default); ``why`` says what stands in the way."""

    host: str
    name: str
    allowed: tuple | None
    why: str


# Where an LMConfig builds a model besides our LanguageModel, and how each names itself: a Hugging
# Face family's model (model.family; siamesenorm.hf.family_lm) and OLMo-core's (siamesenorm.olmo_core).
HOSTS = {"family": ("model.family={family}", "use our model (no model.family)"),
         "olmo_core": ("the OLMo-core model", "train it with our model")}

# What those hosts cannot carry: the one table their refusals come from (LMConfig.check_host).
UNSUPPORTED = (
    Unsupported("family", "norm", ("rmsnorm", "layernorm"), "the family's own norm class is used"),
    Unsupported("family", "mlp", ("swiglu",), "it has its own gated MLP"),
    Unsupported("family", "value_residual", None, "the family's own attention"),
    Unsupported("family", "depth_attention", None, "the family's own attention"),
    Unsupported("family", "embed_scale", None, "the family's own embedding"),
    Unsupported("family", "head_size", None, "the family's attention takes head_dim from "
                "model.family_options"),
    Unsupported("family", "qk_norm_per_head", None, "the family decides its QK-norm"),
    Unsupported("olmo_core", "family", None, "a Hugging Face family's model has no OLMo-core counterpart"),
    Unsupported("olmo_core", "norm", ("rmsnorm", "layernorm"),
                "OLMo-core's per-head norms have no DyT or Derf"),
    Unsupported("olmo_core", "mlp", ("swiglu",), "OLMo-core's feed-forward is gated"),
    Unsupported("olmo_core", "dropout", None, "OLMo-core drops other things than we do"),
    Unsupported("olmo_core", "value_residual", None, "its attention takes no first layer's values"),
    Unsupported("olmo_core", "depth_attention", None, "its attention reads no earlier layer's keys"),
    Unsupported("olmo_core", "embed_scale", None, "its embedding has no learnable scale"),
)


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:       # an integer too large for a float
        return False


def _positive_int(name: str, value: Any, optional: bool = False) -> None:
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise UserError(f"LMConfig.{name} must be a positive integer, got {value!r}")


# Upper bounds of the model's scales: past them a model builds with infinite weights (a value above
# float32's 3.4e38 is infinite when stored) or computes infinities in its first step. Each is far
# beyond what any recipe uses (shown beside it).
MAX_INIT_STD = 1.0                # GPT-2's 0.02; from 1 on, every layer multiplies by sqrt(dim)
MAX_EMBED_SCALE = 1e4             # the DyT paper's sqrt(dim): 64 at dim 4096
MAX_VALUE_RESIDUAL_WEIGHT = 100.0  # ResFormer's 0.5 and 0.5
MAX_LOSS_WEIGHT = 100.0           # OLMoE's 0.01 and 0.001 on its load-balancing and z-losses


def _number(key: str, value: Any, low: float, high: float, *, low_open: bool = True,
            what: str = "") -> None:
    """Refuse ``value`` for ``model.<key>`` unless it is a finite number above ``low`` (or equal
    to it, when not ``low_open``) and at most ``high``; ``what`` says what the bound protects."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value) \
            or not (low < value if low_open else low <= value) or not value <= high:
        above = f"{'>' if low_open else '>='} {low:g}"
        raise UserError(f"model.{key} must be a finite number {above} and at most {high:g}{what}, "
                        f"got {value!r}")


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise UserError(f"LMConfig.{name}: unknown value {value!r}; choose one of "
                          f"{', '.join(choices)}")


@dataclass(frozen=True)
class MoEConfig:
    """Mixture-of-experts feed-forward (:class:`~siamesenorm.nn.moe.MoE`, OLMoE arXiv 2409.02060).

    ``every``: 0 keeps every MLP dense; ``n`` makes the MLP of every n-th block an MoE (blocks
    ``n-1, 2n-1, ...``; 1: all, as OLMoE). ``n_experts`` SwiGLU experts of hidden size ``hidden``
    (``None``: ``dim // 2``, OLMoE's 1024 at dim 2048), ``top_k`` per token, renormalised over the
    chosen ones when ``normalize``; ``shared_hidden`` > 0 adds an always-on shared expert of that
    size. ``aux_loss`` and ``z_loss`` weigh the load-balancing and router z-losses in the training
    loss. The defaults are OLMoE's: 64 experts, 8 per token, 0.01 and 0.001.
    """

    every: int = 0
    n_experts: int = 64
    top_k: int = 8
    hidden: int | None = None
    shared_hidden: int = 0
    normalize: bool = True
    aux_loss: float = 0.01
    z_loss: float = 0.001

    def __post_init__(self) -> None:
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 0:
            raise UserError(f"model.moe.every must be 0 (dense) or a positive integer, got "
                              f"{self.every!r}")
        for name in ("n_experts", "top_k"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"model.moe.{name} must be a positive integer, got {value!r}")
        if self.top_k > self.n_experts:
            raise UserError(f"model.moe.top_k ({self.top_k}) exceeds model.moe.n_experts "
                              f"({self.n_experts})")
        if self.hidden is not None and (isinstance(self.hidden, bool)
                                        or not isinstance(self.hidden, int) or self.hidden < 1):
            raise UserError(f"model.moe.hidden must be a positive integer, got {self.hidden!r}")
        if isinstance(self.shared_hidden, bool) or not isinstance(self.shared_hidden, int) \
                or self.shared_hidden < 0:
            raise UserError("model.moe.shared_hidden must be 0 (none) or a positive integer, got "
                              f"{self.shared_hidden!r}")
        for name in ("aux_loss", "z_loss"):
            _number(f"moe.{name}", getattr(self, name), 0, MAX_LOSS_WEIGHT, low_open=False,
                    what=" (a weight on the training loss; OLMoE's are 0.01 and 0.001)")

    def expert_hidden(self, dim: int) -> int:
        return max(1, dim // 2) if self.hidden is None else self.hidden

    def is_moe(self, block: int) -> bool:
        """Whether block ``block``'s MLP is an MoE."""
        return self.every > 0 and block % self.every == self.every - 1


@dataclass(frozen=True)
class LMConfig:
    """Decoder-only Transformer language model.

    ``n_kv_heads=None`` means ``n_heads`` (no grouping); ``mlp_hidden=None`` means 8/3 * dim rounded
    up to a multiple of 64 for SwiGLU and 4 * dim for GELU (see :attr:`hidden_dim`). ``scheme`` and
    ``scheme_options`` name the residual scheme and its options; ``init`` is ``"normal"`` (GPT-2
    style, ``init_std``) or ``"mitchell"`` (OLMo's depth-scaled truncated normal). ``moe`` turns
    the MLPs of some or all blocks into mixtures of experts (:class:`MoEConfig`; dense by default).
    ``family`` (``qwen3``, ``llama``, ``olmoe``, ...: :data:`siamesenorm.hf.families.FAMILY_NAMES`)
    builds that Hugging Face family's model with the scheme instead
    (:mod:`siamesenorm.hf.family_lm`): these fields give its configuration, ``family_options``
    any other field of it in the family's names; the family decides its norm kind, initialisation,
    QK-norm and MLP. ``value_residual`` mixes the first attention layer's values into every later
    one's (ResFormer, :mod:`~siamesenorm.nn.value_residual`): ``value_residual_own *`` its own
    ``+ value_residual_first *`` the first's, weights ``fixed`` or ``learned`` per layer
    (``value_residual_mix``; the paper's 0.5 and 0.5 by default, the learned ones' start).
    ``depth_attention`` mixes, per position, the values of layers ``0, s, 2s, ...`` before it into
    each attention layer's by a softmax of its query against their keys (Depth-Attention,
    :mod:`~siamesenorm.nn.depth_attention`); ``s`` is ``depth_attention_stride``, by default half
    the layers.
    ``embed_scale`` multiplies the token embedding (not the tied head) by one learnable scalar
    started at that value (``"sqrt_dim"``: sqrt(dim)), as the DyT paper's language models do
    (arXiv 2503.10622): without a norm's rescaling the residual stream enters the first DyT at the
    embedding's scale; ``None`` (the default) has no such scalar. ``head_size`` sets a head size
    other than ``dim // n_heads`` (Qwen3, OLMo-core's ``head_dim``); ``qk_norm_per_head=False``
    normalises q and k over all heads at once (OLMo2) instead of per head.
    """

    vocab_size: int = 256
    dim: int = 256
    n_layers: int = 6
    n_heads: int = 4
    n_kv_heads: int | None = None
    mlp: str = "swiglu"
    mlp_hidden: int | None = None
    max_seq_len: int = 256
    rope_theta: float = 10000.0
    qk_norm: bool = False
    qk_norm_per_head: bool = True
    head_size: int | None = None
    tie_embeddings: bool = True
    bias: bool = False
    norm: str = "rmsnorm"
    norm_eps: float = 1e-5
    scheme: str = "pre"
    scheme_options: dict[str, Any] = field(default_factory=dict)
    init: str = "normal"
    init_std: float = 0.02
    dropout: float = 0.0
    moe: MoEConfig = field(default_factory=MoEConfig)
    family: str = ""
    family_options: dict[str, Any] = field(default_factory=dict)
    value_residual: bool = False
    value_residual_mix: str = "fixed"
    value_residual_own: float = 0.5
    value_residual_first: float = 0.5
    depth_attention: bool = False
    depth_attention_stride: int | None = None
    embed_scale: float | str | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "max_seq_len"):
            _positive_int(name, getattr(self, name))
        _positive_int("n_kv_heads", self.n_kv_heads, optional=True)
        _positive_int("mlp_hidden", self.mlp_hidden, optional=True)
        _positive_int("head_size", self.head_size, optional=True)
        if self.head_size is None and self.dim % self.n_heads:
            raise UserError(f"LMConfig.dim ({self.dim}) must be divisible by "
                              f"LMConfig.n_heads ({self.n_heads})")
        if self.head_dim % 2:
            raise UserError(f"LMConfig head size {self.head_dim} must be even for rotary "
                              "embeddings (LMConfig.head_size, or dim / n_heads)")
        if self.n_heads % self.kv_heads:
            raise UserError(f"LMConfig.n_heads ({self.n_heads}) must be divisible by "
                              f"LMConfig.n_kv_heads ({self.kv_heads})")
        _choice("mlp", self.mlp, MLP_KINDS)
        _choice("norm", self.norm, NORM_KINDS)
        _choice("init", self.init, INIT_KINDS)
        for name in ("rope_theta", "norm_eps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value) \
                    or not value > 0:
                raise UserError(f"model.{name} must be a positive finite number, got {value!r}")
        _number("init_std", self.init_std, 0, MAX_INIT_STD,
                what=" (the weights' standard deviation; GPT-2's is 0.02)")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) \
                or not 0.0 <= self.dropout < 1.0:
            raise UserError(f"LMConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if not isinstance(self.qk_norm_per_head, bool):
            raise UserError(f"model.qk_norm_per_head must be true or false, got {self.qk_norm_per_head!r}")
        if not self.qk_norm_per_head and not self.qk_norm:
            raise UserError("model.qk_norm_per_head is set but model.qk_norm is false; add "
                            "model.qk_norm=true")
        if not isinstance(self.scheme, str) or not self.scheme:
            raise UserError(f"LMConfig.scheme must be a scheme name, got {self.scheme!r}")
        if isinstance(self.moe, dict):
            unknown = sorted(set(self.moe) - {f for f in MoEConfig.__dataclass_fields__})
            if unknown:
                raise UserError(f"unknown key 'model.moe.{unknown[0]}'")
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        if not isinstance(self.moe, MoEConfig):
            raise UserError(f"LMConfig.moe must be an MoEConfig, got {self.moe!r}")
        if self.moe.every and self.mlp != "swiglu":
            raise UserError(f"model.moe needs model.mlp=swiglu (its experts are SwiGLU), got "
                              f"{self.mlp!r}")
        if not isinstance(self.family, str):
            raise UserError(f"LMConfig.family must be a family name or empty, got {self.family!r}")
        if not isinstance(self.family_options, dict):
            raise UserError("LMConfig.family_options must be a mapping of the family's configuration "
                              f"fields, got {self.family_options!r}")
        if not isinstance(self.scheme_options, dict):
            raise UserError("LMConfig.scheme_options must be a mapping of option names to "
                              f"values, got {self.scheme_options!r}")
        self._check_value_residual()
        self._check_depth_attention()
        self._check_embed_scale()
        if self.family:
            self.check_host("family")
        buildable("LMConfig", self.n_layers, self.estimated_parameters())
        moe_layers = self.moe_layers
        if moe_layers and self.moe.n_experts > MAX_EXPERTS:
            raise UserError(f"model.moe.n_experts={self.moe.n_experts:,} is beyond what this library "
                              f"builds (at most {MAX_EXPERTS:,} per layer; the largest published "
                              "mixtures have a few hundred)")
        if moe_layers * self.moe.n_experts > MAX_EXPERT_LAYERS:
            raise UserError(f"{moe_layers} MoE layers of {self.moe.n_experts} experts are beyond what "
                              f"this library builds (at most {MAX_EXPERT_LAYERS:,} experts in all: each "
                              "runs in turn); fewer layers, experts, or a larger model.moe.every")

    def _check_value_residual(self) -> None:
        if not isinstance(self.value_residual, bool):
            raise UserError(f"model.value_residual must be true or false, got {self.value_residual!r}")
        if self.value_residual_mix not in VALUE_RESIDUAL_MIXES:
            raise UserError(f"model.value_residual_mix: unknown value {self.value_residual_mix!r}; choose "
                              f"one of {', '.join(VALUE_RESIDUAL_MIXES)}")
        for name in ("value_residual_own", "value_residual_first"):
            _number(name, getattr(self, name), -MAX_VALUE_RESIDUAL_WEIGHT, MAX_VALUE_RESIDUAL_WEIGHT,
                    low_open=False, what=" (a weight on a layer's values; the paper's is 0.5)")
        if not self.value_residual:
            changed = [name for name in ("value_residual_mix", "value_residual_own", "value_residual_first")
                       if getattr(self, name) != self.__dataclass_fields__[name].default]
            if changed:
                raise UserError(f"model.{changed[0]} is set but model.value_residual is false; add "
                                  "model.value_residual=true")

    def _check_depth_attention(self) -> None:
        check_depth_attention(self.depth_attention, self.depth_attention_stride)
        if self.depth_attention and self.value_residual:
            raise UserError("model.depth_attention and model.value_residual both rewrite the values "
                            "attention reads, and Depth-Attention defines no combination; choose one")

    def _check_embed_scale(self) -> None:
        value = self.embed_scale
        if value is None or value == "sqrt_dim":
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value) \
                or not value > 0:
            raise UserError(f"model.embed_scale must be a positive number, sqrt_dim or null, got {value!r}")
        if value > MAX_EMBED_SCALE:
            raise UserError(f"model.embed_scale must be at most {MAX_EMBED_SCALE:g} (the start of the "
                            f"embedding's scale; the DyT paper's is sqrt(dim): sqrt_dim), got {value!r}")

    def check_host(self, host: str) -> None:
        """Refuse, in one line, the first value the model on ``host`` (a key of :data:`HOSTS`)
        cannot carry (:data:`UNSUPPORTED`)."""
        where, fix = HOSTS[host]
        for rule in UNSUPPORTED:
            if rule.host != host:
                continue
            value = getattr(self, rule.name)
            default = self.__dataclass_fields__[rule.name].default
            if (value != default) if rule.allowed is None else (value not in rule.allowed):
                allowed = "" if rule.allowed is None else f", choose {' or '.join(rule.allowed)}"
                value = str(value).lower() if isinstance(value, bool) else value
                raise UserError(f"model.{rule.name}={value} is not available with "
                                  f"{where.format(family=self.family)} ({rule.why}{allowed}); {fix}")

    @property
    def embed_scale_init(self) -> float | None:
        """The start of the learnable embedding scale (``embed_scale``; sqrt(dim) for
        ``"sqrt_dim"``), or ``None`` when the model has none."""
        if self.embed_scale is None:
            return None
        return math.sqrt(self.dim) if self.embed_scale == "sqrt_dim" else float(self.embed_scale)

    @property
    def value_weights(self) -> tuple[float, float]:
        """``(own, first)``: the value residual's weights on a layer's own and the first values."""
        return float(self.value_residual_own), float(self.value_residual_first)

    @property
    def depth_stride(self) -> int:
        """``depth_attention_stride`` resolved: half the layers (at least 1) when unset."""
        return depth_stride(self.depth_attention_stride, self.n_layers)

    def estimated_parameters(self) -> int:
        """The parameters of the embedding, every block's attention and MLP (or mixture of
        experts), and an untied head, from the sizes alone (norms and the scheme's own
        parameters, which are few, left out; a family's ``family_options`` not read): what
        :func:`~.config_checks.buildable` bounds. Pure arithmetic, for any size."""
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
        """How many blocks have a mixture of experts (blocks ``every-1, 2*every-1, ...``)."""
        return self.n_layers // self.moe.every if self.moe.every else 0

    @property
    def head_dim(self) -> int:
        """``head_size`` resolved (``dim // n_heads`` when unset)."""
        return self.dim // self.n_heads if self.head_size is None else self.head_size

    @property
    def kv_heads(self) -> int:
        """``n_kv_heads`` resolved (``n_heads`` when unset)."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def hidden_dim(self) -> int:
        """``mlp_hidden`` resolved (the default size for ``mlp`` when unset)."""
        if self.mlp_hidden is None:
            return default_mlp_hidden(self.mlp, self.dim)
        return self.mlp_hidden
