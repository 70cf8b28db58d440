"""The paper's diagnostics in transformers' ``Trainer``: :class:`DiagnosticsCallback` (docs/analysis.md,
"In your own trainer")."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn
from transformers import TrainerCallback

from ..analysis.adapters import lm_head
from ..analysis.callbacks import Diagnostics, SchemeView
from ..errors import UserError
from .adapted import _SchemeCausalLM
from .modeling import SiameseNormForCausalLM

__all__ = ["DiagnosticsCallback", "first_batch", "hf_head", "hf_loss", "scheme_view"]

log = logging.getLogger(__name__)


def scheme_view(model: nn.Module) -> SchemeView:
    """An adapted model (``siamesenorm.hf.adapt``, under PEFT too) or our ``SiameseNormForCausalLM``
    as the diagnostics' scheme host."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    if isinstance(base, _SchemeCausalLM):
        return SchemeView(base, base.model.stack.scheme, base.model.stack.sublayers)
    if isinstance(base, SiameseNormForCausalLM):
        return SchemeView(base, base.model.scheme, base.model.sublayers)
    raise UserError(f"the diagnostics need a model with a residual scheme (siamesenorm.hf.adapt, or "
                    f"siamesenorm's SiameseNormForCausalLM); got {type(base).__name__}")


def hf_loss(view: SchemeView, batch: Any) -> Tensor:
    """The mean loss of a Trainer batch (``labels``: its ``input_ids`` when absent) or of ``(x, y)``
    with shifted targets ``y``."""
    if isinstance(batch, Mapping):
        batch = dict(batch)
        batch.setdefault("labels", batch["input_ids"])
        return view.module(**batch).loss
    x, y = batch
    logits = view.module(input_ids=x).logits
    return F.cross_entropy(logits.flatten(0, -2).float(), y.flatten(), ignore_index=-100)


def hf_head(view: SchemeView, hidden: Tensor) -> Tensor:
    module = view.module
    if isinstance(module, SiameseNormForCausalLM):
        return lm_head(module.model, hidden)
    return module.lm_head(hidden)


def first_batch(loader: Any, size: int) -> Any:
    """The first ``size`` examples of ``loader``'s data set through its collator: no sampler is run."""
    dataset, collate = getattr(loader, "dataset", None), getattr(loader, "collate_fn", None)
    if dataset is None or collate is None:
        raise UserError("the diagnostics cannot read the training data's first examples; give batch=")
    try:
        items = [dataset[i] for i in range(min(size, len(dataset)))]
    except (TypeError, NotImplementedError):        # an iterable data set
        items = list(itertools.islice(iter(dataset), size))
    if not items:
        raise UserError("the training data set is empty: the diagnostics have no batch; give batch=")
    batch = collate(items)
    return dict(batch) if isinstance(batch, Mapping) else batch


def _rescale(row: dict[str, Any], total: Any, max_norm: float) -> None:
    """The gradient norms of ``row`` (measured after clipping) as before it: clipping scaled every
    gradient by one factor, ``total`` (the Trainer's norm before clipping) over the measured total."""
    measured = row.get("grad_norm")
    if not isinstance(total, (int, float)) or measured is None:
        return
    if max_norm and max_norm > 0 and total > max_norm and measured > 0:
        k = total / measured
        row["grad_norm_blocks"] = [v * k for v in row["grad_norm_blocks"]]
        row["grad_norm_scheme"] = row["grad_norm_scheme"] * k
    row["grad_norm"] = float(total)


