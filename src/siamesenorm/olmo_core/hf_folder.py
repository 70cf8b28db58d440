"""A scheme model of OLMo-core as a Hugging Face folder, in one call.

OLMo-core's own ``save_hf_model`` writes the HF family its blocks belong to (OLMo2, Llama, ...); a
scheme model is none of them, and it refuses ("Block is not a ReorderedNormTransformerBlock").
:func:`save_hf_model` writes the folder ``siamesenorm export --format hf`` writes: our model's
config with ``auto_map``, the weights, and the modelling file, which ``from_pretrained(folder,
trust_remote_code=True)`` loads without siamesenorm.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from olmo_core.distributed.utils import get_full_tensor

from ..models.lm import LanguageModel
from .convert import lm_config, to_siamesenorm_state_dict
from .model import SchemeTransformer, SchemeTransformerConfig

__all__ = ["save_hf_model"]


def save_hf_model(save_dir: str | os.PathLike, model: SchemeTransformer, config: SchemeTransformerConfig,
                  *, tokenizer: Any = None, max_seq_len: int = 2048, overwrite: bool = False) -> Path:
    """Write ``model`` (built from ``config``; FSDP/TP DTensors are gathered) as a Hugging Face
    folder ``save_dir``, with a transformers ``tokenizer`` when given (its end token becomes the
    model's). What :func:`~.convert.lm_config` cannot express is refused in one line, before
    anything is written; a non-empty ``save_dir`` is refused unless ``overwrite``, which replaces
    only a folder siamesenorm wrote (never ``/``, home, the current folder or one holding it:
    :func:`siamesenorm.hf.folder.check_model_folder`)."""
    from ..hf.export import write_model_folder
    from ..hf.folder import check_model_folder, writing_model_folder

    names = {"force": overwrite, "flag": "save_dir", "force_flag": "overwrite=True"}
    check_model_folder(save_dir, **names)
    cfg = lm_config(config, max_seq_len=max_seq_len)
    state = {k: get_full_tensor(v).detach().cpu() for k, v in model.state_dict().items()}
    weight = state["embeddings.weight"]
    lm = LanguageModel(cfg, dtype=weight.dtype)
    lm.load_state_dict(to_siamesenorm_state_dict(state, tie_embeddings=config.tie_word_embeddings))
    with writing_model_folder(save_dir, written_by="olmo_core.save_hf_model", **names) as tmp:
        write_model_folder(tmp, lm.eval(), cfg, tokenizer)
    return Path(save_dir)
