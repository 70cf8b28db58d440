"""What our two kinds of ``transformers`` model share (:mod:`.modeling`, :mod:`.adapted`). Only
relative imports of the package and transformers: :mod:`.export` ships this file."""

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
    """This transformers' name for the KV cache in a function's parameters or an output dataclass:
    ``cache`` from transformers 5.2x, ``past_key_values`` before."""
    names = obj.__dataclass_fields__ if dataclasses.is_dataclass(obj) else inspect.signature(obj).parameters
    return "cache" if "cache" in names else "past_key_values"


class SchemeCheckpointing:
    """Mixed into a ``PreTrainedModel`` that runs a scheme: ``gradient_checkpointing_enable()``
    checkpoints every scheme step (``sublayer``); ``every_n_layers`` other than 1 is refused.
    ``_checkpointing_flag`` names the submodule whose ``gradient_checkpointing`` the forward reads."""

    _checkpointing_flag = ""

    def _set_gradient_checkpointing(self, enable: bool = True, gradient_checkpointing_func: Any = None,
                                    every_n_layers: int = 1, **kwargs: Any) -> None:
        if enable and every_n_layers != 1:
            raise ValueError(f"{type(self).__name__} checkpoints every scheme step; every_n_layers "
                             f"must be 1")
        set_scheme_checkpointing(self.scheme, "sublayer" if enable else "none")
        self.get_submodule(self._checkpointing_flag).gradient_checkpointing = enable


def derive_buffers(module: nn.Module) -> None:
    """Fill ``module``'s constant buffers (RoPE's tables, mHC-lite's permutations), which
    ``from_pretrained`` leaves empty; our models' ``_init_weights`` call this."""
    if isinstance(module, RotaryEmbedding):
        module.reset_parameters()
    reset = getattr(module, "reset_buffers", None)
    if callable(reset):
        reset()


def load_legacy_names(model: Any) -> None:
    """Let ``from_pretrained`` of ``type(model)`` read an earlier layout's names (its modules'
    ``legacy_state_names``); saving writes the new ones."""
    try:
        from transformers.conversion_mapping import (
            get_checkpoint_conversion_mapping,
            register_checkpoint_conversion_mapping,
        )
        from transformers.core_model_loading import WeightRenaming
    except ImportError:                 # pragma: no cover - transformers before 5.2
        return
    name = type(model).__name__
    found = {r"\." + re.escape(old): "." + new for module in model.modules()
             for old, new in getattr(type(module), "legacy_state_names", {}).items()}
    # what is registered under the name now: a folder's vendored copy of this code registers the
    # same class name with what its own model holds, so a cache of ours would go stale
    now = get_checkpoint_conversion_mapping(name) or []
    ours = [t for t in now if type(t).__name__ == "LoadOnlyRenaming"]
    registered = {source: target for t in ours
                  for source, target in zip(t.source_patterns, t.target_patterns)}
    if not found.keys() - registered.keys():
        return

    class LoadOnlyRenaming(WeightRenaming):
        __slots__ = ()

        def reverse_transform(self) -> WeightRenaming:      # saving keeps the names as they are
            return WeightRenaming(source_patterns=r"(?!)", target_patterns="")

    register_checkpoint_conversion_mapping(name, [t for t in now if t not in ours] + [
        LoadOnlyRenaming(source_patterns=source, target_patterns=target)
        for source, target in {**registered, **found}.items()], overwrite=True)
