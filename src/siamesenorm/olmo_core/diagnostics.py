"""The paper's diagnostics in OLMo-core's ``Trainer``: :class:`DiagnosticsCallback` (docs/analysis.md,
"In your own trainer")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.nn.functional as F
from olmo_core.distributed.utils import get_rank
from olmo_core.io import is_url
from olmo_core.train.callbacks import Callback
from torch import Tensor, nn

from ..analysis.callbacks import Diagnostics, SchemeView, check_every
from ..errors import UserError
from .model import SchemeTransformer

__all__ = ["DiagnosticsCallback", "olmo_head", "olmo_loss", "scheme_view"]


def scheme_view(model: nn.Module) -> SchemeView:
    """A :class:`SchemeTransformer` (``from_transformer_config``, ``olmo_config``) as the
    diagnostics' scheme host: its scheme, and each block's attention and feed-forward."""
    if not isinstance(model, SchemeTransformer):
        raise UserError(f"the diagnostics need a residual-scheme model of siamesenorm.olmo_core "
                        f"(from_transformer_config); got {type(model).__name__}")
    sublayers = [m for block in model.blocks.values() for m in
                 (block.attention, getattr(block, "feed_forward_moe", None) or block.feed_forward)]
    return SchemeView(model, model.scheme, sublayers)


def olmo_loss(view: SchemeView, batch: dict[str, Tensor]) -> Tensor:
    """The mean cross-entropy of ``{"input_ids", "labels"}`` (OLMo-core's shifted labels)."""
    return view.module(batch["input_ids"], labels=batch["labels"], loss_reduction="mean").loss


def olmo_head(view: SchemeView, hidden: Tensor) -> Tensor:
    return view.module.lm_head(hidden)


def _labelled(input_ids: Tensor) -> dict[str, Tensor]:
    ids = input_ids.detach().clone()
    return {"input_ids": ids, "labels": F.pad(ids[:, 1:], (0, 1), value=-100)}


@dataclass
class DiagnosticsCallback(Callback):
    """Every ``every`` steps (0 or None: off) the probes of ``siamesenorm``'s training loop, gradients
    before clipping, on a fixed batch (default: the first ``batch_size`` sequences of step 1), through
    ``trainer.record_metric`` and into ``probes.jsonl`` of ``folder`` (default: the save folder, or
    the work dir when that is remote). After training (``at_end``) or on request (:meth:`analyze`):
    ``analysis.json`` and the plots of ``siamesenorm analyze``."""

    every: int | None = 100
    batch_size: int = 4
    at_end: bool = True
    folder: str | None = None
    input_ids: Any = field(default=None, repr=False)        # the probe batch's token ids, if given
    analysis_batches: Any = field(default=None, repr=False)  # [{"input_ids", "labels"}] for analyze

    def __post_init__(self) -> None:
        check_every(self.every)
        if isinstance(self.batch_size, bool) or not isinstance(self.batch_size, int) or self.batch_size < 1:
            raise UserError(f"DiagnosticsCallback: batch_size must be a positive integer, got "
                            f"{self.batch_size!r}")
        batch = _labelled(self.input_ids) if self.input_ids is not None else None
        self._core = Diagnostics(self.every, olmo_loss, olmo_head, batch)
        self._view: SchemeView | None = None
        self._pending = False

    def _out(self) -> Path:
        if self.folder is not None:
            return Path(self.folder)
        save = str(self.trainer.save_folder)
        return Path(save if not is_url(save) else self.trainer.work_dir)

    def pre_train(self) -> None:
        self._view = scheme_view(self.trainer.train_module.model)
        self._core.start(self._out(), self.trainer.global_step, writer=get_rank() == 0)

    def pre_step(self, batch: dict[str, Any]) -> None:
        if self._core.batch is None and (self._core.every or self.at_end):
            self._core.batch = _labelled(batch["input_ids"][:self.batch_size])

    def pre_optim_step(self) -> None:
        step = self.trainer.global_step
        if self._core.wants(step):        # after the backward passes, before clipping
            self._core.gradients(self._view, step)
            self._pending = True

    def post_train_batch(self) -> None:
        step = self.trainer.global_step
        if not (self._pending and self._core.wants(step)):
            return
        self._pending = False
        metrics = self._core.finish(self._core.record(self._view, step))
        for name, value in metrics.items():
            self.trainer.record_metric(name, value)

    def post_train(self) -> None:
        if self.at_end:
            self.analyze()

    def close(self) -> None:
        self._core.close()

    def analyze(self, model: nn.Module | None = None, batches: Sequence[Any] | None = None,
                out: str | Path | None = None) -> dict[str, Any]:
        """``analyze_model`` written to ``out`` (default: the probes' folder). Default ``batches``:
        ``analysis_batches``, else the probe batch. It clears the gradients: call it between steps."""
        view = scheme_view(model) if model is not None else self._view
        if view is None:
            raise UserError("DiagnosticsCallback.analyze: no model yet; give model=")
        source = "batches"
        if batches is None and self.analysis_batches:
            batches, source = self.analysis_batches, "analysis_batches"
        elif batches is None:
            batches = [self._core.batch] if self._core.batch is not None else []
            source = "probe batch"
        return self._core.analyze(view, batches, out if out is not None else self._out(), source=source)
