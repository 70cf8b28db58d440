"""Any scheme inside a Hugging Face causal LM of a supported family: :func:`adapt` (transformers 5;
docs/own_model.md)."""

from __future__ import annotations

import copy
import importlib
from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel

try:
    from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
    from transformers.modeling_outputs import BaseModelOutputWithPast, MoeModelOutputWithPast
    from transformers.utils.generic import merge_with_config_defaults
    from transformers.utils.output_capturing import capture_outputs, maybe_install_capturing_hooks
except ImportError:                     # pragma: no cover - transformers 4
    capture_outputs = None

from ..errors import UserError
from ..models.host import BranchWeight, honour_requirements, needs_qkv_norm
from ..models.stack import ResidualStack, hidden_at
from ..nn.attention import HEAD_NORMED, HeadNormedAttention, head_norm, head_norm_name
from ..nn.depth_attention import DepthKeysValues, DepthMixedValues, check_depth_attention, depth_stride
from ..nn.legacy import LegacyStateNames
from ..nn.norms import NORM_KINDS, LayerNorm, build_norm, set_llm_dyt_alpha0
from ..schemes.base import ResidualScheme, build_scheme
from .common import BaseConfig, SchemeCheckpointing, cache_keyword, derive_buffers, load_legacy_names
from .families import FAMILIES, Family
from .standalone import SavesItsCode, family_of, scheme_config_class, to_scheme_config

__all__ = ["adapt", "adapted_class"]

# the cache's keyword in a call (the masks', the attention's)
_CACHE_ARG = cache_keyword(create_causal_mask) if capture_outputs is not None else "past_key_values"


_CLASSES: dict[str, type] = {}
_ATTENTION_CLASSES: dict[str, type] = {}
_LAYER_TYPES = ("full_attention", "sliding_attention")


def _need_transformers5() -> None:
    if capture_outputs is None:                    # pragma: no cover - transformers 4
        raise ImportError("siamesenorm.hf.adapt needs transformers>=5: pip install -U transformers")


def _family(model_type: str | None) -> Family:
    try:
        return FAMILIES[model_type]
    except KeyError:
        raise UserError(f"adapt supports the model types {', '.join(FAMILIES)}; "
                          f"got {model_type!r}") from None


# ---- the pieces ----------------------------------------------------------------------------------
def _own_copy(module: nn.Module, config: Any = None) -> nn.Module:
    """A shallow copy of ``module``: the same parameters and children, its own registries and hooks, and
    ``config`` if given (the original is left alone)."""
    new = copy.copy(module)
    state = vars(new)
    for key, value in list(state.items()):
        if isinstance(value, (dict, set)):
            state[key] = copy.copy(value)
    if config is not None and "config" in state:
        state["config"] = config
    return new


def _own_tree(module: nn.Module, config: Any) -> nn.Module:
    """:func:`_own_copy` of ``module`` and of every submodule that holds a configuration."""
    new = _own_copy(module, config)
    for name, child in module.named_children():
        if any("config" in vars(m) for m in child.modules()):
            setattr(new, name, _own_tree(child, config))
    return new


def _own_parameters(module: nn.Module) -> nn.Module:
    """:func:`_own_copy` of ``module`` with parameters of its own, on the same data."""
    new = _own_copy(module)
    for name, p in list(new.named_parameters(recurse=False)):
        setattr(new, name, nn.Parameter(p.data, requires_grad=p.requires_grad))
    return new


def _drop_norm_parameters(scheme: ResidualScheme) -> None:
    """OLMo's norms have no parameters: every LayerNorm of the scheme becomes one without."""
    for module in list(scheme.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, LayerNorm) and child.weight is not None:
                w = child.weight
                setattr(module, name, LayerNorm(child.dim, child.eps, affine=False, device=w.device,
                                                dtype=w.dtype))


@torch.no_grad()
def _copy_norm(dst: nn.Module, src: nn.Module | None, offset: float = 0.0) -> None:
    for name in ("weight", "bias"):
        d, s = getattr(dst, name, None), getattr(src, name, None)
        if isinstance(d, Tensor) and isinstance(s, Tensor) and d.shape == s.shape:
            d.copy_(s + offset if name == "weight" else s)


