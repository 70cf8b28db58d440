"""Probes a run can leave on: every ``N`` steps, one record in ``run_dir/probes.jsonl`` (docs/analysis.md)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import UserError
from ..rundir import RunDir, open_jsonl, plain
from ..shapes import PROBE_ROW, read_rows
from .adapters import LossFn, lm_loss
from .probes import grad_norms, norm_gains, sublayer_rms


def to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(b, device) for b in batch)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


def read_probes(run_dir: str | Path) -> list[dict]:
    """The records of ``run_dir/probes.jsonl`` (:func:`~siamesenorm.shapes.read_rows`; ``[]`` when none)."""
    return read_rows(RunDir(run_dir).probes, PROBE_ROW)


class TrainingProbes:
    """A :class:`~siamesenorm.train.StepProbe` writing ``probes.jsonl`` every ``every`` steps."""

    def __init__(self, every: int, batch: Any, loss_fn: LossFn = lm_loss) -> None:
        if not isinstance(every, int) or every <= 0:
            raise UserError(f"analysis.every must be a positive number of steps, got {every!r}")
        self.every, self.batch, self.loss_fn = every, batch, loss_fn
        self.pending: dict[str, Any] | None = None
        self.path: Path | None = None
        self._file = None

    def start(self, run_dir: Path, keep_until: int | None) -> None:
        self.path = RunDir(run_dir).probes
        self._file = open_jsonl(self.path, keep_until)

    def wants(self, step: int) -> bool:
        return step % self.every == 0

    def after_backward(self, model: nn.Module, step: int) -> None:
        self.pending = {"step": step, **grad_norms(model)}

    @torch.no_grad()
    def record(self, model: nn.Module) -> dict[str, Any]:
        """The forward-pass part of a record: stream RMS on the probe batch and the norm gains."""
        was_training = model.training
        model.eval()
        try:
            device = next(model.parameters()).device
            rms = sublayer_rms(model, to_device(self.batch, device), self.loss_fn)
        finally:
            model.train(was_training)
        return {"rms": rms, "gains": norm_gains(model)}

    def make_row(self, model: nn.Module, step: int, diverged: bool = False) -> dict[str, Any]:
        """The record of ``step``: the pending gradient norms of that step and :meth:`record`."""
        grads = self.pending if self.pending is not None and self.pending["step"] == step else {}
        self.pending = None
        row: dict[str, Any] = {"step": step, "grad_norm": grads.get("total"),
                               "grad_norm_blocks": grads.get("blocks"),
                               "grad_norm_scheme": grads.get("scheme"), **self.record(model)}
        if diverged:
            row["diverged"] = True
        return row

    def write(self, row: dict[str, Any]) -> None:
        if self._file is not None:
            self._file.write(json.dumps(plain(row), allow_nan=False) + "\n")
            self._file.flush()

    def after_update(self, model: nn.Module, step: int, diverged: bool) -> None:
        self.write(self.make_row(model, step, diverged))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
