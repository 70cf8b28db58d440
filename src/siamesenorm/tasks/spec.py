"""What a task is: the one interface through which every command reaches a kind of run.

A task (``lm``, ``vit``, ``dit``) is a :class:`Task`: a name, its run-configuration class, and the
few functions that differ between kinds of run. Everything else (the run directory, the training
engine, the probes, the analysis, the comparison) is shared and lives in
:mod:`~siamesenorm.tasks.runner`, :mod:`~siamesenorm.tasks.analyze` and the layers below; they call
a task only through these fields, never by its name. A new kind of run is one new module that
builds a :class:`Task`, and one line in :mod:`~siamesenorm.tasks.registry`.

The data a task loads is anything with ``sampler`` (a :class:`~siamesenorm.train.BatchSource`) and
``val_batches`` (fixed validation batches, a list): :class:`RunData`. The model it builds is the
module the engine trains (``model(x, y).loss``), hosting a residual scheme
(:class:`~siamesenorm.models.host.SchemeHost`), so the diagnostics work on it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ..analysis.adapters import HeadFn, LossFn, lm_loss
from ..train import BatchSource


class RunData(Protocol):
    """What every task's data offers the shared run: the training sampler and the fixed
    validation batches (also the probes' batch and, by default, what the final analysis reads)."""

    sampler: BatchSource
    val_batches: list


def _nothing(*_: Any) -> None:
    return None


def _no_info(_: Any) -> dict:
    return {}


def _first_val_batches(cfg: Any, data: RunData, n: int) -> list:
    return data.val_batches[:n]


def _data_signature(cfg: Any) -> Hashable:
    return repr(cfg.data)


@dataclass(frozen=True)
class Task:
    """One kind of run, as the shared code sees it.

    ``name``: the ``task`` key of a configuration. ``config_class``: its run configuration (a
    dataclass with ``task``, ``model``, ``data``, ``train``, ``seed`` and ``analysis``).

    Training a run (:func:`~siamesenorm.tasks.runner.run_task`):

    - ``load_data(cfg, run_dir, resume) -> RunData``: everything the run trains on, checked;
      writes nothing (``run_dir`` holds what a resumed run saved, e.g. its tokenizer).
    - ``fit_config(cfg, data) -> cfg``: the configuration with the sizes the data decides (the
      vocabulary, the image size, the classes); it is what ``config.yaml`` records.
    - ``build_model(cfg, device) -> nn.Module``: the module the engine trains, freshly initialised
      from the torch generator (the caller seeds it).
    - ``save_assets(run_dir, data)``: what a fresh run keeps besides its config (a tokenizer).
    - ``extra_eval(cfg, data, run_dir, device) -> callable | None``: more figures at each
      evaluation (``model -> dict``, or ``(model, step=...) -> dict``).
    - ``summary_info(data) -> dict``: added to ``summary.json`` as is (the corpus's fingerprint).
    - ``end_batches(cfg, data, n) -> list``: the batches the analysis at the end of a run reads.

    Checking and reading runs:

    - ``check_data(cfg)``: refuse what is wrong with the data before anything is written (compare
      checks every cell with it before it claims its folder); ``data_signature(cfg)`` tells which
      cells share a data check.
    - ``analysis_batches(cfg, run_dir, data, n) -> list``: ``n`` batches for ``siamesenorm
      analyze``: the run's own validation batches, or batches of the data set ``data`` names.
    - ``loss_fn``, ``head_fn``: how the diagnostics run the model and read logits from a hidden
      state (:mod:`siamesenorm.analysis.adapters`); ``head_fn=None``: the model has no logits to
      read (no logit lens).
    - ``headline``: the summary figure compare's printed table shows, and its title;
      ``columns``: the task's figures (``final_<name>`` in a summary) compare's tables add;
      ``higher_is_better``: those of them where higher is better (accuracies); every other figure,
      the losses and the FD-proxy included, is better lower (compare's verdicts read it).
    - ``generate``: continue a prompt with a finished run (``None``: the task does not generate).
    """

    name: str
    config_class: type
    load_data: Callable[[Any, Path, bool], RunData]
    fit_config: Callable[[Any, Any], Any]
    build_model: Callable[[Any, torch.device | str | None], nn.Module]
    check_data: Callable[[Any], None]
    analysis_batches: Callable[[Any, Path, str | None, int], list]
    headline: tuple[str, str]
    save_assets: Callable[[Path, Any], None] = _nothing
    extra_eval: Callable[[Any, Any, Path, torch.device], Callable | None] = _nothing
    summary_info: Callable[[Any], dict] = _no_info
    end_batches: Callable[[Any, Any, int], list] = _first_val_batches
    data_signature: Callable[[Any], Hashable] = _data_signature
    loss_fn: LossFn = lm_loss
    head_fn: HeadFn | None = None
    columns: tuple[str, ...] = ()
    higher_is_better: tuple[str, ...] = ()
    generate: Callable[..., str] | None = None