def _copy_role_norms(scheme: ResidualScheme, family: Family, layers: nn.ModuleList,
                     final: nn.Module) -> None:
    """Start the scheme's norms that play a family norm's role as copies of it; Gemma's ``1 + weight``
    becomes our weight."""
    offset = 1.0 if family.norm == "gemma" else 0.0
    per, head = scheme.role_norms()
    outputs = getattr(scheme, scheme.role_output_norm_name or "", None)
    for names, norms in ((family.inputs, per), (family.outputs, dict(enumerate(outputs or ())))):
        for i, dst in norms.items():
            name = names[0 if scheme.is_attention(i) else 1]
            if name is not None:
                _copy_norm(dst, getattr(layers[scheme.block_of(i)], name), offset)
    if head is not None:
        _copy_norm(head, final, offset)


def _branch_weights(sublayers: nn.ModuleList) -> list[BranchWeight]:
    """Every weight matrix of the family's sublayers (an expert stack's too), gained but on q and k, a
    module's ``bias`` with its first matrix; routers left out."""
    out = []
    for i, sub in enumerate(sublayers):
        for path, module in sub.named_modules():
            if "Router" in type(module).__name__ or path.rsplit(".", 1)[-1] == "gate":
                continue
            gained = not (i % 2 == 0 and any(p in path for p in ("q_proj", "k_proj")))
            params = dict(module.named_parameters(recurse=False))
            bias = params.pop("bias", None)
            weights = [p for p in params.values() if p.dim() >= 2]
            out += [BranchWeight(w, bias if j == 0 else None, gained, i, path)
                    for j, w in enumerate(weights)]
    return out


def _head_normed_class(attention: type) -> type:
    """``attention`` (a family's class) with :class:`HeadNormedAttention` mixed in."""
    if issubclass(attention, HeadNormedAttention):
        return attention
    name = attention.__name__.replace("Attention", "HeadNormedAttention")
    if name not in _ATTENTION_CLASSES:
        cls = type(name, (HeadNormedAttention, attention), {"__module__": __name__})
        globals()[name] = _ATTENTION_CLASSES[name] = cls          # importable by name (pickling)
    return _ATTENTION_CLASSES[name]


def _depth_class(attention: type, family: Family) -> type:
    """``attention`` with :class:`DepthMixedValues` mixed in, rotating q and k by the family's RoPE."""
    name = attention.__name__.replace("Attention", "DepthAttention")
    if name not in _ATTENTION_CLASSES:
        module = importlib.import_module(f"transformers.models.{family.module}.modeling_{family.module}")
        cls = type(name, (DepthMixedValues, attention),
                   {"__module__": __name__, "depth_rotation": staticmethod(module.apply_rotary_pos_emb)})
        globals()[name] = _ATTENTION_CLASSES[name] = cls          # importable by name (pickling)
    return _ATTENTION_CLASSES[name]


def _replace_qk_norms(attn: nn.Module, kind: str, eps: float, ref: Tensor) -> None:
    """The family's QK-norms (per head or over the whole width) as norms of ``kind``, as our
    attention's QK-norm is."""
    for name in ("q_norm", "k_norm"):
        norm = getattr(attn, name, None)
        if isinstance(norm, nn.Module):
            weight = getattr(norm, "weight", None)
            width = weight.shape[-1] if isinstance(weight, Tensor) else attn.head_dim
            setattr(attn, name, build_norm(kind, width, eps, role="attention", device=ref.device,
                                           dtype=ref.dtype))


def _mark_initialised(module: nn.Module) -> None:
    """Keep transformers' ``post_init`` from initialising these modules again."""
    for m in module.modules():
        m._is_hf_initialized = True


class _SchemeStack(LegacyStateNames, ResidualStack):
    """The :class:`ResidualStack` of an adapted model, its scheme registered as ``residual_norm``: a name
    ``Trainer`` takes for a norm, so it weight-decays none of the scheme's parameters."""

    legacy_state_names = {"scheme.": "residual_norm."}

    @property
    def scheme(self) -> ResidualScheme:
        return self._modules["residual_norm"]


def _scheme_stack(scheme: ResidualScheme, sublayers: list[nn.Module]) -> ResidualStack:
    stack = ResidualStack(scheme, sublayers)
    stack._modules["residual_norm"] = stack._modules.pop("scheme")
    stack.__class__ = _SchemeStack
    return stack


