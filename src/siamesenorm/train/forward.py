"""Forward and backward of one micro-batch, through ``torch.compile`` when asked and when it works."""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import Tensor, nn


class ForwardBackward:
    """``model(x, y).loss`` and the backward of ``loss / scale`` for one micro-batch, compiled when
    ``compile=True``: if the first micro-batch fails to compile, one warning line says so and it and every
    later one run eagerly."""

    def __init__(self, model: nn.Module, compile: bool) -> None:
        self.model, self.fn, self.trial = model, model, False
        if compile:
            try:
                self.fn, self.trial = torch.compile(model), True
            except Exception as error:
                self._fall_back(error)

    def _fall_back(self, error: Exception) -> None:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        print(f"warning: torch.compile failed ({first[:160]}); training without it",
              file=sys.stderr, flush=True)
        self.fn, self.trial = self.model, False

    def __call__(self, x: Tensor, y: Tensor, scale: float,
                 autocast: Callable[[], AbstractContextManager]) -> Tensor:
        """Accumulate the gradient of ``loss / scale``; returns the detached (unscaled) loss."""
        if self.trial:
            try:
                return self._run(self.fn, x, y, scale, autocast)
            except Exception as error:
                self.model.zero_grad(set_to_none=True)  # the trial is the run's first micro-batch
                self._fall_back(error)
            finally:
                self.trial = False
        return self._run(self.fn, x, y, scale, autocast)

    @staticmethod
    def _run(fn, x: Tensor, y: Tensor, scale: float, autocast) -> Tensor:
        with autocast():
            loss = fn(x, y).loss
        (loss / scale).backward()
        return loss.detach()
