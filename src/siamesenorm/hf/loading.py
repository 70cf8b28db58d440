""":func:`adapt_from_pretrained`: an adapted model's saved folder, checked before anything is built
or any of its code could run."""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import AutoConfig, PreTrainedModel

from ..errors import UserError
from ..models.config_checks import MAX_EXPERT_LAYERS, MAX_EXPERTS, MAX_LAYERS, MAX_PARAMETERS
from ..rundir import read_json
from ..schemes.base import build_scheme
from .adapted import _need_transformers5, _spec_of, adapted_class
from .common import BaseConfig
from .families import FAMILIES
from .standalone import family_of, scheme_model_type, to_scheme_config

__all__ = ["SIZE_KEYS", "adapt_from_pretrained", "check_sizes"]

MAX_CONFIG_BYTES = 1 << 24      # a config.json of a thousand layers is some kilobytes
# The sizes of a family's configuration that shape the model (None allowed where the family
# derives them: key/value heads, head size, a window; MoE fields only in MoE families)
SIZE_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
             "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
             "sliding_window", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
             "decoder_sparse_step")
_REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")


def adapt_from_pretrained(path: str | os.PathLike, **kwargs: Any) -> PreTrainedModel:
    """The adapted model that ``save_pretrained`` wrote to the folder ``path``; ``kwargs`` go to
    ``from_pretrained`` (``config`` replaces the folder's).

    Raises ``UserError``, before anything is built, for a folder siamesenorm did not write (model
    type, no ``siamesenorm`` entry), sizes not positive or beyond our bounds, or sizes that do not
    match the weights' shapes; ``TypeError`` for a bad ``path`` or ``config``."""
    _need_transformers5()
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path).strip():
        raise TypeError(f"adapt_from_pretrained: path must be a folder's path, got {path!r}")
    folder = Path(path)
    if not folder.is_dir():
        raise UserError(f"adapt_from_pretrained: path {path} is not a folder; give the folder that "
                        "save_pretrained or siamesenorm.hf.save wrote (a model on the Hub: download "
                        "it first)")
    config = kwargs.pop("config", None)
    if config is not None and not isinstance(config, BaseConfig):
        raise TypeError(f"adapt_from_pretrained: config must be a transformers configuration, got "
                        f"{type(config).__name__}")
    where = f"{path}/config.json" if config is None else "config"
    values = read_json(folder / "config.json", max_bytes=MAX_CONFIG_BYTES) if config is None \
        else config.to_dict()
    if not isinstance(values, dict):
        raise UserError(f"{where} holds a JSON {type(values).__name__}, not a model's configuration")
    _check_ours(values, where, path)
    check_sizes(values, where)
    if config is None:          # our model types are registered: no code of the folder's is run
        config = AutoConfig.from_pretrained(folder, trust_remote_code=False)
    spec = _spec_of(config)
    # the scheme's checks (bounds included) before anything is built or read
    build_scheme(spec["scheme"], config.hidden_size, config.num_hidden_layers, device="meta",
                 **spec["scheme_options"])
    config = to_scheme_config(config)           # a folder of siamesenorm 0.1 has its family's type
    cls = adapted_class(config.model_type)
    _check_weights(cls, config, folder, where)
    return cls.from_pretrained(folder, config=config, **kwargs)


def _check_ours(values: Mapping[str, Any], where: str, path: Any) -> None:
    model_type = values.get("model_type")
    if not isinstance(model_type, str) or family_of(model_type) not in FAMILIES:
        ours = ", ".join(scheme_model_type(f) for f in FAMILIES)
        raise UserError(f"{where}: model_type {model_type!r} is not a model siamesenorm.hf.adapt "
                        f"builds ({ours}); adapt_from_pretrained loads only folders that "
                        "save_pretrained of an adapted model or siamesenorm.hf.save wrote (it runs "
                        "no code of a folder's)")
    if values.get("siamesenorm") is None:
        raise UserError(f"{path}: not saved from siamesenorm.hf.adapt (its config has no "
                        f"'siamesenorm' entry); load it with its family's from_pretrained and "
                        f"call siamesenorm.hf.adapt on it")