# ---- the base model ------------------------------------------------------------------------------
class _SchemeModel:
    """The family's base model with its decoder layers replaced by a residual scheme around the family's
    sublayers (``siamesenorm.hf.adapt``)."""

    family: Family

    def __init__(self, config: Any, embed_tokens: nn.Module, rotary_emb: nn.Module,
                 stack: ResidualStack) -> None:
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = embed_tokens
        self.rotary_emb = rotary_emb
        self.stack = stack
        self.layer_types = _layer_types(self.family, config)
        self.gradient_checkpointing = False
        spec = _spec_of(config)
        self.depth_stride = depth_stride(spec["depth_attention_stride"], config.num_hidden_layers) \
            if spec["depth_attention"] else None

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """The family's initialisation, and the buffers no state dict holds derived again."""
        derive_buffers(module)
        super()._init_weights(module)

    def _masks(self, attention_mask: Any, inputs_embeds: Tensor, cache: Any,
               position_ids: Tensor) -> dict[str, Any]:
        if isinstance(attention_mask, dict):            # prepared already (by generate)
            return attention_mask
        kw = {"config": self.config, "inputs_embeds": inputs_embeds, "attention_mask": attention_mask,
              _CACHE_ARG: cache, "position_ids": position_ids}
        return {kind: (create_sliding_window_causal_mask if kind == "sliding_attention"
                       else create_causal_mask)(**kw) for kind in sorted(set(self.layer_types))}

    def _forward(self, input_ids: Tensor | None = None, attention_mask: Any = None,
                 position_ids: Tensor | None = None, cache: Any = None,
                 inputs_embeds: Tensor | None = None, use_cache: bool | None = None,
                 output_hidden_states: bool | None = None, past_key_values: Any = None,
                 **kwargs: Any) -> Any:
        if past_key_values is not None:
            if cache is not None and cache is not past_key_values:
                raise ValueError("give cache or past_key_values, not both")
            cache = past_key_values
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        scheme = self.stack.scheme
        if self.gradient_checkpointing and scheme.training and torch.is_grad_enabled():
            cache, use_cache = None, False      # a checkpointed step would update it again
        if use_cache and cache is None:
            from transformers import DynamicCache
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = (torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device)
                            + past).unsqueeze(0)
        masks = self._masks(attention_mask, inputs_embeds, cache, position_ids)
        if self.family.rope_per_layer_type:         # one RoPE per layer type (OLMo3, Gemma3)
            rope = {kind: self.rotary_emb(inputs_embeds, position_ids, kind)
                    for kind in sorted(set(self.layer_types))}
            position_embeddings = rope[self.layer_types[0]]
        else:
            rope, position_embeddings = None, self.rotary_emb(inputs_embeds, position_ids)
        if output_hidden_states is None:
            output_hidden_states = getattr(self.config, "output_hidden_states", False)
        states: list | None = [] if output_hidden_states else None
        attention_kwargs = {"position_embeddings": position_embeddings, "position_ids": position_ids,
                            _CACHE_ARG: cache, "use_cache": use_cache, **kwargs}
        if self.depth_stride is not None:       # the source layers' keys and values, for the later ones
            attention_kwargs["depth_kv"] = DepthKeysValues(self.depth_stride)
        layer_types = self.layer_types

        def wrap(i: int, branch: Any) -> Any:
            if not scheme.is_attention(i):
                return branch
            kind = layer_types[scheme.block_of(i)]
            mask = masks[kind]
            if rope is not None:
                return lambda u, **kw: branch(u, attention_mask=mask, position_embeddings=rope[kind],
                                              **kw)[0]
            return lambda u, **kw: branch(u, attention_mask=mask, **kw)[0]  # the family's: (out, w)

        h = self.stack.run(inputs_embeds, attention_kwargs=attention_kwargs, wrap=wrap,
                           states=states)
        hidden = None
        if states is not None:
            hidden = tuple(hidden_at(scheme, s) for s in states[:-1]) + (h,)
        out_class = MoeModelOutputWithPast if self.family.moe else BaseModelOutputWithPast
        return out_class(last_hidden_state=h, hidden_states=hidden,
                         **{cache_keyword(out_class): cache if use_cache else None})


