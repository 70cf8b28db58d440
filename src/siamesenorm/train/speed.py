"""The speed of a training run as it goes: each step's tokens/s, TFLOP/s and MFU, and the run's."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .throughput import Throughput, device_name, find_peak, model_flops_per_token


class RunSpeed(Throughput):
    def __init__(self, device: torch.device, precision: str, peak_tflops: float | None,
                 devices: int) -> None:
        super().__init__(find_peak(device, precision, peak_tflops), devices)
        self.device = device

    def step(self, model: nn.Module, seq_len: int | None, tokens: int, seconds: float) -> dict[str, float]:
        """A metrics row's ``tokens_per_s``, ``tflops`` and ``mfu`` for ``tokens`` in ``seconds``."""
        tokens_per_s = tokens / max(seconds, 1e-9)
        if self.flops_per_token is None:    # the sequence length is known from the first step on
            self.flops_per_token = model_flops_per_token(model, seq_len)
        return {"tokens_per_s": tokens_per_s, **self.figures(tokens_per_s)}

    def of_run(self, figures: dict[str, Any]) -> dict[str, Any]:
        """The run's summary ``figures`` (:func:`~.summary.build_summary`) with its speed's."""
        self.flops_per_token = figures["flops_per_token"]
        return {**figures, **self.summary(figures["tokens_per_s"])}

    def mfu_note(self) -> str | None:
        """Why a GPU run shows no MFU: its device is not in the table of peaks."""
        if self.peak is not None or self.device.type != "cuda":
            return None
        return (f"MFU unknown: no peak TFLOP/s known for {device_name(self.device)!r}; "
                "set train.peak_tflops")