def check_sizes(values: Mapping[str, Any], where: str) -> None:
    """Refuse, naming the key, a size of ``values`` (a ``config.json``) that is not a positive integer or
    is beyond :mod:`~siamesenorm.models.config_checks`' bounds."""
    for key in SIZE_KEYS:
        value = values.get(key)
        if value is None and key not in _REQUIRED:
            continue
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise UserError(f"{where}: {key} must be a positive integer, got {value!r}")
    layers = values["num_hidden_layers"]
    if layers > MAX_LAYERS:
        raise UserError(f"{where}: num_hidden_layers={layers:,} is beyond what this library builds (at "
                        f"most {MAX_LAYERS:,}; the deepest published Transformers have about 1,000 layers)")
    experts = values.get("num_experts") or 0
    if experts > MAX_EXPERTS:
        raise UserError(f"{where}: num_experts={experts:,} is beyond what this library builds (at most "
                        f"{MAX_EXPERTS:,} per layer; the largest published mixtures have a few hundred)")
    if layers * experts > MAX_EXPERT_LAYERS:
        raise UserError(f"{where}: num_hidden_layers x num_experts = {layers * experts:,} experts, beyond "
                        f"what this library builds (at most {MAX_EXPERT_LAYERS:,} in all: each runs in turn)")
    parameters = _estimated_parameters(values)
    if parameters > MAX_PARAMETERS:
        raise UserError(f"{where}: vocab_size, hidden_size, intermediate_size, num_hidden_layers and the "
                        f"head and expert counts make about {parameters:.3g} parameters, beyond what this "
                        f"library builds (at most {MAX_PARAMETERS:.0e}); the file is damaged or not a "
                        "model's configuration")


def _estimated_parameters(values: Mapping[str, Any]) -> int:
    """Parameters from the sizes alone (norms left out), in Python integers: a bound."""
    d, heads = values["hidden_size"], values["num_attention_heads"]
    head = values.get("head_dim") or max(1, d // heads)
    kv = values.get("num_key_value_heads") or heads
    attention = 2 * d * heads * head + 2 * d * kv * head
    experts = values.get("num_experts") or 0
    mlp = 3 * d * (values.get("intermediate_size") or 4 * d)
    if experts:
        mlp = max(mlp, experts * (3 * d * (values.get("moe_intermediate_size") or 1) + d))
    tied = values.get("tie_word_embeddings", False) is True
    return values["vocab_size"] * d * (1 if tied else 2) + values["num_hidden_layers"] * (attention + mlp)


def _weight_shapes(folder: Path, where: str) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor in the folder's safetensors weights (headers only)."""
    from safetensors import safe_open

    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json(index, max_bytes=MAX_CONFIG_BYTES)
        files = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        if not isinstance(files, dict) or not all(isinstance(f, str) and Path(f).name == f
                                                  for f in files.values()):
            raise UserError(f"{index} is damaged: its weight_map must name files of the folder")
        names = sorted(set(files.values()))
    elif (folder / "model.safetensors").is_file():
        names = ["model.safetensors"]
    else:
        raise UserError(f"{folder} holds no model.safetensors (save_pretrained and siamesenorm.hf.save "
                        "write the weights there)")
    shapes: dict[str, tuple[int, ...]] = {}
    for name in names:
        try:
            with safe_open(str(folder / name), framework="pt") as f:
                for key in f.keys():
                    shapes[key] = tuple(f.get_slice(key).get_shape())
        except Exception as error:          # safetensors' own errors: a missing or damaged file
            first = (str(error).strip().splitlines() or [type(error).__name__])[0]
            raise UserError(f"cannot read the weights {folder / name}: {first}") from None
    return shapes


def _check_weights(cls: type, config: Any, folder: Path, where: str) -> None:
    """The model ``config`` describes, built on the meta device, has the shapes of the folder's weights."""
    stored = _weight_shapes(folder, where)
    with torch.device("meta"):
        shell = cls(copy.deepcopy(config))
    for name, tensor in shell.state_dict().items():
        if name in stored and tuple(tensor.shape) != stored[name]:
            sizes = ", ".join(f"{k}={getattr(config, k)}" for k in SIZE_KEYS[:7]
                              if getattr(config, k, None) is not None)
            raise UserError(f"{where} does not match the weights: {name} is {list(stored[name])} in the "
                            f"folder but {list(tensor.shape)} by the config ({sizes}); the folder is "
                            "damaged: save it again")
