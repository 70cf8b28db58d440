"""``siamesenorm import-olmo-core CKPT --out RUN``: an OLMo-core checkpoint of one of our scheme models
as one of our run directories, which ``export`` and ``analyze`` take (``generate`` and ``--resume``
refuse it). What it writes: docs/olmo-core.md, "From an OLMo-core run to ours".
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from ..config import dump_config
from ..errors import UserError
from ..models.lm import LanguageModel
from ..olmo_core import to_run
from ..olmo_core.to_run import MODEL_PREFIX, OLMoCoreCheckpoint, finite_number
from ..rundir import RunDir, check_out_dir, plain, write_json, write_text
from ..tasks.lm import UNSET_CORPUS, DataConfig, LMRunConfig
from ..tasks.registry import get_task, load_config
from ..train.checkpoint import read_dcp, save_checkpoint
from ..train.optim import build_optimizer
from ..train.state import RunState

__all__ = ["CONFIG_COPY", "import_olmo_core", "read_model_tensors", "run_config"]

CONFIG_COPY = "olmo-core-config.json"


def run_config(ckpt: OLMoCoreCheckpoint, data: str | None = None) -> LMRunConfig:
    """Our configuration of the run ``ckpt`` belongs to; ``data``: the data ``analyze`` reads by
    default (a path, made absolute)."""
    found = to_run.run_settings(ckpt)
    corpus = UNSET_CORPUS if data is None else _absolute(data)
    return LMRunConfig(model=found.model, train=found.train, seed=found.seed,
                       data=DataConfig(corpus=corpus, batch_size=found.microbatch, seq_len=found.seq_len))


def _absolute(spec: str) -> str:
    if not spec.strip():
        raise UserError("--data is empty; give token files (.bin)")
    return os.path.abspath(os.path.expanduser(spec))


def check_data(cfg: LMRunConfig, run_dir: Path) -> None:
    """Refuse analysis data that ``analyze`` could not use with this model: not token files, ids
    beyond the vocabulary, too few tokens for one batch."""
    from ..data import load_corpus
    from ..data.text.corpora import resolve_paths

    spec = cfg.data.corpus
    files, _ = resolve_paths(spec)
    if any(f.suffix == ".npy" for f in files):
        raise UserError(f"--data {spec}: siamesenorm reads token files named .bin; OLMo-core's uint16 .npy "
                        "files hold the same bytes (headerless ids): link them (ln -s X.npy X.bin)")
    corpus = load_corpus(spec)
    if not corpus.is_tokenized:
        raise UserError(f"--data {spec} is text, and the OLMo-core run has no tokenizer here: give "
                        "token files (.bin: headerless uint16 ids, or modded-nanogpt shards)")
    top = max(int(corpus.meta["max_token"]),
              int(corpus.val_tokens.max()) if corpus.val_tokens is not None and len(corpus.val_tokens) else 0)
    if top >= cfg.model.vocab_size:
        raise UserError(f"--data {spec} holds token id {top}, beyond the model's vocabulary of "
                        f"{cfg.model.vocab_size}; give data tokenized for this model")
    get_task(cfg.task).analysis_batches(cfg, run_dir, None, 1)


# ---- memory and weights ----------------------------------------------------------------------------
def _refuse_beyond_memory(need: int, detail: str) -> None:
    """``train``'s memory bound on the ``need`` bytes the import holds at once."""
    from ..devices import machine_memory
    from ..tasks.dryrun import refuse_beyond_memory

    cpu = torch.device("cpu")
    available = machine_memory(cpu)
    if available is not None:
        refuse_beyond_memory(need, available, cpu, detail, fix="import it on a machine with more memory, "
                             "or check the sizes in the checkpoint's config.json and .metadata")


def read_model_tensors(folder: str | os.PathLike) -> dict[str, Tensor]:
    """The model's tensors of OLMo-core's ``model_and_optim/`` ``folder`` by parameter name, on the
    CPU; refused before any is allocated when ``.metadata``'s sizes could not fit this machine."""
    folder = Path(folder)
    entries = to_run.model_entries(folder)
    _refuse_beyond_memory(to_run.entry_bytes(entries),
                          f"the {len(entries)} model tensors that {folder / '.metadata'} describes")
    state = {MODEL_PREFIX + name: torch.empty(tuple(e.size), dtype=e.properties.dtype)
             for name, e in entries.items()}
    read_dcp(folder, state)
    return {key[len(MODEL_PREFIX):]: tensor for key, tensor in state.items()}


