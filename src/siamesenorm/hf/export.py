"""A trained language model as a Hugging Face model folder that ``from_pretrained`` loads with
transformers alone: weights, configs, the run's tokenizer as a fast tokenizer, the generated
modelling file (:mod:`.vendoring`) and a model card (docs/own_model.md, "The exported folder").
The command is ``siamesenorm export --format hf`` (:mod:`siamesenorm.commands.hf_export`).
"""

from __future__ import annotations

import contextlib
import datetime
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from .. import __version__
from .folder import writing_model_folder
from .standalone import MODELING_FILE
from .vendoring import modeling_source

__all__ = ["MODELING_FILE", "byte_level_backend", "hf_tokenizer", "model_card", "modeling_source",
           "write_export", "write_model_folder"]

_AUTO_MAP = {"AutoConfig": "SiameseNormConfig", "AutoModel": "SiameseNormForCausalLM",
             "AutoModelForCausalLM": "SiameseNormForCausalLM"}
_END_BYTE = 0       # the NUL byte: the end and padding token of an exported tokenizer


def write_export(out: Path, model, cfg, tokenizer, card: str, *, force: bool = False) -> None:
    """The trained ``model`` of the run configuration ``cfg`` as the folder ``out`` (:mod:`.folder`:
    written aside, renamed at the end; ``force`` replaces one siamesenorm wrote)."""
    with writing_model_folder(out, force=force, written_by="export --format hf") as tmp:
        (_write_family_folder if cfg.model.family else _write_folder)(tmp, model, cfg, tokenizer)
        (tmp / "README.md").write_text(card, encoding="utf-8")


def _write_family_folder(folder: Path, model, cfg, tokenizer) -> None:
    """As :func:`_write_folder` for a run of a transformers family (``model.family``): the adapted
    family model as it saves itself (:mod:`.standalone`: its family's config under our model type,
    ``siamesenorm`` the scheme, and its modelling code)."""
    from transformers import GenerationConfig

    adapted = model.hf
    hf_tok = hf_tokenizer(tokenizer, cfg.model.max_seq_len) if tokenizer is not None else None
    end = hf_tok.eos_token_id if hf_tok is not None else None
    adapted.config.eos_token_id = adapted.config.pad_token_id = end
    adapted.config.use_cache = True
    adapted.generation_config = GenerationConfig(eos_token_id=end, pad_token_id=end)
    with _quiet_progress():
        adapted.save_pretrained(folder)         # with its modelling code (hf.standalone)
    if hf_tok is not None:
        hf_tok.save_pretrained(folder)
        _name_tokenizer_class(folder)


def _write_folder(folder: Path, model, cfg, tokenizer) -> None:
    """config.json, the weights, generation_config.json, the tokenizer and the modelling file."""
    hf_tok = hf_tokenizer(tokenizer, cfg.model.max_seq_len) if tokenizer is not None else None
    write_model_folder(folder, model, cfg.model, hf_tok)
    if hf_tok is not None:
        _name_tokenizer_class(folder)


def _name_tokenizer_class(folder: Path) -> None:
    """The class's name of transformers 4 and 5 alike in tokenizer_config.json (5 writes its new
    name, TokenizersBackend)."""
    path = folder / "tokenizer_config.json"
    settings = json.loads(path.read_text(encoding="utf-8"))
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    path.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def write_model_folder(folder: Path, model, model_cfg, tokenizer: Any = None) -> None:
    """Our language model ``model`` (of the :class:`~siamesenorm.models.LMConfig` ``model_cfg``) as
    the Hugging Face folder ``folder``: config.json with ``auto_map``, the weights,
    generation_config.json and the modelling file; ``tokenizer`` (a transformers tokenizer, its end
    token the model's) saved beside when given."""
    import torch
    from transformers import GenerationConfig

    from .modeling import SiameseNormConfig, SiameseNormForCausalLM

    end = getattr(tokenizer, "eos_token_id", None)
    config = SiameseNormConfig.from_lm_config(model_cfg, eos_token_id=end, pad_token_id=end)
    config.auto_map = {auto: f"{Path(MODELING_FILE).stem}.{cls}" for auto, cls in _AUTO_MAP.items()}
    with torch.device("meta"):          # a shell: the trained model goes inside
        wrapper = SiameseNormForCausalLM(config)
    wrapper.model = model
    wrapper.generation_config = GenerationConfig(eos_token_id=end, pad_token_id=end)
    with _quiet_progress():
        wrapper.save_pretrained(folder)
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    (folder / MODELING_FILE).write_text(modeling_source(), encoding="utf-8")


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """transformers' progress bars off (one line of output is the command's)."""
    from transformers.utils import logging

    was = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            logging.enable_progress_bar()


