"""Checkpoints: a directory written beside its target and renamed into place.

Layout of a checkpoint directory (e.g. ``run_dir/checkpoints/last/``)::

    model.safetensors   the model's state_dict; a tensor that shares storage with another entry
                        (tied weights) is stored once, under the first name that holds it
    state.pt            {"format": 1, "optimizer": optimizer.state_dict(), "extra": {...}};
                        plain containers, numbers, strings and tensors only, so that it loads
                        with ``torch.load(weights_only=True)``

    checksums.json      the SHA-256 and size of every other file of the checkpoint, written last;
                        loading verifies them first and refuses a damaged checkpoint (flipped or
                        missing bytes) with one line instead of training a corrupted model
                        (a checkpoint without the file, from an older version, is not verified)

Atomicity: both files are written and fsynced in a fresh temporary directory
``.<name>.tmp-*`` next to the target. The swap then renames the old checkpoint to
``.<name>.old-*``, renames the new one to ``<name>`` and deletes the old one. A crash at any point
leaves either ``<name>`` complete (old or new) or, in the instant between the two renames, no
``<name>`` but a complete ``.<name>.old-*``, which :func:`load_checkpoint`, :func:`has_checkpoint`
and the next :func:`save_checkpoint` move back into place. Hidden ``.tmp-`` directories are never
read; the next save deletes them. One writer per checkpoint directory at a time.

A run across several processes writes the sharded layout instead (:mod:`.sharded`): ``dcp/``, a
``torch.distributed.checkpoint`` directory of the model and optimizer state, and ``state.pt``
(format 2, without the optimizer). Both layouts use the same swap; :func:`load_checkpoint` reads
either into a single-process model, and :func:`~.sharded.load_sharded` either into a spread one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import uuid
import warnings
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from ..errors import ConfigError

MODEL_FILE = "model.safetensors"
STATE_FILE = "state.pt"
DCP_DIR = "dcp"
CHECKSUM_FILE = "checksums.json"
FORMAT = 1              # model.safetensors + state.pt with the optimizer
SHARDED_FORMAT = 2      # dcp/ (model and optimizer) + state.pt without it
_PLAIN = (str, int, float, bool, type(None), Tensor)


# ---- tied weights ------------------------------------------------------------------------------
def _split_aliases(state: dict[str, Tensor]) -> tuple[dict[str, Tensor], dict[str, str]]:
    """``(unique, aliases)``: entries with their own storage, and ``alias -> name it shares with``."""
    unique: dict[str, Tensor] = {}
    aliases: dict[str, str] = {}
    seen: dict[tuple, str] = {}
    for name, t in state.items():
        ptr = t.untyped_storage().data_ptr() if t.device.type != "meta" else 0
        key = (t.device, ptr, t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if ptr and t.numel() and key in seen:
            aliases[name] = seen[key]
            continue
        seen[key] = name
        unique[name] = t
    return unique, aliases


def unique_tensors(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """``state`` without the entries that share storage with an earlier one (tied weights)."""
    return _split_aliases(state)[0]


# ---- writing -------------------------------------------------------------------------------------
def _check_plain(obj, where: str) -> None:
    if isinstance(obj, dict):
        for key, value in obj.items():
            _check_plain(key, where)
            _check_plain(value, f"{where}[{key!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            _check_plain(value, f"{where}[{i}]")
    elif not isinstance(obj, _PLAIN):
        raise TypeError(f"checkpoint {where} is a {type(obj).__name__}; only dicts, lists, tuples, "
                        "numbers, strings, None and tensors load with weights_only=True")


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file, or a directory's entries) to disk; a no-op where the OS refuses."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _write_model(path: Path, model: nn.Module) -> None:
    unique, _ = _split_aliases(model.state_dict())
    save_file({k: v.detach().cpu().contiguous() for k, v in unique.items()}, str(path),
              metadata={"format": "pt"})
    _fsync(path)


def _write_state(path: Path, optimizer: torch.optim.Optimizer, extra: dict) -> None:
    torch.save({"format": FORMAT, "optimizer": optimizer.state_dict(), "extra": extra}, path)
    _fsync(path)


def _hidden(path: Path, kind: str) -> list[Path]:
    return sorted(path.parent.glob(f".{path.name}.{kind}-*"))


def _recover(path: Path, clean: bool) -> None:
    """Put a checkpoint whose swap was cut short back at ``path``; with ``clean``, delete leftovers."""
    olds = _hidden(path, "old")
    if not path.exists() and olds:
        os.replace(olds.pop(), path)
        _fsync(path.parent)
    if clean:
        for leftover in olds + _hidden(path, "tmp"):
            shutil.rmtree(leftover, ignore_errors=True)


def save_checkpoint(path: str | os.PathLike, model: nn.Module, optimizer: torch.optim.Optimizer,
                    extra: dict, keep_as: Path | None = None) -> None:
    """Write ``model``, ``optimizer`` and ``extra`` into the checkpoint directory ``path``.

    ``extra`` (step, RNG and sampler states, ...) must hold only dicts, lists, tuples, numbers,
    strings, None and tensors; anything else is a TypeError before a byte is written. An existing
    checkpoint at ``path`` is replaced atomically (see the module docstring), and moved to
    ``keep_as`` when that is given.
    """
    path = Path(path)
    _check_plain(extra, "extra")
    tmp = new_temporary(path)
    try:
        _write_model(tmp / MODEL_FILE, model)
        _write_state(tmp / STATE_FILE, optimizer, extra)
        _fsync(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    install(tmp, path, keep_as)


def new_temporary(path: Path) -> Path:
    """A fresh hidden directory beside ``path`` to write its next version into (after moving back
    a version that a cut-short swap left hidden, and deleting older leftovers)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    _recover(path, clean=True)
    return Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))