class DiagnosticsCallback(TrainerCallback):
    """Every ``every`` steps (0 or None: off) the probes of ``siamesenorm``'s training loop on a fixed
    ``batch`` (default: the first ``batch_size`` training examples): ``output_dir/probes.jsonl`` and
    the Trainer's loggers (:meth:`attach` gives the callback the Trainer to log through). At the end
    (``at_end``) or on request (:meth:`analyze`): ``analysis.json`` and the plots of ``analyze``."""

    def __init__(self, every: int | None = 100, *, batch: Any = None, batch_size: int = 4,
                 analysis_batches: int = 2, at_end: bool = True, trainer: Any = None) -> None:
        for name, value in (("batch_size", batch_size), ("analysis_batches", analysis_batches)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"DiagnosticsCallback: {name} must be a positive integer, got {value!r}")
        self.core = Diagnostics(every, hf_loss, hf_head, batch)
        self.batch, self.batch_size, self.analysis_batches = batch, batch_size, analysis_batches
        self.at_end, self.trainer = at_end, trainer
        self.view: SchemeView | None = None
        self.out: Path | None = None
        self.row: dict[str, Any] | None = None
        self._logging = False

    def attach(self, trainer: Any) -> DiagnosticsCallback:
        """Add this callback to ``trainer``, whose ``log`` then carries the probes to its reporters."""
        self.trainer = trainer
        trainer.add_callback(self)
        return self

    def on_train_begin(self, args, state, control, model=None, train_dataloader=None, **kwargs):
        self.view, self.out = scheme_view(model), Path(args.output_dir)
        if self.batch is None and (self.core.every or self.at_end):
            self.batch = first_batch(train_dataloader, self.batch_size)
        self.core.batch = self.batch
        self.core.start(self.out, state.global_step, writer=state.is_world_process_zero)
        if self.trainer is None and self.core.every:
            log.warning("DiagnosticsCallback: no trainer to log through; probes go to probes.jsonl only "
                        "(DiagnosticsCallback(...).attach(trainer) adds the reporters)")

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if self.core.wants(state.global_step + 1):     # gradients complete; clipped already
            self.core.gradients(self.view, state.global_step + 1)

    def on_step_end(self, args, state, control, **kwargs):
        if self.core.wants(state.global_step):
            self.row = self.core.record(self.view, state.global_step)
            control.should_log = True       # the Trainer's log brings its norm before clipping

    def on_log(self, args, state, control, logs=None, **kwargs):
        row, logs = self.row, logs or {}
        if row is None or self._logging or row["step"] != state.global_step or \
                not ("grad_norm" in logs or "loss" in logs):
            return
        self.row = None
        _rescale(row, logs.get("grad_norm"), args.max_grad_norm)
        self._emit(self.core.finish(row))

    def _emit(self, metrics: dict[str, float]) -> None:
        if self.trainer is None:
            return
        self._logging = True
        try:
            self.trainer.log(dict(metrics))
        finally:
            self._logging = False

    def on_train_end(self, args, state, control, **kwargs):
        if self.row is not None:          # no log came for it: its norms as measured
            self.core.finish(self.row)
            self.row = None
        self.core.close()
        if self.at_end:
            self.analyze()

    def analyze(self, model: nn.Module | None = None, batches: Sequence[Any] | None = None,
                out: str | Path | None = None) -> dict[str, Any]:
        """``analyze_model`` (pruning, logit lens, angular distances, probes) written to ``out`` (default
        ``output_dir``). Default ``batches``: the first of the evaluation set, else the probe batch.
        It clears the gradients: call it between steps."""
        view = scheme_view(model) if model is not None else self.view
        if view is None and self.trainer is not None:
            view = scheme_view(self.trainer.model)
        if view is None:
            raise UserError("DiagnosticsCallback.analyze: no model yet; give model=")
        source = "batches"
        if batches is None:
            batches, source = self._default_batches()
        if out is None:
            out = self.out or (self.trainer.args.output_dir if self.trainer is not None else None)
        if out is None:
            raise UserError("DiagnosticsCallback.analyze: give out= (a folder)")
        return self.core.analyze(view, batches, out, source=source)

    def _default_batches(self) -> tuple[list, str]:
        trainer = self.trainer
        if trainer is not None and getattr(trainer, "eval_dataset", None) is not None:
            loader, size = trainer.get_eval_dataloader(), trainer.args.eval_batch_size
            items = first_batch(loader, size * self.analysis_batches)
            if isinstance(items, dict):
                n = len(next(iter(items.values())))
                return [{k: v[i:i + size] for k, v in items.items()}
                        for i in range(0, n, size)], "evaluation set"
        if self.batch is None:
            raise UserError("DiagnosticsCallback.analyze: no batches; give batches=")
        return [self.batch], "probe batch"