# ---- the tokenizer -----------------------------------------------------------------------------
def byte_level_backend():
    """A ``tokenizers.Tokenizer`` equal to our :class:`~siamesenorm.data.ByteTokenizer`: UTF-8
    bytes as ids, via the byte-level symbols (a BPE model with the 256 symbols at their byte
    values and no merges)."""
    import tokenizers as tk

    backend = tk.Tokenizer(tk.models.BPE(vocab=_byte_symbols(), merges=[]))
    backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = tk.decoders.ByteLevel()
    return backend


def _byte_symbols() -> dict[str, int]:
    """The byte-level pre-tokenizer's symbol of each byte -> the byte: printable Latin-1 bytes
    stand for themselves, the other 68 take the code points from 256 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    symbols = {chr(b): b for b in printable}
    rest = [b for b in range(256) if b not in set(printable)]
    symbols.update({chr(256 + k): b for k, b in enumerate(rest)})
    return symbols


def hf_tokenizer(tokenizer, max_seq_len: int):
    """Our run tokenizer (bytes or BPE) as a transformers fast tokenizer: the same ids for any text,
    the NUL byte's token as end and padding token (see the module docstring), left padding."""
    from transformers import PreTrainedTokenizerFast

    from ..data import BPETokenizer, ByteTokenizer

    if isinstance(tokenizer, ByteTokenizer):
        backend = byte_level_backend()
    elif isinstance(tokenizer, BPETokenizer):
        import tokenizers as tk

        backend = tk.Tokenizer.from_str(tokenizer._backend.to_str())     # a copy: wrapping changes it
    else:
        raise TypeError(f"no Hugging Face form for the tokenizer {type(tokenizer).__name__}")
    end = next(s for s, b in _byte_symbols().items() if b == _END_BYTE)
    special = {"eos_token": end, "pad_token": end} if backend.token_to_id(end) is not None else {}
    return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False,
                                   split_special_tokens=True, padding_side="left",
                                   model_max_length=max_seq_len, **special)


