"""Hugging Face ``transformers`` integration (the ``hf`` extra): our language model, any scheme,
as a ``PreTrainedModel``, registered with ``AutoConfig``, ``AutoModel`` and
``AutoModelForCausalLM`` under the model type ``"siamesenorm"`` when this package is imported::

    import siamesenorm.hf
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_config(siamesenorm.hf.SiameseNormConfig(scheme="siamese"))

``siamesenorm export RUN_DIR --format hf --out DIR`` writes a trained run as a model folder that
``from_pretrained`` loads, with or without this package installed.
"""

from __future__ import annotations

try:
    import transformers  # noqa: F401
except ImportError as error:  # pragma: no cover - exercised without the extra
    raise ImportError("siamesenorm.hf needs transformers: pip install 'siamesenorm[hf]'") from error

from ..families.adapt import adapt, adapt_from_pretrained
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

__all__ = ["MODEL_TYPE", "SiameseNormCausalLMOutput", "SiameseNormConfig", "SiameseNormForCausalLM",
           "adapt", "adapt_from_pretrained"]