def _layer_types(family: Family, config: Any) -> list[str]:
    n = config.num_hidden_layers
    if family.masks == "layer_types":
        types = list(config.layer_types[:n])
        unknown = sorted(set(types) - set(_LAYER_TYPES))
        if unknown:
            raise UserError(f"adapt: layer type {unknown[0]!r} of {config.model_type} is not "
                              f"supported; supported: {', '.join(_LAYER_TYPES)}")
        return types
    if family.masks == "window" and getattr(config, "sliding_window", None) is not None:
        return ["sliding_attention"] * n
    return ["full_attention"] * n


# ---- the causal LM -------------------------------------------------------------------------------
class _SchemeCausalLM(SavesItsCode, SchemeCheckpointing):
    """The family's causal LM whose residual path is a scheme of siamesenorm (``siamesenorm.hf.adapt``);
    its ``forward`` is the family's."""

    _base_class: type
    _family_class: type
    _checkpointing_flag = "model"       # the base model's forward reads gradient_checkpointing

    def __init__(self, config: Any, *args: Any, source: PreTrainedModel | None = None,
                 shared: bool = False, **kwargs: Any) -> None:
        spec = _spec_of(config)
        if source is None:        # fresh (or, under from_pretrained, on the meta device)
            super().__init__(config, *args, **kwargs)
            src_model, lm_head = self.model, self.lm_head
        else:                     # from a model: build the family's parts on meta, then drop them
            with torch.device("meta"):
                super().__init__(config, *args, **kwargs)
            src_model, lm_head = source.model, source.lm_head
        family = self._base_class.family
        if shared:      # the source's output hooks (attentions, router logits) on the modules it
            maybe_install_capturing_hooks(src_model)    # shares, so none gets a second set
        ref = src_model.embed_tokens.weight
        meta = ref.device.type == "meta"
        layers = src_model.layers[:config.num_hidden_layers]
        own_norm, eps = _family_norm(family, config)
        norm = spec["norm"] or own_norm
        _refuse_for_family(config, spec)
        scheme = build_scheme(spec["scheme"], config.hidden_size, len(layers), norm=norm, eps=eps,
                              device=ref.device, dtype=ref.dtype, **spec["scheme_options"])
        bare = family.norm == "olmo" and norm == own_norm       # OLMo's norms have no parameters
        if bare:
            _drop_norm_parameters(scheme)
        sublayers: list[nn.Module] = []
        for b, layer in enumerate(layers):
            attn = _own_tree(layer.self_attn, config)
            if norm != own_norm:
                _replace_qk_norms(attn, norm, eps, ref)
            if needs_qkv_norm(scheme, b):
                attn.__class__ = _head_normed_class(type(attn))
                for name in HEAD_NORMED:
                    if name != "v_proj" and getattr(attn, f"{name[0]}_norm", None) is not None:
                        continue          # the family normalises q and k already (QK-norm)
                    per_head = head_norm(norm, attn.head_dim, eps, affine=not bare, device=ref.device,
                                         dtype=ref.dtype)
                    attn.add_module(head_norm_name(name), per_head)
            if spec["depth_attention"]:
                attn.__class__ = _depth_class(type(attn), family)
            sublayers += [attn, _own_tree(layer.mlp, config)]
        stack = _scheme_stack(scheme, sublayers)
        if norm == "dyt" and not meta:      # the DyT paper's LLM alpha0, as our language model's
            set_llm_dyt_alpha0(stack, config.hidden_size)
        if not meta:              # initialised already: the family's or the scheme's own values
            for module in (stack, src_model.embed_tokens, src_model.rotary_emb, lm_head):
                _mark_initialised(module)
        base = self._base_class(config, src_model.embed_tokens, src_model.rotary_emb, stack)
        base.post_init()
        # shared modules carry the source's hooks; otherwise transformers installs them when an
        # output is first asked for (until then the model pickles, as the family's does)
        base._output_capturing_hooks_installed = shared or getattr(
            src_model, "_output_capturing_hooks_installed", False)      # a copy's copied hooks
        self.model, self.lm_head = base, lm_head
        self.post_init()
        # norms with a model norm's role start as copies of it (after post_init, which would reset);
        # norms of another kind than the family's start at their own initialisation
        if norm == own_norm:
            _copy_role_norms(scheme, family, layers, src_model.norm)
        if source is None and not meta:       # the family's init, then the scheme's requirements
            honour_requirements(_branch_weights(stack.sublayers), scheme.requires)
        load_legacy_names(self)               # folders of an earlier layout load (QKV-norm)

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        derive_buffers(module)              # as _SchemeModel's
        super()._init_weights(module)

    def resize_token_embeddings(self, *args: Any, **kwargs: Any) -> nn.Module:
        """``PreTrainedModel.resize_token_embeddings`` on an embedding and head of this model's own (the
        model adapted from keeps its own)."""
        tied = self.lm_head.weight is self.model.embed_tokens.weight
        self.model.embed_tokens = _own_parameters(self.model.embed_tokens)
        self.lm_head = _own_parameters(self.lm_head)
        if tied:
            self.lm_head.weight = self.model.embed_tokens.weight
        return super().resize_token_embeddings(*args, **kwargs)

    @property
    def scheme(self) -> ResidualScheme:
        """The residual scheme (registered as ``model.stack.residual_norm``)."""
        return self.model.stack.scheme



