"""Adapted models whose saved folders load as what they are: their own model type, and
``modeling_siamesenorm.py`` with an ``auto_map`` beside the weights."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ..errors import UserError
from .families import FAMILIES

__all__ = ["MODELING_FILE", "SavesItsCode", "family_of", "register_families", "scheme_config_class",
           "scheme_model_type", "to_scheme_config"]

MODELING_FILE = "modeling_siamesenorm.py"
PREFIX = "siamesenorm_"
_CONFIGS: dict[str, type] = {}


def scheme_model_type(family: str) -> str:
    return PREFIX + family


def family_of(model_type: str | None) -> str | None:
    """The family's model type of ``model_type``, ours (``siamesenorm_qwen3``) or its own."""
    if isinstance(model_type, str) and model_type.removeprefix(PREFIX) in FAMILIES:
        return model_type.removeprefix(PREFIX)
    return model_type


def scheme_config_class(family: str) -> type:
    """The family's configuration class under the model type ``siamesenorm_<family>``
    (``Qwen3SchemeConfig``); the scheme is its ``siamesenorm`` entry."""
    if family not in _CONFIGS:
        import transformers

        base = getattr(transformers, FAMILIES[family].config_class)
        name = base.__name__.removesuffix("Config") + "SchemeConfig"
        cls = type(name, (base,), {"__module__": __name__, "model_type": scheme_model_type(family),
                                   "__doc__": f"{base.__name__} of a model adapted to a residual "
                                              f"scheme (its 'siamesenorm' entry)."})
        globals()[name] = cls           # importable by name, as the adapted model classes are
        _CONFIGS[family] = cls
    return _CONFIGS[family]


def to_scheme_config(config: Any) -> Any:
    """``config`` made its family's scheme configuration in place; its name or path is cleared, so that
    nothing built on it (a PEFT adapter) points at the bare family."""
    cls = scheme_config_class(family_of(config.model_type))
    if not isinstance(config, cls):
        config.__class__ = cls
        vars(config).pop("model_type", None)      # one read from a file is set on the instance
    config.name_or_path = ""
    return config


class SavesItsCode:
    """Mixed into an adapted causal LM: ``save_pretrained`` writes the modelling code and ``auto_map``
    too, and the model takes the folder's path as its name. ``push_to_hub`` is refused."""

    # the modelling file a folder's own class was defined in (set by that file; ``None`` here: the
    # code is generated from this package)
    _modeling_file: str | None = None

    def save_pretrained(self, save_directory: str | os.PathLike, *args: Any, **kwargs: Any) -> None:
        if kwargs.get("push_to_hub"):
            raise UserError("save_pretrained(push_to_hub=True) of an adapted model would upload it "
                            "without its modelling code; save it to a folder, then upload the folder "
                            "(huggingface_hub.upload_folder)")
        stem = Path(MODELING_FILE).stem
        model, config = type(self).__name__, type(self.config).__name__
        self.config.auto_map = {"AutoConfig": f"{stem}.{config}", "AutoModel": f"{stem}.{model}",
                                "AutoModelForCausalLM": f"{stem}.{model}"}
        super().save_pretrained(save_directory, *args, **kwargs)
        main = args[0] if args else kwargs.get("is_main_process", True)
        if self.should_save_on_this_rank(main):
            _write(Path(save_directory) / MODELING_FILE, self._modeling_text())
        self.name_or_path = self.config.name_or_path = str(save_directory)

    def _modeling_text(self) -> str:
        if self._modeling_file is not None:          # a folder's own code: copied as it is
            return Path(self._modeling_file).read_text(encoding="utf-8")
        from .vendoring import family_modeling_source  # not shipped: never reached from a folder

        return family_modeling_source(family_of(self.config.model_type), type(self).__name__,
                                      type(self.config).__name__)


def _write(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def register_families(adapted_class: Any) -> None:
    """Every family's scheme configuration and adapted causal LM with the Auto classes; a family this
    transformers lacks is left out."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    for family in FAMILIES:
        try:
            config, model = scheme_config_class(family), adapted_class(family)
        except (ImportError, AttributeError):          # pragma: no cover - an older transformers
            continue
        AutoConfig.register(scheme_model_type(family), config, exist_ok=True)
        AutoModel.register(config, model, exist_ok=True)
        AutoModelForCausalLM.register(config, model, exist_ok=True)