# ---- the model card ----------------------------------------------------------------------------
def model_card(cfg, info: dict[str, Any], summary: dict[str, Any] | None, name: str) -> str:
    """The folder's README.md: what the model is, what it was trained on, how it did, how to load
    it. ``summary`` is the run's summary.json (``None`` when it has none)."""
    from ..schemes import get_scheme_class, scheme_options

    m = cfg.model
    scheme = get_scheme_class(m.scheme)
    options = {**scheme_options(m.scheme), **m.scheme_options}
    changed = sorted(k for k, v in m.scheme_options.items() if scheme_options(m.scheme).get(k) != v)
    opts = ", ".join(f"{k}={v!r}" for k, v in options.items()) or "none"
    kv = f" ({m.kv_heads} key/value heads)" if m.kv_heads != m.n_heads else ""
    moe = f"; mixture of experts every {m.moe.every} blocks ({m.moe.n_experts} experts, top {m.moe.top_k})" \
        if m.moe.every else ""
    tok = info["tokenizer"]
    tok_line = {"bytes": "bytes: the UTF-8 bytes of the text, id = byte value (256 ids)",
                "bpe": f"byte-level BPE trained on the run's training text ({m.vocab_size} ids in the model)",
                None: "none: the run was trained on token files; give the model token ids"}[tok]
    lines = [
        "---", "library_name: transformers", "pipeline_tag: text-generation",
        f"tags: [siamesenorm, {m.scheme}, text-generation]", "---", "",
        f"# {name}: a language model with the `{m.scheme}` residual scheme", "",
        f"Exported by `siamesenorm export --format hf` (siamesenorm {__version__}, "
        f"{datetime.date.today().isoformat()}) from a training run of siamesenorm: the weights of its "
        f"checkpoint at step {info['step']}.", "",
        "## Model", "",
        f"- Scheme: `{m.scheme}`, {scheme.paper}.",
        f"- Equation: `{scheme.summary}`" + (f" (the default form; this model changes {', '.join(changed)})"
                                              if changed else ""),
        f"- Scheme options: {opts}.",
        f"- Size: {info['parameters']:,} parameters; {m.n_layers} blocks, width {m.dim}, {m.n_heads} "
        f"heads{kv}, {m.mlp} MLP, {m.norm} (eps {m.norm_eps}), RoPE, context {m.max_seq_len} tokens, "
        f"vocabulary {m.vocab_size}, {'tied' if m.tie_embeddings else 'untied'} embeddings{moe}.",
        f"- Tokenizer: {tok_line}.",
    ]
    if tok is not None:
        lines.append("- End and padding token: the NUL byte's token. The model was trained without an "
                     "end-of-text token, so generation runs to `max_new_tokens` (or the context length) "
                     "unless it writes a NUL byte.")
    lines += ["- SiameseNorm: Li et al., ICML 2026, arXiv 2602.08064 (the library this model comes from).",
              "", "## Training", "", *_training_lines(cfg, summary), "", "## Use", "",
              f"The modelling code is in `{MODELING_FILE}` (generated; it holds the siamesenorm modules "
              "the model needs), so loading needs transformers and torch but not siamesenorm:", "",
              "```python",
              "from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline", "",
              f'path = "{name}"   # this folder',
              "model = AutoModelForCausalLM.from_pretrained(path, trust_remote_code=True)"]
    if tok is not None:
        lines += ["tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)",
                  'generate = pipeline("text-generation", model=path, trust_remote_code=True)',
                  f'print(generate("def ", max_new_tokens={min(20, max(1, m.max_seq_len - 8))}, '
                  'do_sample=False)[0]["generated_text"])']
    lines += ["```", "",
              "With siamesenorm installed, `import siamesenorm.hf` registers the model type; from then "
              "on `from_pretrained(path)` uses the installed code, with or without `trust_remote_code`. "
              f"Prompt and continuation together must fit the context of {m.max_seq_len} tokens.", ""]
    return "\n".join(lines)


def _training_lines(cfg, summary: dict[str, Any] | None) -> list[str]:
    data = (summary or {}).get("data") or {"name": cfg.data.corpus}
    fingerprint = data.get("fingerprint")
    lines = [f"- Data: `{data.get('name')}`" + (f", fingerprint `{json.dumps(fingerprint, sort_keys=True)}`"
                                                 if fingerprint is not None else ", no fingerprint recorded")
             + f"; sequences of {cfg.data.seq_len} tokens, batches of {cfg.data.batch_size}."]
    if summary is None:
        return lines + ["- The run has no summary.json (it did not finish): no final metrics."]

    def num(key: str, fmt: str = ".4f") -> str:
        value = summary.get(key)
        return "n/a" if value is None else format(value, fmt)

    lines += [f"- Steps: {summary.get('steps')} of {summary.get('steps_planned', 'n/a')} planned; "
              f"tokens seen: {num('tokens_seen', ',')}; seed {cfg.seed}; learning rate {cfg.train.lr}.",
              f"- Final validation loss: {num('final_val_loss')} (perplexity {num('final_val_ppl', '.2f')}); "
              f"best {num('best_val_loss')} at step {summary.get('best_val_step', 'n/a')}; final training "
              f"loss {num('final_loss')}."]
    if summary.get("diverged"):
        lines.append(f"- The run diverged at step {summary.get('diverged_at')}.")
    return lines
