"""``siamesenorm import-olmo-core CKPT --out RUN``: an OLMo-core checkpoint of one of our scheme
models (:mod:`siamesenorm.olmo_core.train`, or any run of a :class:`~.model.SchemeTransformer`) as
one of our run directories, so that ``export`` and ``analyze`` take it like a run of ``siamesenorm
train`` (it has no tokenizer, so ``generate`` refuses it).

``CKPT`` is a checkpoint folder ``stepN/`` or a save folder (its latest complete ``stepN/``). The
run gets ``config.yaml``, ``checkpoints/last/`` (the weights mapped by
``to_siamesenorm_state_dict``, no optimizer moments), ``metrics.jsonl``, ``summary.json`` and
``olmo-core-config.json`` (docs/olmo-core.md, "From an OLMo-core run to ours"). The weights,
``model.<name>`` entries of ``model_and_optim/``, are read with torch alone in one process, whatever
world size wrote them, by :func:`siamesenorm.train.checkpoint.read_dcp` (an allow-listed unpickler
of ``.metadata``); the configuration needs OLMo-core's classes. An imported run cannot be resumed.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..config import TrainConfig, dump_config
from ..errors import UserError
from ..models.lm import LanguageModel
from ..rundir import RunDir, check_out_dir, read_json, read_jsonl, write_json, write_text
from ..tasks.lm import UNSET_CORPUS, DataConfig, LMRunConfig
from ..tasks.registry import get_task, load_config
from ..train.checkpoint import read_dcp, read_dcp_metadata, save_checkpoint
from ..train.optim import build_optimizer
from ..train.state import RunState

__all__ = ["CONFIG_COPY", "OLMoCoreCheckpoint", "find_checkpoint", "import_olmo_core", "read_model_tensors",
           "run_config"]

CONFIG_COPY = "olmo-core-config.json"
_STEP = re.compile(r"step(\d+)")
_MODEL_CLASS = "siamesenorm.olmo_core.model.SchemeTransformerConfig"
_CLASS_FIELD = "_CLASS_"
_CONFIG_PACKAGES = ("olmo_core.nn.", "siamesenorm.olmo_core.")
# The most of config.json that is read: OLMo-core's is a few KiB, or a few MiB when its dataset
# lists thousands of token files.
MAX_CONFIG_BYTES = 64 << 20
# OLMo-core's metric names -> ours (metrics.jsonl)
_METRICS = {"train/CE loss": "loss", "optim/LR (group 0)": "lr", "optim/total grad norm": "grad_norm"}


@dataclass(frozen=True)
class OLMoCoreCheckpoint:
    """One OLMo-core checkpoint folder ``folder`` (``stepN/``) of the save folder ``save_folder``."""

    folder: Path
    step: int
    config: dict

    @property
    def save_folder(self) -> Path:
        return self.folder.parent

    @property
    def model_and_optim(self) -> Path:
        return self.folder / "model_and_optim"


def _is_checkpoint(folder: Path) -> bool:
    return (folder / "model_and_optim" / ".metadata").is_file()


def find_checkpoint(path: str | os.PathLike) -> OLMoCoreCheckpoint:
    """The checkpoint ``path`` names: a ``stepN/`` folder, or the latest complete one of a save
    folder. Not a folder, no checkpoint, no ``config.json``: a :class:`UserError`."""
    path = Path(path)
    if not path.exists():
        raise UserError(f"OLMo-core checkpoint {path} does not exist")
    if not path.is_dir():
        raise UserError(f"OLMo-core checkpoint {path} is a file; give a stepN/ folder or the run's "
                          "save folder")
    if not _is_checkpoint(path):
        steps = [(int(m[1]), p) for p in path.iterdir()
                 if p.is_dir() and (m := _STEP.fullmatch(p.name)) and _is_checkpoint(p)]
        if not steps:
            raise UserError(f"{path} is not an OLMo-core checkpoint: it has neither model_and_optim/ "
                              "nor stepN/ folders that hold one")
        path = max(steps)[1]
    m = _STEP.fullmatch(path.name)
    if m is None:
        raise UserError(f"cannot tell the step of the checkpoint {path}: OLMo-core names its "
                          "checkpoint folders stepN; give it that name")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise UserError(f"{path} has no config.json, so its model cannot be rebuilt (OLMo-core's "
                          "ConfigSaverCallback writes it)")
    config = read_json(config_file, max_bytes=MAX_CONFIG_BYTES)
    if not isinstance(config, dict) or not isinstance(config.get("model"), dict):
        raise UserError(f"{config_file} has no model configuration (a 'model' object)")
    return OLMoCoreCheckpoint(path, int(m[1]), config)


# ---- the configuration -----------------------------------------------------------------------
def _is_config_class(name: Any) -> bool:
    """Whether ``name`` is a config dataclass of OLMo-core's modules (``olmo_core.nn``) or of ours:
    the only classes a model's config.json may name, since OLMo-core's ``from_dict`` calls whatever
    ``_CLASS_`` names, with the arguments beside it."""
    from olmo_core.config import Config

    if not isinstance(name, str) or not name.startswith(_CONFIG_PACKAGES):
        return False
    module, _, attr = name.rpartition(".")
    try:
        found = getattr(importlib.import_module(module), attr, None)
    except ImportError:
        return False
    return isinstance(found, type) and dataclasses.is_dataclass(found) and issubclass(found, Config)


def _unlisted_classes(node: Any) -> list[Any]:
    """Every ``_CLASS_`` in ``node`` that is not a config class (:func:`_is_config_class`)."""
    if isinstance(node, dict):
        found = [node[_CLASS_FIELD]] if _CLASS_FIELD in node and not _is_config_class(node[_CLASS_FIELD]) \
            else []
        return found + [c for k, v in node.items() if k != _CLASS_FIELD for c in _unlisted_classes(v)]
    if isinstance(node, list):
        return [c for v in node for c in _unlisted_classes(v)]
    return []


def model_config(ckpt: OLMoCoreCheckpoint):
    """The :class:`~.model.SchemeTransformerConfig` of config.json's model."""
    from .model import SchemeTransformerConfig

    model = ckpt.config["model"]
    kind = model.get(_CLASS_FIELD)
    if kind != _MODEL_CLASS:
        raise UserError(f"the checkpoint's model is a {kind or 'model of unknown class'}, not a residual "
                          f"scheme model of siamesenorm.olmo_core ({_MODEL_CLASS}); only those map to "
                          "our LanguageModel")
    unlisted = _unlisted_classes(model)
    if unlisted:
        raise UserError(f"the checkpoint's config.json names {unlisted[0]!r} as a class, which is not a "
                        "model config class of OLMo-core (olmo_core.nn) or of siamesenorm.olmo_core; "
                        "refusing to read it (it would be called)")
    try:
        config = SchemeTransformerConfig.from_dict(json.loads(json.dumps(model)))
    except Exception as error:
        why = " ".join(str(error).split())          # OLMo-core's message spans lines
        raise UserError(f"cannot read the model of {ckpt.folder / 'config.json'}: {why}") from None
    if not isinstance(config, SchemeTransformerConfig):
        raise UserError(f"the model of {ckpt.folder / 'config.json'} does not read as {_MODEL_CLASS}")
    try:        # before anything resolves its blocks or builds: the bounds of our own configs
        config.check_sizes("model")
    except UserError as error:
        raise UserError(f"{ckpt.folder / 'config.json'}: {error}") from None
    return config