def _spec_of(config: Any) -> dict:
    spec = getattr(config, "siamesenorm", None)
    if not isinstance(spec, dict) or not isinstance(spec.get("scheme"), str):
        raise UserError("this configuration records no scheme (config.siamesenorm); build the model "
                          "with siamesenorm.hf.adapt(config, scheme=...)")
    options = spec.get("scheme_options") or {}
    if not isinstance(options, dict):
        raise UserError(f"config.siamesenorm.scheme_options must be a mapping of option names to "
                        f"values, got {type(options).__name__}")
    _refuse_host_options(options, getattr(config, "model_type", "the family"))
    out = {"scheme": spec["scheme"], "scheme_options": dict(options), "norm": spec.get("norm"),
           "depth_attention": spec.get("depth_attention", False),
           "depth_attention_stride": spec.get("depth_attention_stride")}
    _check_model_options(out, "config.siamesenorm: ")
    return out


def _check_model_options(spec: dict, where: str) -> None:
    if spec["norm"] is not None and spec["norm"] not in NORM_KINDS:
        raise UserError(f"{where}norm must be one of {', '.join(NORM_KINDS)} (or None: the family's "
                        f"own), got {spec['norm']!r}")
    try:
        check_depth_attention(spec["depth_attention"], spec["depth_attention_stride"], owner="",
                              true="True")
    except UserError as error:
        raise UserError(f"{where}{error}") from None


def _family_norm(family: Family, config: Any) -> tuple[str, float]:
    """The family's own norm kind (Gemma's ``1 + w`` RMSNorm is our RMSNorm) and eps."""
    return ("layernorm", 1e-5) if family.norm == "olmo" else ("rmsnorm", config.rms_norm_eps)


def _refuse_for_family(config: Any, spec: dict) -> None:
    if getattr(config, "use_bidirectional_attention", False):
        raise UserError(f"adapt: {config.model_type} with use_bidirectional_attention is not "
                        f"supported (a causal LM's masks only)")
    if spec["depth_attention"] and getattr(config, "clip_qkv", None) is not None:
        raise UserError(f"adapt: depth_attention with {config.model_type}'s clip_qkv="
                        f"{config.clip_qkv} is not supported: the family clips q, k and v after the "
                        "projections, where Depth-Attention mixes the values; set clip_qkv=None")


# our language model's value residual (its options too), which adapt does not carry into a family
_VALUE_RESIDUAL = ("value_residual", "value_residual_mix", "value_residual_own", "value_residual_first")


def _refuse_host_options(options: dict, model_type: str) -> None:
    taken = sorted({"eps", "device", "dtype"} & set(options))
    if taken:
        raise UserError(f"adapt: {', '.join(taken)} come(s) from the {model_type} configuration, not "
                        "from scheme options")
    for name in _VALUE_RESIDUAL:
        if name in options:
            raise UserError(f"adapt: {name} is not available in a Hugging Face family (its attention "
                            "takes no first layer's values; LanguageModel and ResidualStack have it)")


