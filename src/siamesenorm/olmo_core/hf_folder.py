"""A scheme model of OLMo-core as a Hugging Face folder, in one call (OLMo-core's ``save_hf_model``
refuses a scheme model)."""

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
    """Write ``model`` (built from ``config``; DTensors gathered) as the Hugging Face folder ``save_dir``,
    with ``tokenizer`` when given. What our LM config cannot express is refused first; a non-empty
    ``save_dir`` is refused unless ``overwrite``, which replaces only a folder siamesenorm wrote."""
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
