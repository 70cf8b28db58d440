"""Hugging Face ``transformers`` decoder families with any residual scheme.

:func:`siamesenorm.hf.adapt` (in :mod:`.adapt`, which needs transformers 5) turns a Llama-, Mistral-,
Qwen- or OLMo-family model into one whose residual path is a scheme of ours; :mod:`.model` makes
such a model a language model of our commands (``model.family`` in a run's configuration). This
module itself imports no ``transformers``: :data:`FAMILY_NAMES` is what a configuration is checked
against.
"""

FAMILY_NAMES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "olmoe", "olmo")

__all__ = ["FAMILY_NAMES"]
