"""The run's metric log: ``metrics.jsonl`` and the same scalars in the loggers of ``train.loggers``
(TensorBoard, W&B), tagged ``train/``, ``val/`` and ``throughput/``."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import yaml

from ..errors import UserError
from ..rundir import RunDir, inner_folder, open_jsonl, plain, write_text

THROUGHPUT_KEYS = ("tokens_per_s", "tflops", "mfu")
WANDB_ID_FILE = "wandb-run-id"      # in the run's wandb/ folder: a resumed run logs to the same run


def tag(key: str, evaluated: Iterable[str] = ()) -> str:
    """A row's ``key`` as the loggers show it: ``throughput/...``, ``val/...`` or ``train/...``."""
    if key in THROUGHPUT_KEYS:
        return f"throughput/{key}"
    if key in evaluated:
        return f"val/{key.removeprefix('val_')}"
    return f"train/{key}"


def check_loggers(loggers: Iterable[str]) -> None:
    """Refuse, before anything is written, a logger that cannot start (W&B missing or refusing its settings,
    TensorBoard failing to import); TensorBoard not installed is skipped quietly."""
    loggers = tuple(loggers)
    if "wandb" in loggers:
        if importlib.util.find_spec("wandb") is None:
            raise UserError("train.loggers names wandb, which is not installed: pip install "
                            "'siamesenorm[wandb]' (or drop it from train.loggers)")
        problem = _wandb_settings_problem()
        if problem is not None:
            raise UserError(f"train.loggers names wandb, which cannot start: {problem}; fix it, or "
                            "drop wandb from train.loggers")
    if "tensorboard" in loggers and importlib.util.find_spec("tensorboard") is not None:
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except Exception as error:
            raise UserError("train.loggers names tensorboard, which is installed but cannot be "
                            f"imported ({_first_line(error)}); repair it (pip install -U tensorboard), "
                            "or drop it from train.loggers (train.loggers=[])") from None


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _wandb_settings_problem() -> str | None:
    """What W&B says of its settings from the environment, in one line, without starting anything."""
    try:
        import wandb

        settings = wandb.Settings()
        update = getattr(settings, "update_from_env_vars", None)    # W&B's own reader, if it has one
        if update is not None:
            update(dict(os.environ))
    except Exception as error:
        details = getattr(error, "errors", None)     # pydantic's ValidationError: which setting
        try:
            first = details()[0] if callable(details) else None
        except Exception:
            first = None
        if not isinstance(first, dict):
            return _first_line(error)
        value = first.get("input")
        names = [k for k, v in os.environ.items() if k.startswith("WANDB_") and v == value]
        name = names[0] if names else ".".join(map(str, first.get("loc", ()))) or "a setting"
        secret = any(word in name.upper() for word in ("KEY", "TOKEN", "SECRET", "PASSWORD"))
        return f"{name}{'' if secret else f'={value!r}'}: {first.get('msg', _first_line(error))}"
    return None


def _tensorboard(log_dir: Path, purge_step: int | None):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except Exception:  # tensorboard is an optional extra
        return None
    return SummaryWriter(log_dir=str(inner_folder(log_dir)), purge_step=purge_step)


def _wandb(run_dir: Path, resume: bool):
    """A W&B run for ``run_dir`` (a resumed run continues its own); failing to start is one line."""
    import wandb

    folder = inner_folder(run_dir / "wandb")
    id_file = folder / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if resume and id_file.is_file() else None
    if run_id is None:
        run_id = uuid.uuid4().hex[:12]
        write_text(id_file, run_id + "\n")
    config_file = RunDir(run_dir).config
    config = yaml.safe_load(config_file.read_text(encoding="utf-8")) if config_file.is_file() else {}
    try:
        return wandb.init(project=os.environ.get("WANDB_PROJECT", "siamesenorm"), name=run_dir.name,
                          id=run_id, resume="allow", dir=str(run_dir), config=config)
    except Exception as error:
        raise UserError(f"train.loggers names wandb, which could not start ({_first_line(error)}); "
                        "fix it (wandb login, or WANDB_MODE=offline), or drop wandb from "
                        "train.loggers") from None


class MetricsLog:
    """Appends rows to ``run_dir/metrics.jsonl``, flushed row by row, and their numbers to ``loggers``.
    ``keep_until`` drops the rows after that step (``None``: an empty log); a file deleted or cut short
    under the live run is rewritten from the rows held in memory."""

    def __init__(self, run_dir: Path, keep_until: int | None = None,
                 loggers: Iterable[str] = ("tensorboard",)) -> None:
        layout = RunDir(run_dir)
        self.path = layout.metrics
        # the loggers' folders first: one refused (a link) leaves metrics.jsonl as it was
        self._tb = _tensorboard(layout.tensorboard, None if keep_until is None else keep_until + 1) \
            if "tensorboard" in loggers else None
        self._wandb = None
        try:
            if "wandb" in loggers:
                self._wandb = _wandb(Path(run_dir), keep_until is not None)
            self._file = open_jsonl(self.path, keep_until)
        except BaseException:       # the loggers started so far are closed, not left running
            if self._tb is not None:
                self._tb.close()
            if self._wandb is not None:
                self._wandb.finish()
            raise
        self._lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        self._size = sum(len(line.encode("utf-8")) for line in self._lines)

    def _check(self) -> None:
        try:
            on_disk = os.stat(self.path)
        except FileNotFoundError:
            what = "deleted"
        else:
            if not os.path.samestat(on_disk, os.fstat(self._file.fileno())):
                what = "replaced"
            elif on_disk.st_size < self._size:
                what = "cut short"
            else:
                return
        print(f"warning: {self.path} was {what} while the run was writing it; rewriting it from "
              f"the {len(self._lines)} rows this run holds", file=sys.stderr, flush=True)
        self._file.close()
        write_text(self.path, "".join(self._lines))
        self._file = open(self.path, "a", encoding="utf-8")

    def write(self, row: dict[str, Any], evaluated: Iterable[str] = ()) -> None:
        """Append ``row``; ``evaluated``: its keys that the evaluation returned (``val/`` tags)."""
        row = plain(row)
        line = json.dumps(row, allow_nan=False) + "\n"
        self._check()
        try:
            self._file.write(line)
            self._file.flush()
        except OSError as error:    # a full disk: the OS's words, naming the file
            self._failed = True
            if error.filename is not None or error.errno is None:
                raise
            raise OSError(error.errno, error.strerror, str(self.path)) from None
        self._lines.append(line)
        self._size += len(line.encode("utf-8"))
        if self._tb is None and self._wandb is None:
            return
        scalars = {tag(key, evaluated): value for key, value in row.items()
                   if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}
        if self._tb is not None:
            for name, value in scalars.items():
                self._tb.add_scalar(name, value, row["step"])
        if self._wandb is not None and scalars:
            self._wandb.log(scalars, step=row["step"])

    def close(self) -> None:
        try:
            self._file.close()
        except OSError:     # the rows a full disk refused: already raised once by write
            if not getattr(self, "_failed", False):
                raise
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