def adapted_class(model_type: str) -> type:
    """The adapted causal-LM class of a family (``"qwen3"`` or ``"siamesenorm_qwen3"`` ->
    ``Qwen3SchemeForCausalLM``), built once; its ``__init__`` reads ``config.siamesenorm``."""
    _need_transformers5()
    model_type = family_of(model_type)
    family = _family(model_type)
    if model_type in _CLASSES:
        return _CLASSES[model_type]
    module = importlib.import_module(f"transformers.models.{family.module}.modeling_{family.module}")
    causal = getattr(module, family.causal_lm)
    pretrained = next(c for c in causal.__mro__[1:]
                      if issubclass(c, PreTrainedModel) and c is not PreTrainedModel)
    prefix = family.causal_lm.removesuffix("ForCausalLM")
    record = {k: v for k, v in pretrained._can_record_outputs.items() if k != "hidden_states"}
    forward = merge_with_config_defaults(capture_outputs(_SchemeModel._forward))
    # what transformers finds by reading a model's source file, as the family's file says
    found = {"_can_set_attn_implementation_cached_value": causal._can_set_attn_implementation(),
             "_can_set_experts_implementation_cached_value": causal._can_set_experts_implementation()}
    config_class = scheme_config_class(model_type)
    base = type(f"{prefix}SchemeModel", (_SchemeModel, pretrained),
                {"__module__": __name__, "family": family, "_can_record_outputs": record,
                 "forward": forward, "__doc__": _SchemeModel.__doc__, "config_class": config_class,
                 **found})
    lm = type(f"{prefix}SchemeForCausalLM", (_SchemeCausalLM, causal),
              {"__module__": __name__, "_base_class": base, "_family_class": causal,
               "__doc__": _SchemeCausalLM.__doc__, "config_class": config_class, **found})
    globals()[base.__name__], globals()[lm.__name__] = base, lm      # importable by name
    _CLASSES[model_type] = lm
    return lm


# ---- the API -------------------------------------------------------------------------------------
def adapt(config_or_model: Any, scheme: str = "siamese", *, share: bool = False, norm: str | None = None,
          depth_attention: bool = False, depth_attention_stride: int | None = None,
          **scheme_options: Any) -> PreTrainedModel:
    """A causal LM of the family of ``config_or_model`` whose residual path is ``scheme``.

    From a configuration: a fresh model, the family's init. From a causal LM: built from a copy of its
    modules (``share=True``: the modules themselves, so training one trains both); ``adapt(model,
    "pre")`` computes what ``model`` computes. ``scheme_options`` are the scheme's; ``norm`` (default:
    the family's) replaces every norm, QK-norms too; ``depth_attention`` as our language model's.
    Raises ``UserError`` (one line) for an unsupported family, scheme or option."""
    _need_transformers5()
    if isinstance(config_or_model, BaseConfig):
        config, source = copy.deepcopy(config_or_model), None
    elif isinstance(config_or_model, PreTrainedModel):
        source = config_or_model
        if isinstance(source, _SchemeCausalLM):
            raise UserError("this model runs a scheme already; adapt the family's model it was "
                              "built from")
        config = copy.deepcopy(source.config)
    else:
        raise TypeError(f"adapt takes a transformers configuration or causal LM, got "
                        f"{type(config_or_model).__name__}")
    family = _family(family_of(getattr(config, "model_type", None)))
    cls = adapted_class(config.model_type)
    if source is not None and not isinstance(source, cls._family_class):
        raise UserError(f"adapt takes a {family.causal_lm} (or its configuration); got "
                          f"{type(source).__name__}")
    _refuse_host_options(scheme_options, config.model_type)
    model_options = {"norm": norm, "depth_attention": depth_attention,
                     "depth_attention_stride": depth_attention_stride}
    _check_model_options(model_options, "adapt: ")
    if norm == _family_norm(family, config)[0]:
        model_options["norm"] = None                  # the family's own
    _refuse_for_family(config, model_options)
    # every check of the scheme and its options (one-line UserErrors), on the meta device
    build_scheme(scheme, config.hidden_size, config.num_hidden_layers, device="meta",
                 norm=model_options["norm"] or "rmsnorm", **scheme_options)
    config = to_scheme_config(config)
    config.siamesenorm = {"scheme": scheme, "scheme_options": dict(scheme_options)} | {
        k: v for k, v in model_options.items() if v not in (None, False)}
    if source is None:
        return cls(config)
    out = cls(config, source=source if share else copy.deepcopy(source), shared=share)
    if _checkpointing(source):        # it trains as the source was set to
        enable = getattr(out, "activation_checkpointing_enable", None) or out.gradient_checkpointing_enable
        enable()
    return out.train(source.training)


def _checkpointing(model: nn.Module) -> bool:
    """Whether activation checkpointing is on anywhere in ``model``."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())