def _digest(file: Path) -> str:
    with open(file, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def write_checksums(folder: Path) -> None:
    """Record the SHA-256 and size of every file under ``folder`` in its ``checksums.json``."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != CHECKSUM_FILE)
    sums = {p.relative_to(folder).as_posix(): {"sha256": _digest(p), "bytes": p.stat().st_size}
            for p in files}
    target = folder / CHECKSUM_FILE
    target.write_text(json.dumps(sums, indent=1) + "\n", encoding="utf-8")
    _fsync(target)


def verify_checksums(path: str | os.PathLike) -> None:
    """Refuse (:class:`ConfigError`, one line) a checkpoint whose files do not match the checksums
    written with it; a checkpoint without ``checksums.json`` (an older version's) passes."""
    path = Path(path)
    file = path / CHECKSUM_FILE
    if not file.exists():
        return
    damaged = f"checkpoint {path} is damaged"
    try:
        sums = json.loads(file.read_text(encoding="utf-8"))
        entries = [(rel, want["sha256"], want["bytes"]) for rel, want in sums.items()]
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        raise ConfigError(f"{damaged}: its {CHECKSUM_FILE} is unreadable") from None
    for rel, sha, size in entries:
        part = path / rel
        if not part.is_file():
            raise ConfigError(f"{damaged}: {rel} is missing")
        if part.stat().st_size != size or _digest(part) != sha:
            raise ConfigError(f"{damaged}: {rel} does not match the checksum written with it "
                              "(changed, flipped or cut-short bytes); restore it from a copy")


def install(tmp: Path, path: Path, keep_as: Path | None = None) -> None:
    """Swap the complete directory ``tmp`` in at ``path``, after recording its checksums (see the
    module docstring). With ``keep_as``, the checkpoint it replaces is kept there (renamed) rather
    than deleted."""
    write_checksums(tmp)
    _fsync(tmp)
    old = None
    if path.exists():
        if keep_as is not None and not keep_as.exists():
            os.replace(path, keep_as)
        else:
            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:12]}"
            os.replace(path, old)
    os.replace(tmp, path)
    _fsync(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ---- older checkpoints beside the last -----------------------------------------------------------
def kept_name(path: Path, step: int) -> Path:
    """Where the checkpoint of ``step`` goes when a newer one replaces it at ``path``."""
    return path.parent / f"step_{step}"


def older_checkpoints(path: str | os.PathLike) -> list[Path]:
    """The kept checkpoints beside ``path`` (``step_<N>`` folders), newest first."""
    path = Path(path)
    found = [p for p in path.parent.glob("step_*") if p.is_dir() and p.name[5:].isdigit()]
    return sorted(found, key=lambda p: int(p.name[5:]), reverse=True)


def prune_checkpoints(path: str | os.PathLike, keep: int) -> None:
    """Delete the kept checkpoints beside ``path`` beyond the newest ``keep - 1`` (``path`` itself
    is the last of ``keep``)."""
    for stale in older_checkpoints(path)[max(keep - 1, 0):]:
        shutil.rmtree(stale, ignore_errors=True)


# ---- reading -------------------------------------------------------------------------------------
def has_checkpoint(path: str | os.PathLike) -> bool:
    """Whether ``path`` holds a checkpoint (after finishing a swap that a crash cut short)."""
    return layout(path) is not None


def layout(path: str | os.PathLike) -> str | None:
    """``"single"`` (model.safetensors), ``"sharded"`` (dcp/) or None: which checkpoint ``path``
    holds, after finishing a swap that a crash cut short."""
    path = Path(path)
    _recover(path, clean=False)
    if not (path / STATE_FILE).is_file():
        return None
    if (path / MODEL_FILE).is_file():
        return "single"
    if (path / DCP_DIR / ".metadata").is_file():
        return "sharded"
    return None


def problem(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    line = text[0] if text else type(error).__name__
    return line if len(line) <= 200 else line[:197] + "..."


def read_model(file: Path, model: nn.Module) -> dict[str, Tensor]:
    """The full state_dict for ``model`` from ``file``, checked against the model's own."""
    try:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except Exception as error:
        raise ConfigError(f"cannot read checkpoint {file}: {problem(error)}") from None
    unique, aliases = _split_aliases(model.state_dict())
    missing = sorted(set(unique) - set(tensors))
    unexpected = sorted(set(tensors) - set(unique))
    bad = [k for k in unique if k in tensors and tensors[k].shape != unique[k].shape]
    if missing or unexpected or bad:
        detail = (f"missing {missing[:3]}" if missing else f"unexpected {unexpected[:3]}"
                  if unexpected else f"{bad[0]} has shape {tuple(tensors[bad[0]].shape)}, "
                  f"the model has {tuple(unique[bad[0]].shape)}")
        raise ConfigError(f"checkpoint {file} does not fit this model ({detail}); "
                          "was it written by a model with another configuration?")
    tensors.update({alias: tensors[name] for alias, name in aliases.items()})
    return tensors


def read_state(file: Path, format: int = FORMAT) -> dict:
    """The training state file of a checkpoint of ``format`` (1 holds the optimizer, 2 does not)."""
    try:
        state = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as error:
        raise ConfigError(f"cannot read checkpoint {file}: {problem(error)}") from None
    if not isinstance(state, dict) or state.get("format") != format \
            or not isinstance(state.get("extra"), dict) or (format == FORMAT and "optimizer" not in state):
        raise ConfigError(f"cannot read checkpoint {file}: not a siamesenorm training state "
                          f"(format {format})")
    return state


def checkpoint_extra(path: str | os.PathLike) -> dict:
    """The ``extra`` (step, counters, states) of the checkpoint at ``path``, of either layout."""
    path = Path(path)
    kind = layout(path)
    if kind is None:
        raise ConfigError(f"no checkpoint at {path}")
    verify_checksums(path)
    return read_state(path / STATE_FILE, FORMAT if kind == "single" else SHARDED_FORMAT)["extra"]


def load_checkpoint(path: str | os.PathLike, model: nn.Module,
                    optimizer: torch.optim.Optimizer | None) -> dict:
    """Load the checkpoint directory ``path`` into ``model`` (and ``optimizer``); return ``extra``.

    Both files are read and checked before anything is changed: a missing, unreadable or corrupt
    checkpoint, or one written by a model of another shape, raises :class:`ConfigError` with the
    path and the problem on one line, leaving ``model`` and ``optimizer`` as they were.
    """
    path = Path(path)
    kind = layout(path)
    if kind is None:
        raise ConfigError(f"no checkpoint at {path} (expected {MODEL_FILE} and {STATE_FILE} there, "
                          f"or {DCP_DIR}/ and {STATE_FILE})")
    verify_checksums(path)
    if kind == "sharded":
        extra = read_state(path / STATE_FILE, SHARDED_FORMAT)["extra"]
        load_dcp_into(path, model, optimizer)
        return extra
    tensors = read_model(path / MODEL_FILE, model)
    state = read_state(path / STATE_FILE)
    if optimizer is not None:
        try:
            optimizer.load_state_dict(state["optimizer"])
        except Exception as error:
            raise ConfigError(f"checkpoint {path / STATE_FILE} does not fit this optimizer: "
                              f"{problem(error)}") from None
    model.load_state_dict(tensors, strict=True)
    return state["extra"]


def load_dcp_into(path: Path, module: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Read ``path/dcp`` into ``module`` (plain, DDP-wrapped or sharded by FSDP2) and ``optimizer``.

    ``torch.distributed.checkpoint`` reshards as it reads, so the world size of the reader need not
    be that of the writer; a single process without a process group reads it too.
    """
    if optimizer is None:
        state = {"model": get_model_state_dict(module)}
        _read_dcp(path, state)
        set_model_state_dict(module, state["model"])
        return
    model_sd, optim_sd = get_state_dict(module, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    _read_dcp(path, state)
    set_state_dict(module, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _read_dcp(path: Path, state: dict) -> None:
    try:
        with warnings.catch_warnings():     # a single process reading a sharded checkpoint is meant
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(state, checkpoint_id=str(path / DCP_DIR))
    except Exception as error:
        raise ConfigError(f"cannot read checkpoint {path / DCP_DIR}: {problem(error)}") from None
