"""``siamesenorm analyze``: every diagnostic on one trained model, into ``analysis.json`` and plots.

:func:`analyze_model` works on any model with a ``.scheme`` and ``.sublayers`` given its
``loss_fn`` and ``head_fn`` (:mod:`.adapters`); :func:`analyze_run` loads a language-model run
directory's last checkpoint and its validation data (or other data) and writes the results.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..train.metrics import write_json
from .adapters import HeadFn, LossFn, lm_head, lm_loss, vit_head
from .angular import angular_distances
from .lens import logit_lens
from .probes import grad_norms, norm_gains, sublayer_rms
from .pruning import pruning_sensitivity
from .training_probes import read_probes, to_device

ANALYSIS_FILE = "analysis.json"
PLOTS_DIR = "analysis"


def checkpoint_probes(model: nn.Module, batches: Sequence[Any], loss_fn: LossFn = lm_loss) -> dict:
    """The training probes on a trained model: stream RMS over ``batches`` (every element of every
    batch), norm gains, and gradient norms of the mean loss over ``batches`` (one backward pass
    each; eval mode; the model's gradients are cleared afterwards)."""
    was_training = model.training
    model.eval()
    try:
        per_batch = [sublayer_rms(model, b, loss_fn) for b in batches]
        rms = {s: [(sum(r[s][k] ** 2 for r in per_batch) / len(per_batch)) ** 0.5
                   for k in range(len(per_batch[0][s]))] for s in per_batch[0]}
        model.zero_grad(set_to_none=True)
        for b in batches:
            (loss_fn(model, b) / len(batches)).backward()
        grads = grad_norms(model)
        model.zero_grad(set_to_none=True)
    finally:
        model.train(was_training)
    return {"rms": rms, "gains": norm_gains(model), "grad_norm": grads}


def analyze_model(model: nn.Module, batches: Sequence[Any], loss_fn: LossFn = lm_loss,
                  head_fn: HeadFn | None = lm_head) -> dict[str, Any]:
    """Pruning sensitivity, logit lens, angular distances and the probes of ``model`` on ``batches``.

    ``head_fn=None`` (a model without logits to read, such as a DiT) leaves the lens out (``None``).

    Each part is described in docs/analysis.md and in its function: :func:`.pruning_sensitivity`,
    :func:`.logit_lens`, :func:`.angular_distances`, :func:`checkpoint_probes`.
    """
    if not batches:
        raise ValueError("analyze_model needs at least one batch")
    scheme = model.scheme
    per = getattr(scheme, "sublayers_per_block", 2)
    pruning = pruning_sensitivity(model, batches, loss_fn)
    return {
        "scheme": getattr(scheme, "name", type(scheme).__name__),
        "n_layers": len(model.sublayers) // per,
        "sublayers_per_block": per,
        "batches": len(batches),
        "loss": pruning["base_loss"],
        "pruning": pruning,
        "lens": logit_lens(model, batches, loss_fn, head_fn) if head_fn is not None else None,
        "angular": angular_distances(model, batches, loss_fn),
        "probes": checkpoint_probes(model, batches, loss_fn),
    }


def write_analysis(out: str | Path, result: dict[str, Any], *, source: str,
                   run_dir: str | Path | None = None) -> Path:
    """Write ``out/analysis.json`` and the plots in ``out/analysis/``; returns the JSON's path.

    ``source`` names the data analysed; the training-curve plot reads ``run_dir/probes.jsonl``
    (``run_dir`` defaults to ``out``).
    """
    from .plots import plot_analysis

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    probes = read_probes(run_dir if run_dir is not None else out)
    plots = plot_analysis(out / PLOTS_DIR, result, probes)
    record = {**result, "data": source, "plots": [f"{PLOTS_DIR}/{p}" for p in plots]}
    write_json(out / ANALYSIS_FILE, record)
    return out / ANALYSIS_FILE


def _saved_task(run_dir: Path) -> str:
    from ..config import load_config
    from ..errors import ConfigError

    if not (run_dir / "config.yaml").is_file():
        raise ConfigError(f"{run_dir} is not a run directory: it holds no config.yaml")
    return load_config(str(run_dir / "config.yaml")).task


def analyze_run(run_dir: str | Path, data: str | None = None, *, batches: int | None = None,
                device: str = "cpu", out: str | Path | None = None) -> dict[str, Any]:
    """Analyse the last checkpoint of the run ``run_dir`` (a language model, ViT or DiT).

    ``data``: a text file, folder or token file to analyse instead of the run's validation split;
    ``batches``: how many batches of the run's ``batch_size x seq_len`` (default
    ``analysis.batches`` of its config): the first of the run's own evaluation batches, or batches
    spread evenly over ``data``; ``out``: where to write (default ``run_dir``).
    Errors a user can cause (no run, no checkpoint, unreadable or too little data) raise
    :class:`~siamesenorm.errors.ConfigError`.
    """
    from ..data import validation_batches
    from ..errors import ConfigError
    from ..run import analysis_batches, analysis_tokens, check_out_dir, load_model

    if batches is not None and batches <= 0:
        raise ConfigError(f"--batches must be positive, got {batches}")
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"run directory {run_dir} does not exist")
    check_out_dir(out if out is not None else run_dir)
    task = _saved_task(run_dir)
    head_fn: HeadFn | None = lm_head
    if task == "lm":
        model, cfg = load_model(run_dir, device)
        tokens = analysis_tokens(run_dir, cfg, data)
        n = batches or cfg.analysis.batches
        chosen = analysis_batches(tokens, cfg, n) if data is None else \
            validation_batches(tokens, cfg.data.batch_size, cfg.data.seq_len, n)
    else:  # a ViT (its lens reads the class token) or a DiT (no logits: no lens)
        from ..tasks.common import image_analysis_batches, load_image_run

        model, cfg = load_image_run(run_dir, device)
        chosen = image_analysis_batches(cfg, data, batches or cfg.analysis.batches)
        head_fn = vit_head if task == "vit" else None
    dev = next(model.parameters()).device
    with torch.random.fork_rng(devices=[]):
        result = analyze_model(model, [to_device(b, dev) for b in chosen], head_fn=head_fn)
    write_analysis(out if out is not None else run_dir, result,
                   source=str(data) if data is not None else "validation", run_dir=run_dir)
    return result