def check_memory(ckpt: OLMoCoreCheckpoint, cfg: LMRunConfig) -> None:
    """Refuse, before anything is read or built, an import whose model (float32, with its rotary
    tables) and the checkpoint's tensors could not fit this machine's memory by far."""
    from ..tasks.dryrun import memory_floor

    floor = memory_floor(cfg)
    saved = to_run.entry_bytes(to_run.model_entries(ckpt.model_and_optim))
    need = 4 * floor["parameters"] + floor["buffers"] + saved
    _refuse_beyond_memory(need, f"{floor['parameters']:.3g} parameters as float32, "
                                f"{floor['buffers'] / 2**30:,.1f} GiB of rotary tables and the checkpoint's "
                                f"{saved / 2**30:,.1f} GiB of model tensors")


def trained_model(ckpt: OLMoCoreCheckpoint, cfg: LMRunConfig) -> LanguageModel:
    """Our ``LanguageModel`` of ``cfg`` with the checkpoint's weights."""
    from ..olmo_core.convert import to_siamesenorm_state_dict

    tensors = read_model_tensors(ckpt.model_and_optim)
    try:
        state = to_siamesenorm_state_dict(tensors, tie_embeddings=cfg.model.tie_embeddings)
    except KeyError as error:
        raise UserError(f"the checkpoint's tensor {error.args[0]} has no counterpart in our "
                        "LanguageModel") from None
    model = LanguageModel(cfg.model)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    shape = next((k for k in expected if k in state and state[k].shape != expected[k].shape), None)
    if missing or unexpected or shape:
        detail = f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}" if unexpected \
            else f"{shape} has shape {tuple(state[shape].shape)}, the model {tuple(expected[shape].shape)}"
        raise UserError(f"the tensors of {ckpt.model_and_optim} do not fit the model its config.json "
                        f"describes ({detail})")
    model.load_state_dict(state, strict=True)
    return model.eval()


# ---- the command -----------------------------------------------------------------------------
def _check_out(out: Path) -> None:
    check_out_dir(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} is a folder that is not empty; the import writes a new run "
                        "directory: choose another --out")


def import_olmo_core(checkpoint: str | os.PathLike, out: str | os.PathLike, *,
                     data: str | None = None) -> dict[str, Any]:
    """Write the checkpoint as the run ``out`` (``data``: what ``analyze`` reads by default), beside
    it under a temporary name renamed at the end: a failure leaves nothing."""
    out = Path(out)
    _check_out(out)
    ckpt = to_run.find_checkpoint(checkpoint)
    cfg = run_config(ckpt, data)
    check_memory(ckpt, cfg)
    target = Path(os.path.abspath(out))         # "." and "run/" have a name and a parent this way
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        layout = RunDir(tmp)
        write_text(layout.config, dump_config(cfg))
        cfg = load_config(str(layout.config))          # what analyze and export will read
        if data is not None:
            check_data(cfg, tmp)
        model = trained_model(ckpt, cfg)
        rows = to_run.metrics_rows(ckpt)
        write_text(layout.metrics, "".join(json.dumps(plain(r), allow_nan=False) + "\n" for r in rows))
        losses = [r["loss"] for r in rows if finite_number(r.get("loss"))]
        state = RunState(step=ckpt.step, last_loss=losses[-1] if losses else None,
                         best_loss=min(losses) if losses else math.inf,
                         seq_len=cfg.data.seq_len, checkpoint_step=ckpt.step,
                         micro_batches=cfg.train.grad_accum)
        info = to_run.summary(ckpt, cfg, model, rows)
        state.tokens_seen = info["tokens_seen"] or 0
        # no optimizer moments carry over: an optimizer of our recipe, with no state
        optimizer = build_optimizer(model, cfg.train.lr, cfg.train.weight_decay, cfg.train.betas)
        save_checkpoint(layout.last_checkpoint, model, optimizer,
                        {"run": state.to_dict(), "imported_from": info["imported_from"]})
        write_json(layout.summary, info)
        write_text(tmp / CONFIG_COPY, json.dumps(ckpt.config, indent=2) + "\n")
        try:
            os.replace(tmp, target)
        except OSError:
            if target.exists() and any(target.iterdir()):
                raise UserError(f"--out {out} was written by something else during the import; "
                                "choose another --out") from None
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"checkpoint": str(ckpt.folder), "step": ckpt.step, "scheme": cfg.model.scheme,
            "parameters": model.num_parameters(), "metrics": len(rows), "data": None if data is None
            else cfg.data.corpus}
