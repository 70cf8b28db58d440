"""An OLMo-core checkpoint of one of our scheme models read as our pieces: its settings as our
configurations, its metrics and summary (``import-olmo-core``, :mod:`siamesenorm.commands.olmo_import`,
writes them as a run). config.json is data: it may name only model config classes (OLMo-core's
``from_dict`` calls what ``_CLASS_`` names); the sizes it and ``.metadata`` give are unchecked.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ..config import TrainConfig
from ..errors import UserError
from ..models.lm_config import LMConfig
from ..rundir import read_json, read_jsonl
from ..train.checkpoint import read_dcp_metadata

__all__ = ["MODEL_PREFIX", "OLMoCoreCheckpoint", "RunSettings", "entry_bytes", "find_checkpoint",
           "finite_number", "metrics_rows", "model_config", "model_entries", "run_settings", "summary"]

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
        settings |= {k: optim[k] for k in ("lr", "weight_decay") if finite_number(optim.get(k))}
        betas = optim.get("betas")
        if isinstance(betas, list) and len(betas) == 2 and all(map(finite_number, betas)):
            settings["betas"] = tuple(betas)
    scheduler = module.get("scheduler") or {}
    if str(scheduler.get(_CLASS_FIELD, "")).endswith(".CosWithWarmup") and scheduler.get("units") == "steps":
        if isinstance(scheduler.get("warmup"), int):
            settings["warmup"] = scheduler["warmup"]
        if finite_number(scheduler.get("alpha_f")):
            settings["min_lr_ratio"] = scheduler["alpha_f"]
    clip = module.get("max_grad_norm", 0.0)
    if "max_grad_norm" in module and (clip is None or finite_number(clip)):
        settings["grad_clip"] = clip or 0.0      # None: no clipping
    micro_tokens = module.get("rank_microbatch_size")
    microbatch = micro_tokens // seq_len if isinstance(micro_tokens, int) and micro_tokens >= seq_len else 1
    global_tokens = _number(ckpt.config, "data_loader", "global_batch_size")
    if isinstance(global_tokens, int) and global_tokens % (microbatch * seq_len) == 0:
        settings["grad_accum"] = max(global_tokens // (microbatch * seq_len), 1)
    try:
        return TrainConfig(**settings), microbatch
    except (UserError, TypeError, ValueError) as error:
        raise UserError(f"the OLMo-core run's training settings do not map: {error}") from None


@dataclass(frozen=True)
class RunSettings:
    """What the checkpoint says of its run, in our terms: the model, the training section, the
    micro-batch and sequence length, the seed."""

    model: LMConfig
    train: TrainConfig
    microbatch: int
    seq_len: int
    seed: int


def run_settings(ckpt: OLMoCoreCheckpoint) -> RunSettings:
    """Our configurations of the run ``ckpt`` belongs to (docs/olmo-core.md)."""
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
    return RunSettings(model, train, microbatch, seq_len, seed)


# ---- the weights' entries, metrics and summary -------------------------------------------------
MODEL_PREFIX = "model."


def model_entries(folder: Path) -> dict[str, TensorStorageMetadata]:
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


def entry_bytes(entries: dict[str, TensorStorageMetadata]) -> int:
    """The bytes of the full tensors ``entries`` describe (sizes read from the file: any size)."""
    return sum(math.prod(e.size) * e.properties.dtype.itemsize for e in entries.values())


def finite_number(value: Any) -> bool:
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


def summary(ckpt: OLMoCoreCheckpoint, cfg: Any, model: Any,
            rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Our summary.json of the imported run (``model``: our LanguageModel of ``cfg``)."""
    losses = [(r["step"], r["loss"]) for r in rows if "loss" in r]
    bad = next((s for s, loss in losses if not finite_number(loss)), None)
    finite = [loss for _, loss in losses if finite_number(loss)]
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
