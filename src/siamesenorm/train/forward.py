"""Forward and backward of one micro-batch, through ``torch.compile`` when asked and when it works."""

from __future__ import annotations

import sys
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch
from torch import Tensor, nn


class ForwardBackward:
    """``model(x, y).loss`` and the backward pass of ``loss / scale``, for one micro-batch.

    With ``compile=True`` the model runs through ``torch.compile``. Compilation happens lazily, so
    the first micro-batch is a trial: if it fails (no C compiler, an unsupported operation), one
    warning line goes to stderr, the partial gradients are dropped and that micro-batch and every
    later one run on the eager model. The compiled module shares its parameters with ``model``.
    """

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
