"""Hugging Face ``transformers`` integration (the ``hf`` extra): our language model, any scheme,
as a ``PreTrainedModel`` (:mod:`.modeling`), registered with ``AutoConfig``, ``AutoModel`` and
``AutoModelForCausalLM`` under the model type ``"siamesenorm"`` when this package is imported::

    import siamesenorm.hf
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(siamesenorm.hf.SiameseNormConfig(scheme="siamese"))

:func:`adapt` (:mod:`.adapted`) gives a decoder family of :data:`.families.FAMILIES` any scheme;
its model types (``siamesenorm_qwen3``, ...) are registered too, and :func:`save` writes such a
model as a folder that loads without siamesenorm (:mod:`.standalone`);
``model.family`` makes one the language model of our commands (:mod:`.family_lm`); :mod:`.export`
writes a trained model as a folder ``from_pretrained`` loads (docs/own_model.md). Without
transformers this package still imports (``model.family`` is checked through :mod:`.families`);
its names raise the ``ImportError`` that says what to install.
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised without the extra
    _MISSING: ImportError | None = error
else:
    _MISSING = None

__all__ = ["MODEL_TYPE", "DiagnosticsCallback", "SiameseNormCausalLMOutput", "SiameseNormConfig",
           "SiameseNormForCausalLM", "adapt", "adapt_from_pretrained", "save"]

if _MISSING is None:
    from .adapted import adapt, adapted_class, capture_outputs
    from .loading import adapt_from_pretrained
    from .modeling import (
        MODEL_TYPE,
        SiameseNormCausalLMOutput,
        SiameseNormConfig,
        SiameseNormForCausalLM,
    )
    from .saving import save
    from .standalone import register_families

    def _register() -> None:
        from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

        AutoConfig.register(MODEL_TYPE, SiameseNormConfig, exist_ok=True)
        AutoModel.register(SiameseNormConfig, SiameseNormForCausalLM, exist_ok=True)
        AutoModelForCausalLM.register(SiameseNormConfig, SiameseNormForCausalLM, exist_ok=True)
        if capture_outputs is not None:       # adapted families (siamesenorm_qwen3, ...): transformers 5
            register_families(adapted_class)

    _register()


def __getattr__(name: str):   # a name imported on first use, or one without transformers
    if name == "DiagnosticsCallback" and _MISSING is None:      # Trainer's modules: on first use
        from .diagnostics import DiagnosticsCallback
        return DiagnosticsCallback
    if _MISSING is not None and name in __all__:
        raise ImportError("siamesenorm.hf needs transformers: pip install 'siamesenorm[hf]'") \
            from _MISSING
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
