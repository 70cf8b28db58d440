"""What our two kinds of ``transformers`` model share: our own language model as one
(:mod:`.modeling`) and a family's model adapted to a scheme (:mod:`.adapted`).

- :data:`BaseConfig`: the configuration base class, under this transformers' name for it;
- :func:`cache_keyword`: this transformers' name for the KV cache, in a call or an output;
- :class:`SchemeCheckpointing`: transformers' activation checkpointing as ours, one scheme step at
  a time;
- :func:`load_legacy_names`: folders saved with an earlier layout's state names load;
- :func:`derive_buffers`: the constant buffers no state dict holds, derived again on loading.

This file uses only relative imports of the package and ``transformers``: the exported modelling
code (:mod:`.export`) ships it with :mod:`.modeling` and :mod:`.adapted`.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from typing import Any

try:                                    # transformers 5 names it PreTrainedConfig
    from transformers import PreTrainedConfig as BaseConfig
except ImportError:                     # pragma: no cover - transformers 4
    from transformers import PretrainedConfig as BaseConfig

from torch import nn

from ..models.checkpointing import set_scheme_checkpointing
from ..nn.rope import RotaryEmbedding

__all__ = ["BaseConfig", "SchemeCheckpointing", "cache_keyword", "derive_buffers", "load_legacy_names"]


def cache_keyword(obj: Any) -> str:
    """The name this transformers gives the KV cache in ``obj``: a function (its parameter, e.g.
    ``create_causal_mask``'s) or an output dataclass (its field, e.g. ``CausalLMOutputWithPast``'s).
    ``cache`` from transformers 5.2x, ``past_key_values`` before."""
    names = obj.__dataclass_fields__ if dataclasses.is_dataclass(obj) else inspect.signature(obj).parameters
    return "cache" if "cache" in names else "past_key_values"


class SchemeCheckpointing:
    """Mixed into a ``PreTrainedModel`` that runs a residual scheme (before ``PreTrainedModel`` in
    its bases): ``gradient_checkpointing_enable()`` (or ``activation_checkpointing_enable()``)
    checkpoints every scheme step (sublayer) with our own mechanism, which keeps the streams of
    multi-stream schemes consistent (``train.activation_checkpointing=sublayer``);
    ``gradient_checkpointing_disable()`` turns it off. ``every_n_layers`` other than 1 is refused.

    The class has its scheme at ``scheme``, and names in ``_checkpointing_flag`` the submodule whose
    ``gradient_checkpointing`` its forward reads (``""``: the model itself).
    """

    _checkpointing_flag = ""

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func: Any = None,
                                    every_n_layers: int = 1, **kwargs: Any) -> None:
        if enable and every_n_layers != 1:
            raise ValueError(f"{type(self).__name__} checkpoints every scheme step; every_n_layers "
                             f"must be 1")
        set_scheme_checkpointing(self.scheme, "sublayer" if enable else "none")
        self.get_submodule(self._checkpointing_flag).gradient_checkpointing = enable


def derive_buffers(module: nn.Module) -> None:
    """Fill ``module``'s constant buffers (RoPE's tables, mHC-lite's permutation matrices), which
    are derived, not saved: ``from_pretrained`` builds the model on the meta device, gives such
    buffers empty storage and calls the model's ``_init_weights`` on each module that holds one
    (and on no module whose parameters it loaded); our models' ``_init_weights`` call this. A
    module says how by its ``reset_buffers()``; RoPE's ``reset_parameters`` computes only its tables."""
    if isinstance(module, RotaryEmbedding):
        module.reset_parameters()
    reset = getattr(module, "reset_buffers", None)
    if callable(reset):
        reset()


def load_legacy_names(model: Any) -> None:
    """Let ``from_pretrained`` of ``type(model)`` read the names of an earlier layout: every
    ``legacy_state_names`` (old -> new, under a module path) that a class of its modules declares
    becomes a transformers 5 renaming of the checkpoint's keys on loading; saving writes the new
    names. Registered per class, growing with the modules its instances have."""
    try:
        from transformers.conversion_mapping import register_checkpoint_conversion_mapping
        from transformers.core_model_loading import WeightRenaming
    except ImportError:                 # pragma: no cover - transformers before 5.2
        return
    name = type(model).__name__
    known = _LEGACY_NAMES.setdefault(name, {})
    found = {old: new for module in model.modules()
             for old, new in getattr(type(module), "legacy_state_names", {}).items()}
    if not found.keys() - known.keys():
        return
    known.update(found)

    class LoadOnlyRenaming(WeightRenaming):
        __slots__ = ()

        def reverse_transform(self) -> WeightRenaming:      # saving keeps the names as they are
            return WeightRenaming(source_patterns=r"(?!)", target_patterns="")

    register_checkpoint_conversion_mapping(name, [
        LoadOnlyRenaming(source_patterns=r"\." + re.escape(old), target_patterns="." + new)
        for old, new in known.items()], overwrite=True)


_LEGACY_NAMES: dict[str, dict[str, str]] = {}      # class name -> the renamings registered for it
