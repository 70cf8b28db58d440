"""``siamesenorm.hf.save``: an adapted model as a self-contained Hugging Face model folder."""

from __future__ import annotations

import datetime
import os
from pathlib import Path
from typing import Any

from .. import __version__
from ..errors import UserError
from .folder import writing_model_folder
from .standalone import MODELING_FILE, SavesItsCode, family_of

__all__ = ["save"]


def save(model: Any, folder: str | os.PathLike, tokenizer: Any = None, *, force: bool = False) -> Path:
    """Write the adapted ``model`` (and ``tokenizer``) as the folder ``folder``, which loads with
    ``trust_remote_code=True`` where siamesenorm is not installed; the model takes its path as its
    name. ``force=True`` replaces a folder siamesenorm wrote (:mod:`.folder`). Returns the folder.

    Raises ``UserError`` (nothing written) for a model not adapted (a PEFT model: merge it first), a
    tokenizer without ``save_pretrained`` or a folder that may not be written."""
    from .export import _quiet_progress

    if not isinstance(folder, (str, os.PathLike)):
        raise TypeError(f"siamesenorm.hf.save: folder must be a path (str or os.PathLike), got "
                        f"{type(folder).__name__}")
    if not isinstance(force, bool):
        raise TypeError(f"siamesenorm.hf.save: force must be True or False, got {force!r}")
    if not os.fspath(folder).strip():
        raise UserError(f"siamesenorm.hf.save: folder is empty ({os.fspath(folder)!r}); give a path")
    if not isinstance(model, SavesItsCode):
        hint = ("merge its adapter first (merge_and_unload()), or save the adapter with its own "
                "save_pretrained" if hasattr(model, "peft_config") else "build it with siamesenorm.hf.adapt")
        raise UserError(f"siamesenorm.hf.save takes a model adapted to a scheme; got "
                        f"{type(model).__name__}: {hint}")
    if tokenizer is not None and not callable(getattr(tokenizer, "save_pretrained", None)):
        raise UserError(f"siamesenorm.hf.save: tokenizer must be a transformers tokenizer; got "
                        f"{type(tokenizer).__name__}")
    out = Path(folder)
    with writing_model_folder(out, force=force, written_by="siamesenorm.hf.save", flag="folder",
                              force_flag="force=True") as tmp:
        with _quiet_progress():
            model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / "README.md").write_text(model_card(model, out.name, tokenizer is not None), encoding="utf-8")
    model.name_or_path = model.config.name_or_path = str(out)
    return out


def model_card(model: Any, name: str, tokenizer: bool) -> str:
    """The folder's README.md: the family, the scheme and its options, the size, how to load it."""
    from ..schemes import get_scheme_class

    config, spec = model.config, model.config.siamesenorm
    scheme = get_scheme_class(spec["scheme"])
    options = ", ".join(f"{k}={v!r}" for k, v in spec.get("scheme_options", {}).items()) or "the defaults"
    family = family_of(config.model_type)
    lines = [
        "---", "library_name: transformers", "pipeline_tag: text-generation",
        f"tags: [siamesenorm, {spec['scheme']}, {family}, text-generation]", "---", "",
        f"# {name}: a {family} model with the `{spec['scheme']}` residual scheme", "",
        f"Saved by `siamesenorm.hf.save` (siamesenorm {__version__}, {datetime.date.today().isoformat()}): "
        f"transformers' {family} causal LM whose residual path and norms are the scheme's "
        "(`siamesenorm.hf.adapt`).", "",
        "## Model", "",
        f"- Model type: `{config.model_type}` (the {family} configuration; its `siamesenorm` entry "
        "names the scheme).",
        f"- Scheme: `{spec['scheme']}`, {scheme.paper}; options: {options}.",
        f"- Equation: `{scheme.summary}`",
        *_model_options(spec),
        f"- Size: {sum(p.numel() for p in model.parameters()):,} parameters; "
        f"{config.num_hidden_layers} blocks, width {config.hidden_size}, "
        f"{config.num_attention_heads} heads, vocabulary {config.vocab_size}.",
        "- SiameseNorm: Li et al., ICML 2026, arXiv 2602.08064 (the library this model comes from).",
        "", "## Use", "",
        f"The modelling code is in `{MODELING_FILE}` (generated; it holds the siamesenorm modules the "
        "model needs), so loading needs transformers and torch, not siamesenorm. Without "
        "`trust_remote_code=True` transformers refuses the folder.", "",
        "```python", "from transformers import AutoModelForCausalLM, pipeline", "",
        f'path = "{name}"   # this folder',
        "model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)",
    ]
    if tokenizer:
        lines += ['generate = pipeline("text-generation", model=path, trust_remote_code=True)',
                  'print(generate("Hello", max_new_tokens=20, do_sample=False)[0]["generated_text"])']
    lines += ["```", "",
              "With siamesenorm installed, `import siamesenorm.hf` registers the model type; "
              "`from_pretrained(path)` then uses the installed code, with or without "
              "`trust_remote_code`.", ""]
    return "\n".join(lines)


def _model_options(spec: dict) -> list[str]:
    out = [f"- Norms: `{spec['norm']}` in place of the family's, QK-norms too."] if spec.get("norm") else []
    if spec.get("depth_attention"):
        stride = spec.get("depth_attention_stride") or "half the layers"
        out.append(f"- Depth-Attention (arXiv 2606.05014), stride {stride}.")
    return out
