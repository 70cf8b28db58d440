"""What a task is: the one interface through which every command reaches a kind of run.

A task (``lm``, ``vit``, ``dit``) is a :class:`Task`: its name, its run-configuration class, and
what differs between kinds of run. Everything else (the run folder, the training engine, the
probes, the analysis, the comparison) is shared and lives in :mod:`~siamesenorm.tasks.runner`,
:mod:`~siamesenorm.tasks.finished` and the layers below; they call a task only through these
fields, never by its name. A new kind of run is one new module that builds a :class:`Task`, and
one line in :mod:`~siamesenorm.tasks.registry`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ..analysis.adapters import HeadFn, LossFn, lm_loss
from ..train import BatchSource, Evaluation


class TaskData(Protocol):
    """What a task loads for one data setting (everything ``cfg.data`` decides). It is read-only
    once loaded, so the runs that share a setting share one (compare loads each setting once).

    ``val_batches``: the fixed validation batches (also the probes' batch). ``batches(cfg)``: the
    run's own training batches, seeded by ``cfg.seed``. ``analysis_batches(cfg, n)``: what the
    analysis at the end of a run reads. ``info(cfg)``: added to ``summary.json`` as is (the data's
    name and fingerprint). ``save(run_dir)``: what a fresh run keeps besides its config, so that
    it can be reloaded (a tokenizer).
    """

    val_batches: list

    def batches(self, cfg: Any) -> BatchSource: ...

    def analysis_batches(self, cfg: Any, n: int) -> list: ...

    def info(self, cfg: Any) -> dict: ...

    def save(self, run_dir: Path) -> None: ...


@dataclass(frozen=True)
class Task:
    """One kind of run, as the shared code sees it.

    - ``load_data(cfg, run_dir, resume) -> TaskData``: the data ``cfg.data`` names, checked;
      writes nothing (a resumed run, ``run_dir`` given, reads what it saved: its tokenizer).
    - ``fit(cfg, data) -> cfg``: the resolve step that sets the sizes the data decides (the
      vocabulary, the image size, the classes), checking only what they touch; ``config.yaml``
      records its result.
    - ``build_model(cfg, device) -> nn.Module``: the module the engine trains, freshly initialised
      from the torch generator (the caller seeds it).
    - ``evaluation(cfg, data, run_dir, device) -> Evaluation``: the figures of every evaluation.
    - ``analysis_batches(cfg, run_dir, path, n) -> list``: batches for ``siamesenorm analyze``:
      the run's own validation batches, or batches of the data set at ``path``.
    - ``headline``: the summary figure compare's table shows, and its title; ``columns``: the
      task's figures (``final_<name>``) compare's tables add; ``higher_is_better``: those of them
      where higher is better (every other figure, the losses included, is better lower).
    - ``loss_fn``, ``head_fn``: how the diagnostics run the model and read logits from a hidden
      state (``head_fn=None``: no logits, no logit lens); ``generate``: continue a prompt with a
      finished run (``None``: the task does not generate).
    - ``kind``: what a run of the task is, in messages (``language-model``).
    - ``micro_batch(cfg) -> (x, y)``: one micro-batch as the task's sampler yields it, on the meta
      device; ``tokens_per_sample(cfg)``: the tokens the model sees per sample.
    - ``multi_process``: whether a run may span processes (``--nproc``): its evaluations run on
      every rank and write through rank 0 only.
    - ``exports_hf``: whether ``export --format hf`` writes its runs as Hugging Face folders.
    - ``head_memory(cfg, tokens) -> (activations, buffers)``: bytes the task's model keeps besides
      its blocks for ``tokens`` tokens (a language model's fp32 logits and rotary tables).
    """

    name: str
    config_class: type
    load_data: Callable[[Any, Path | None, bool], TaskData]
    fit: Callable[[Any, Any], Any]
    build_model: Callable[[Any, torch.device | str | None], nn.Module]
    evaluation: Callable[[Any, Any, Path, torch.device], Evaluation]
    analysis_batches: Callable[[Any, Path, str | None, int], list]
    headline: tuple[str, str]
    columns: tuple[str, ...]
    higher_is_better: tuple[str, ...]
    head_fn: HeadFn | None
    kind: str
    micro_batch: Callable[[Any], tuple[torch.Tensor, torch.Tensor]]
    tokens_per_sample: Callable[[Any], int]
    loss_fn: LossFn = lm_loss
    generate: Callable[..., str] | None = None
    multi_process: bool = False
    exports_hf: bool = False
    head_memory: Callable[[Any, int], tuple[int, int]] = lambda cfg, tokens: (0, 0)