def _number(node: Any, *keys: str) -> Any:
    for key in keys:
        if not isinstance(node, dict):
            return None
        node = node.get(key)
    return node


def _sequence_length(ckpt: OLMoCoreCheckpoint) -> int:
    seq_len = _number(ckpt.config, "train_module", "max_sequence_length") or \
        _number(ckpt.config, "dataset", "sequence_length")
    if not isinstance(seq_len, int) or seq_len <= 0:
        raise UserError(f"{ckpt.folder / 'config.json'} records no sequence length "
                          "(train_module.max_sequence_length or dataset.sequence_length)")
    return seq_len


def _train_config(ckpt: OLMoCoreCheckpoint, seq_len: int) -> tuple[TrainConfig, int]:
    """Our ``train`` section for what the OLMo-core run did (AdamW, a cosine schedule with warm-up
    in steps, clipping, the global batch as accumulation of micro-batches in one process), and the
    micro-batch in sequences. What does not map keeps our default."""
    module = ckpt.config.get("train_module") or {}
    settings: dict[str, Any] = {"steps": max(ckpt.step, 1)}
    optim = module.get("optim") or {}
    if str(optim.get(_CLASS_FIELD, "")).endswith(".AdamWConfig"):
        settings |= {k: optim[k] for k in ("lr", "weight_decay") if _finite(optim.get(k))}
        betas = optim.get("betas")
        if isinstance(betas, list) and len(betas) == 2 and all(map(_finite, betas)):
            settings["betas"] = tuple(betas)
    scheduler = module.get("scheduler") or {}
    if str(scheduler.get(_CLASS_FIELD, "")).endswith(".CosWithWarmup") and scheduler.get("units") == "steps":
        if isinstance(scheduler.get("warmup"), int):
            settings["warmup"] = scheduler["warmup"]
        if _finite(scheduler.get("alpha_f")):
            settings["min_lr_ratio"] = scheduler["alpha_f"]
    if "max_grad_norm" in module and (module["max_grad_norm"] is None or _finite(module["max_grad_norm"])):
        settings["grad_clip"] = module["max_grad_norm"] or 0.0      # None: no clipping
    micro_tokens = module.get("rank_microbatch_size")
    microbatch = micro_tokens // seq_len if isinstance(micro_tokens, int) and micro_tokens >= seq_len else 1
    global_tokens = _number(ckpt.config, "data_loader", "global_batch_size")
    if isinstance(global_tokens, int) and global_tokens % (microbatch * seq_len) == 0:
        settings["grad_accum"] = max(global_tokens // (microbatch * seq_len), 1)
    try:
        return TrainConfig(**settings), microbatch
    except (UserError, TypeError, ValueError) as error:
        raise UserError(f"the OLMo-core run's training settings do not map: {error}") from None


def run_config(ckpt: OLMoCoreCheckpoint, data: str | None = None) -> LMRunConfig:
    """Our configuration of the run ``ckpt`` belongs to (docs/olmo-core.md); ``data``: the
    data ``analyze`` reads by default (a path, made absolute)."""
    from .convert import lm_config

    config = model_config(ckpt)
    seq_len = _sequence_length(ckpt)
    options: dict[str, Any] = {}
    if config.init_method is not None and str(getattr(config.init_method, "value", config.init_method)) \
            == "normal" and config.init_std is not None:
        options["init_std"] = config.init_std
    try:
        model = lm_config(config, max_seq_len=seq_len, **options)
    except NotImplementedError as error:
        raise UserError(f"the checkpoint's model has no LanguageModel counterpart: {error}") from None
    except UserError as error:
        raise UserError(f"{ckpt.folder / 'config.json'}: {error}") from None
    except (TypeError, ValueError, ArithmeticError, AttributeError) as error:
        # from_dict checks no types: a string where a number belongs fails in the mapping
        raise UserError(f"cannot read the model of {ckpt.folder / 'config.json'}: "
                        f"{type(error).__name__}: {error}") from None
    train, microbatch = _train_config(ckpt, seq_len)
    seed = config.init_seed if isinstance(config.init_seed, int) and config.init_seed >= 0 else 0
    corpus = UNSET_CORPUS if data is None else _absolute(data)
    return LMRunConfig(model=model, data=DataConfig(corpus=corpus, batch_size=microbatch, seq_len=seq_len),
                       train=train, seed=seed)


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
    get_task("lm").analysis_batches(cfg, run_dir, None, 1)


# ---- the weights, metrics and summary ---------------------------------------------------------
MODEL_PREFIX = "model."


def _model_entries(folder: Path) -> dict[str, TensorStorageMetadata]:
    """The model's tensor entries of the checkpoint ``folder``'s metadata, by parameter name."""
    entries = {key[len(MODEL_PREFIX):]: entry for key, entry in
               read_dcp_metadata(folder).state_dict_metadata.items() if key.startswith(MODEL_PREFIX)}
    odd = next((name for name, e in entries.items() if not isinstance(e, TensorStorageMetadata)), None)
    if odd is not None:
        raise UserError(f"{folder}: the model entry {odd} is not a tensor; not an OLMo-core model "
                          "checkpoint")
    if not entries:
        raise UserError(f"{folder} holds no model tensors ({MODEL_PREFIX}* entries): it is not an "
                          "OLMo-core model_and_optim checkpoint")
    return entries


def _entry_bytes(entries: dict[str, TensorStorageMetadata]) -> int:
    """The bytes of the full tensors ``entries`` describe (sizes read from the file: any size)."""
    return sum(math.prod(e.size) * e.properties.dtype.itemsize for e in entries.values())


def _refuse_beyond_memory(need: int, detail: str) -> None:
    """The memory bound of ``train`` (:func:`siamesenorm.tasks.dryrun.refuse_beyond_memory`) on
    what the import holds at once, ``need`` bytes, before any of it is allocated."""
    from ..devices import machine_memory
    from ..tasks.dryrun import refuse_beyond_memory

    cpu = torch.device("cpu")
    available = machine_memory(cpu)
    if available is not None:
        refuse_beyond_memory(need, available, cpu, detail, fix="import it on a machine with more memory, "
                             "or check the sizes in the checkpoint's config.json and .metadata")


def read_model_tensors(folder: str | os.PathLike) -> dict[str, Tensor]:
    """The full tensors of the model saved in ``folder`` (OLMo-core's ``model_and_optim/``), by the
    model's own parameter names, on the CPU in their saved dtype; the optimizer is not read.
    Tensors whose sizes (in ``.metadata``) could not fit this machine's memory are refused before
    any is allocated."""
    folder = Path(folder)
    entries = _model_entries(folder)
    size = _entry_bytes(entries)
    _refuse_beyond_memory(size, f"the {len(entries)} model tensors that {folder / '.metadata'} describes")
    state = {MODEL_PREFIX + name: torch.empty(tuple(e.size), dtype=e.properties.dtype)
             for name, e in entries.items()}
    read_dcp(folder, state)
    return {key[len(MODEL_PREFIX):]: tensor for key, tensor in state.items()}


def check_memory(ckpt: OLMoCoreCheckpoint, cfg: LMRunConfig) -> None:
    """Refuse, before anything is read or built, an import whose model (float32, with its rotary
    tables) and the checkpoint's tensors could not fit this machine's memory by far: the sizes
    come from config.json and ``.metadata``, which may say anything."""
    from ..tasks.dryrun import memory_floor

    floor = memory_floor(cfg)
    saved = _entry_bytes(_model_entries(ckpt.model_and_optim))
    need = 4 * floor["parameters"] + floor["buffers"] + saved
    _refuse_beyond_memory(need, f"{floor['parameters']:.3g} parameters as float32, "
                                f"{floor['buffers'] / 2**30:,.1f} GiB of rotary tables and the checkpoint's "
                                f"{saved / 2**30:,.1f} GiB of model tensors")


def trained_model(ckpt: OLMoCoreCheckpoint, cfg: LMRunConfig, tie_embeddings: bool) -> LanguageModel:
    """Our ``LanguageModel`` of ``cfg`` with the checkpoint's weights."""
    from .convert import to_siamesenorm_state_dict

    tensors = read_model_tensors(ckpt.model_and_optim)
    try:
        state = to_siamesenorm_state_dict(tensors, tie_embeddings=tie_embeddings)
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


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def metrics_rows(ckpt: OLMoCoreCheckpoint) -> list[dict[str, Any]]:
    """The rows of the save folder's metrics.jsonl for steps 1 to the checkpoint's, one per step,
    with our names added (``loss``, ``lr``, ``grad_norm``) beside OLMo-core's. OLMo-core logs a
    step's metrics in several rows, and a resumed run logs the steps after its checkpoint again:
    the rows of a step are merged in file order, the last value of a metric standing."""
    by_step: dict[int, dict[str, Any]] = {}
    for row in read_jsonl(ckpt.save_folder / "metrics.jsonl"):
        step = row.get("step")
        if isinstance(step, int) and not isinstance(step, bool) and 1 <= step <= ckpt.step:
            by_step.setdefault(step, {}).update(row)
    rows = []
    for step in sorted(by_step):
        row = by_step[step]
        ours = {mine: row[theirs] for theirs, mine in _METRICS.items() if theirs in row}
        rows.append({"step": step, **ours, **{k: v for k, v in row.items() if k != "step"}})
    return rows


def summary(ckpt: OLMoCoreCheckpoint, cfg: LMRunConfig, model: LanguageModel,
            rows: list[dict[str, Any]]) -> dict[str, Any]:
    losses = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    bad = next((s for s, loss in losses if not _finite(loss)), None)
    finite = [loss for _, loss in losses if _finite(loss)]
    # fixed-length batches; null (RUN_SUMMARY allows it) where the config saved no data loader
    batch_tokens = _number(ckpt.config, "data_loader", "global_batch_size")
    tokens = ckpt.step * batch_tokens if isinstance(batch_tokens, int) else None
    paths = [str(p) for p in _number(ckpt.config, "dataset", "paths") or []]
    files = ", ".join(paths[:3]) + (f" and {len(paths) - 3} more" if len(paths) > 3 else "")
    metadata = ckpt.folder / ".metadata.json"
    version = _number(read_json(metadata), "version") if metadata.is_file() else None
    return {
        "steps": ckpt.step, "diverged": bad is not None, "diverged_at": bad, "stalled": False,
        "stalled_at": None, "failed": bad is not None, "interrupted": False, "checkpoint_step": ckpt.step,
        "final_loss": losses[-1][1] if losses else None, "best_loss": min(finite) if finite else None,
        "final_val_loss": None, "final_val_ppl": None, "best_val_loss": None, "best_val_ppl": None,
        "best_val_step": None, "tokens_seen": tokens,
        "num_parameters": model.num_parameters(), "flops_per_token": model.flops_per_token(cfg.data.seq_len),
        "data": {"name": f"OLMo-core token files: {files or 'not recorded'}"},
        "imported_from": {"olmo_core_checkpoint": str(ckpt.folder.resolve()), "step": ckpt.step,
                          "olmo_core_version": version},
    }


# ---- the command -----------------------------------------------------------------------------
def _check_out(out: Path) -> None:
    check_out_dir(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} is a folder that is not empty; the import writes a new run "
                          "directory: choose another --out")


