"""Every diagnostic on one trained model, into ``analysis.json`` and plots."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..models.host import SchemeHost
from ..rundir import RunDir, inner_folder, write_json
from ..schemes.base import SUBLAYERS_PER_BLOCK
from .adapters import HeadFn, LossFn, lm_head, lm_loss
from .angular import angular_distances
from .lens import logit_lens
from .probes import grad_norms, norm_gains, sublayer_rms
from .pruning import pruning_sensitivity
from .training_probes import read_probes


def checkpoint_probes(model: SchemeHost, batches: Sequence[Any], loss_fn: LossFn = lm_loss) -> dict:
    """The training probes on a trained model over ``batches``: stream RMS, norm gains, and the gradient
    norms of the mean loss (eval mode; the model's gradients are cleared afterwards)."""
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


def analyze_model(model: SchemeHost, batches: Sequence[Any], loss_fn: LossFn = lm_loss,
                  head_fn: HeadFn | None = lm_head) -> dict[str, Any]:
    """Pruning sensitivity, logit lens, angular distances and probes of ``model`` on ``batches``;
    ``head_fn=None`` (a model without logits, a DiT) leaves ``lens`` ``None``."""
    if not batches:
        raise ValueError("analyze_model needs at least one batch")
    scheme = model.scheme
    pruning = pruning_sensitivity(model, batches, loss_fn)
    return {
        "scheme": scheme.name,
        "n_layers": scheme.n_layers,
        "sublayers_per_block": SUBLAYERS_PER_BLOCK,
        "batches": len(batches),
        "loss": pruning["base_loss"],
        "pruning": pruning,
        "lens": logit_lens(model, batches, loss_fn, head_fn) if head_fn is not None else None,
        "angular": angular_distances(model, batches, loss_fn),
        "probes": checkpoint_probes(model, batches, loss_fn),
    }


def write_analysis(out: str | Path, result: dict[str, Any], *, source: str,
                   run_dir: str | Path | None = None) -> Path:
    """Write ``out/analysis.json`` and the plots in ``out/analysis/``; returns the JSON's path. ``source``
    names the data; the training curve reads ``run_dir/probes.jsonl`` (``run_dir`` defaults to ``out``)."""
    from .plots import plot_analysis

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    probes = read_probes(run_dir if run_dir is not None else out)
    layout = RunDir(out)
    plots = plot_analysis(inner_folder(layout.plots), result, probes)
    record = {**result, "data": source, "plots": [f"{layout.plots.name}/{p}" for p in plots]}
    write_json(layout.analysis, record)
    return layout.analysis
