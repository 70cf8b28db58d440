"""Hugging Face ``transformers`` integration (the ``hf`` extra): our language model, any scheme,
as a ``PreTrainedModel``, registered with ``AutoConfig``, ``AutoModel`` and
``AutoModelForCausalLM`` under the model type ``"siamesenorm"`` when this package is imported::

    import siamesenorm.hf
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(siamesenorm.hf.SiameseNormConfig(scheme="siamese"))

``siamesenorm export RUN_DIR --format hf --out DIR`` writes a trained run as a model folder that
``from_pretrained`` loads, with or without this package installed.

:func:`adapt` gives a Hugging Face decoder family (Llama, Mistral, Qwen, OLMo: the table
:data:`.families.FAMILIES`) any scheme; ``model.family`` makes such a model the language model of
our commands (:mod:`.family_lm`).

The modules:

- :mod:`.modeling`: our model as a ``PreTrainedModel`` (``SiameseNormConfig``, ...);
- :mod:`.families`: the supported families, what each needs, and the check of a run's
  ``model.family`` (imports no ``transformers``);
- :mod:`.adapted`: :func:`adapt`, :func:`adapt_from_pretrained`, the adapted classes;
- :mod:`.family_lm`: ``FamilyLM``, an adapted family model behind our language model's interface;
- :mod:`.common`: what the two kinds of model share (transformers' names across versions,
  activation checkpointing);
- :mod:`.export`: ``siamesenorm export --format hf``.

Without transformers this package still imports (a run's ``model.family`` is checked, with a
one-line error, through :mod:`.families`); its names raise the ``ImportError`` that says what to
install.
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised without the extra
    _MISSING: ImportError | None = error
else:
    _MISSING = None

__all__ = ["MODEL_TYPE", "SiameseNormCausalLMOutput", "SiameseNormConfig", "SiameseNormForCausalLM",
           "adapt", "adapt_from_pretrained"]

if _MISSING is None:
    from .adapted import adapt, adapt_from_pretrained
    from .modeling import (
        MODEL_TYPE,
        SiameseNormCausalLMOutput,
        SiameseNormConfig,
        SiameseNormForCausalLM,
    )

    def _register() -> None:
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

        AutoConfig.register(MODEL_TYPE, SiameseNormConfig, exist_ok=True)
        AutoModel.register(SiameseNormConfig, SiameseNormForCausalLM, exist_ok=True)
        AutoModelForCausalLM.register(SiameseNormConfig, SiameseNormForCausalLM, exist_ok=True)

    _register()


def __getattr__(name: str):   # only reached without transformers, or for a name that is not here
    if _MISSING is not None and name in __all__:
        raise ImportError("siamesenorm.hf needs transformers: pip install 'siamesenorm[hf]'") \
            from _MISSING
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