def import_olmo_core(checkpoint: str | os.PathLike, out: str | os.PathLike, *,
                     data: str | None = None) -> dict[str, Any]:
    """Write the OLMo-core checkpoint ``checkpoint`` as our run directory ``out`` (see the module
    docstring); ``data``: token files that ``analyze`` reads by default. Returns ``{"checkpoint",
    "step", "scheme", "parameters", "metrics", "data"}`` (``metrics``: rows written; ``data``: the
    absolute ``data``, or ``None``).

    Everything is checked before ``out`` appears: the folder is written beside it under a temporary
    name and renamed at the end, so a failure leaves nothing. Errors a user can cause raise
    :class:`UserError`."""
    out = Path(out)
    _check_out(out)
    ckpt = find_checkpoint(checkpoint)
    cfg = run_config(ckpt, data)
    check_memory(ckpt, cfg)
    tied = cfg.model.tie_embeddings
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
        model = trained_model(ckpt, cfg, tied)
        rows = metrics_rows(ckpt)
        write_text(layout.metrics, "".join(json.dumps(r, allow_nan=False) + "\n" for r in _strict(rows)))
        losses = [r["loss"] for r in rows if _finite(r.get("loss"))]
        state = RunState(step=ckpt.step, last_loss=losses[-1] if losses else None,
                         best_loss=min(losses) if losses else math.inf,
                         seq_len=cfg.data.seq_len, checkpoint_step=ckpt.step,
                         micro_batches=cfg.train.grad_accum)
        info = summary(ckpt, cfg, model, rows)
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


def _strict(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` as strict JSON (a non-finite loss becomes null, as our runs write it)."""
    from ..rundir import plain

    return [plain(r) for r in rows]
