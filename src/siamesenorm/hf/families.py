"""Hugging Face ``transformers`` decoder families with any residual scheme.

:func:`siamesenorm.hf.adapt` (in :mod:`.adapted`, which needs transformers 5) turns a Llama-,
Mistral-, Qwen- or OLMo-family model into one whose residual path is a scheme of ours;
:mod:`.family_lm` makes such a model a language model of our commands (``model.family`` in a
run's configuration). This module itself imports no ``transformers``: :data:`FAMILY_NAMES` is what
a configuration is checked against.
"""

import inspect

from ..errors import ConfigError

FAMILY_NAMES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "olmoe", "olmo")

__all__ = ["FAMILY_NAMES", "check_family"]


def check_family(family: str, options: dict) -> None:
    """A configuration's ``model.family`` and ``model.family_options``: a known family, transformers
    5 installed, and options that are fields of the family's configuration (one-line errors)."""
    if family not in FAMILY_NAMES:
        raise ConfigError(f"model.family: unknown value {family!r}; choose one of "
                          f"{', '.join(FAMILY_NAMES)} (or leave it empty for our own language model)")
    try:
        from transformers import (
            CONFIG_MAPPING,
            masking_utils,  # noqa: F401 - transformers 5
        )
    except ImportError:
        raise ConfigError(f"model.family={family} needs transformers 5: pip install 'siamesenorm[hf]'") \
            from None
    cls = CONFIG_MAPPING[family]
    accepted = set(inspect.signature(cls.__init__).parameters) | {"attn_implementation"}
    unknown = sorted(set(options) - accepted - {"self", "kwargs"})
    if unknown:
        raise ConfigError(f"model.family_options.{unknown[0]}: {cls.__name__} has no field {unknown[0]!r}")
