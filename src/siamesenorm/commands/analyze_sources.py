"""``siamesenorm analyze SOURCE``: SOURCE is a run directory, a Hugging Face model folder siamesenorm
wrote (``hf.save``, ``export --format hf``, a Trainer's ``save_model`` of an adapted model) or an
OLMo-core checkpoint of a scheme model (docs/analysis.md)."""

from __future__ import annotations

import dataclasses
import os
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..analysis import analyze_model, lm_head, lm_loss, write_analysis
from ..analysis.training_probes import to_device
from ..devices import resolve_device
from ..errors import UserError
from ..rundir import check_out_dir, read_json
from ..tasks.finished import analyze_run

__all__ = ["analyze_source", "source_kind"]

HF_CONFIG_BYTES = 1 << 24
DEFAULT_BATCHES, DEFAULT_BATCH_SIZE, MAX_DEFAULT_SEQ_LEN = 2, 4, 256
_STEP = re.compile(r"step\d+")
_WHAT = {"hf": "a Hugging Face model folder", "olmo_core": "an OLMo-core checkpoint"}


def source_kind(path: str | os.PathLike) -> str:
    """``"run"``, ``"hf"`` (a folder with config.json) or ``"olmo_core"`` (model_and_optim/, or
    stepN/ folders holding one)."""
    p = Path(path)
    if not p.is_dir() or (p / "config.yaml").is_file():
        return "run"
    if (p / "model_and_optim").is_dir() or any(
            _STEP.fullmatch(c.name) and (c / "model_and_optim").is_dir() for c in p.iterdir() if c.is_dir()):
        return "olmo_core"
    return "hf" if (p / "config.json").is_file() else "run"


def analyze_source(source: str | os.PathLike, data: str | None = None, *, batches: int | None = None,
                   device: str = "cpu", out: str | os.PathLike | None = None, seq_len: int | None = None,
                   batch_size: int | None = None) -> dict[str, Any]:
    """Every diagnostic on the model of ``source``, written to ``out`` (a run: default the run)."""
    for flag, value in (("--batches", batches), ("--seq-len", seq_len), ("--batch-size", batch_size)):
        if value is not None and value <= 0:
            raise UserError(f"{flag} must be positive, got {value}")
    kind = source_kind(source)
    if kind == "run":
        if seq_len is not None or batch_size is not None:
            raise UserError("--seq-len and --batch-size are for a model folder or an OLMo-core checkpoint; "
                            "a run is analysed at its own data.seq_len and data.batch_size")
        return analyze_run(source, data, batches=batches, device=device, out=out)
    dev = resolve_device(device, "--device")
    if out is None:
        raise UserError(f"{source} is {_WHAT[kind]}: give --out DIR, where analysis.json and its plots go")
    check_out_dir(out)
    if data is None:
        what = "token files (.bin)" if kind == "olmo_core" else \
            "a text file or folder (read with the folder's tokenizer) or token files (.bin)"
        raise UserError(f"{source} is {_WHAT[kind]} and holds no data to analyse: give --data, {what}")
    n = batches or DEFAULT_BATCHES
    if kind == "olmo_core":
        model, chosen, loss_fn, head_fn, probes_dir = _olmo_core(source, data, n, seq_len, batch_size, out)
    else:
        model, chosen, loss_fn, head_fn = _hf(source, data, n, seq_len, batch_size)
        probes_dir = Path(source)
    model = model.to(dev).eval()
    with torch.random.fork_rng(devices=[]):
        result = analyze_model(model, [to_device(b, dev) for b in chosen], loss_fn, head_fn)
    write_analysis(out, result, source=str(data), run_dir=probes_dir)
    return result


