"""What a task is: the one interface through which every command reaches a kind of run.

A task (``lm``, ``vit``, ``dit``) is a :class:`Task`: its name, its run-configuration class, and
what differs between kinds of run. Everything else (the run folder, the training engine, the
probes, the analysis, the comparison) is shared and lives in :mod:`~siamesenorm.tasks.runner`,
:mod:`~siamesenorm.tasks.finished` and the layers below; they call a task only through these
fields, never by its name. A new kind of run is one new module that builds a :class:`Task`, and
one line in :mod:`~siamesenorm.tasks.registry`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import nn

from ..analysis.adapters import HeadFn, LossFn, lm_loss
from ..train import BatchSource, Evaluation

# Every task's validation losses (better lower); its ``columns`` follow them in compare's figures.
LOSSES = ("final_val_loss", "best_val_loss")
_TITLES = {"final_val_loss": "final val loss", "best_val_loss": "best val loss"}


@dataclass(frozen=True)
class Metric:
    """A figure of a run's ``summary.json`` that compare sums up over seeds and pairs with its baseline."""

    key: str
    title: str
    higher_is_better: bool = False

    @property
    def better(self) -> str:
        return "higher" if self.higher_is_better else "lower"


def default_title(key: str) -> str:
    """A figure's name in tables when its task gives none: ``final_arith_acc`` -> ``arith acc``."""
    return _TITLES.get(key) or key.removeprefix("final_").replace("_", " ")


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
    """One kind of run, as the shared code sees it (docs/tasks.md).

    - ``load_data(cfg, run_dir, resume) -> TaskData``: the data ``cfg.data`` names, checked, writing
      nothing (resumed, ``run_dir`` given: reads what the run saved, e.g. its tokenizer).
    - ``fit(cfg, data) -> cfg``: sets the sizes the data decides (vocabulary, image size, classes);
      ``config.yaml`` records the result.
    - ``build_model(cfg, device)``: the module to train, initialised from the (seeded) torch generator.
    - ``evaluation(cfg, data, run_dir, device) -> Evaluation``: the figures of every evaluation.
    - ``analysis_batches(cfg, run_dir, path, n)``: batches for ``analyze`` (the run's own, or of ``path``).
    - ``headline``, ``columns`` (``final_<name>``), ``higher_is_better``, ``titles``: the figures
      compare sums up and pairs (:attr:`metrics`; every figure not in ``higher_is_better`` is
      better lower) and their names in its tables (default: the key's words).
    - ``loss_fn``, ``head_fn`` (``None``: no logits, no logit lens): how the diagnostics run the
      model; ``generate`` (``None``: the task does not generate); ``kind``: its name in messages.
    - ``micro_batch(cfg) -> (x, y)`` on the meta device, ``tokens_per_sample(cfg)``,
      ``head_memory(cfg, tokens) -> (activations, buffers)``: for the dry run's memory.
    - ``multi_process``: may span processes (evaluations on every rank, written by rank 0);
      ``exports_hf``: ``export --format hf`` takes its runs.
    - ``default_preset``: what ``train`` and ``compare`` start from when no preset is named (``None``:
      the configuration class's defaults).
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
    default_preset: str | None = None
    titles: Mapping[str, str] = field(default_factory=dict, hash=False)

    @property
    def metrics(self) -> tuple[Metric, ...]:
        """Both losses, then the task's columns, each with its title and direction."""
        return tuple(Metric(k, self.titles.get(k) or default_title(k), k in self.higher_is_better)
                     for k in dict.fromkeys((*LOSSES, *self.columns)))