# ---- an OLMo-core checkpoint ---------------------------------------------------------------------
def _olmo_core(source, data, n, seq_len, batch_size, out):
    import importlib.util

    if importlib.util.find_spec("olmo_core") is None:
        raise UserError("analyze reads an OLMo-core checkpoint's model config with OLMo-core: "
                        "pip install 'siamesenorm[olmo]'")
    from ..olmo_core.to_run import find_checkpoint
    from ..tasks.registry import get_task
    from .olmo_import import check_data, check_memory, run_config, trained_model

    ckpt = find_checkpoint(source)
    cfg = run_config(ckpt, data)
    sizes = {k: v for k, v in (("seq_len", seq_len), ("batch_size", batch_size)) if v is not None}
    if sizes:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **sizes))
    if cfg.data.seq_len > cfg.model.max_seq_len:
        raise UserError(f"--seq-len {cfg.data.seq_len} is beyond the model's {cfg.model.max_seq_len}")
    check_memory(ckpt, cfg)
    check_data(cfg, Path(out))
    task = get_task(cfg.task)
    chosen = task.analysis_batches(cfg, Path(out), cfg.data.corpus, n)
    return trained_model(ckpt, cfg), chosen, task.loss_fn, task.head_fn, ckpt.save_folder


# ---- a Hugging Face model folder -----------------------------------------------------------------
def _hf(source, data, n, seq_len, batch_size):
    import importlib.util

    if importlib.util.find_spec("transformers") is None:
        raise UserError("analyze reads a Hugging Face model folder with transformers: "
                        "pip install 'siamesenorm[hf]'")
    folder = Path(source)
    config = read_json(folder / "config.json", max_bytes=HF_CONFIG_BYTES)
    if not isinstance(config, dict):
        raise UserError(f"{folder / 'config.json'} is not a model's configuration (a JSON object)")
    from ..hf import MODEL_TYPE
    from ..hf.export import _quiet_progress

    ours = config.get("model_type") == MODEL_TYPE
    longest = config.get("max_seq_len" if ours else "max_position_embeddings")
    longest = longest if isinstance(longest, int) and longest > 0 else MAX_DEFAULT_SEQ_LEN
    seq_len = seq_len or min(MAX_DEFAULT_SEQ_LEN, longest)
    if seq_len > longest:
        raise UserError(f"--seq-len {seq_len} is beyond the model's {longest} positions")
    vocab = config.get("vocab_size")
    tokens = _tokens(folder, data, vocab if isinstance(vocab, int) else 0)
    from ..data import validation_batches

    chosen = validation_batches(tokens, batch_size or DEFAULT_BATCH_SIZE, seq_len, n)
    with _quiet_progress():
        if ours:
            model, loss_fn, head_fn = _exported(folder)
        else:
            from ..hf import adapt_from_pretrained
            from ..hf.diagnostics import hf_head, hf_loss, scheme_view

            model, loss_fn, head_fn = scheme_view(adapt_from_pretrained(folder)), hf_loss, hf_head
    return model, chosen, loss_fn, head_fn


def _exported(folder: Path):
    """Our language model of an ``export --format hf`` folder, checked as LMConfig checks it."""
    from ..hf import SiameseNormConfig, SiameseNormForCausalLM

    try:
        cfg = SiameseNormConfig.from_pretrained(folder)
        cfg.to_lm_config()          # its checks, before anything is built
        model = SiameseNormForCausalLM.from_pretrained(folder, config=cfg)
    except (OSError, ValueError, TypeError, RuntimeError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise UserError(f"cannot load the model folder {folder}: {first}") from None
    return model.model, lm_loss, lm_head


def _tokens(folder: Path, data: str, vocab: int) -> np.ndarray:
    """All of ``data``: token files as they are, text through the folder's tokenizer."""
    from ..data import load_corpus

    corpus = load_corpus(data)
    if corpus.is_tokenized:
        parts = [corpus.tokens] + ([corpus.val_tokens] if corpus.val_tokens is not None else [])
    else:
        tokenizer = _tokenizer(folder, data)
        texts = [corpus.text] + ([corpus.val_text] if corpus.val_text is not None else [])
        parts = [np.asarray(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    tokens = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts])
    if len(tokens) and vocab and int(tokens.max()) >= vocab:
        raise UserError(f"--data {data} holds token id {int(tokens.max())}, beyond the model's vocabulary "
                        f"of {vocab}; give data tokenized for this model")
    return tokens


def _tokenizer(folder: Path, data: str):
    if not any((folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")):
        raise UserError(f"{folder} has no tokenizer for the text in --data {data}; give token files (.bin)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder, trust_remote_code=False)
    except (OSError, ValueError, TypeError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise UserError(f"cannot load the tokenizer of {folder}: {first}") from None
