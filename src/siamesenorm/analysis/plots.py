"""PNG plots of one model's analysis (``siamesenorm analyze``): one figure per diagnostic."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .style import integer_ticks, legend_outside, marker, pyplot, save

__all__ = ["analysis_figures", "plot_analysis", "pyplot", "save"]


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def analysis_figures(result: dict[str, Any], probes: list[dict]) -> dict[str, Any]:
    """File name -> matplotlib figure of each plot of ``result``; ``probes`` adds the training curve."""
    plt = pyplot()
    per, n = result["sublayers_per_block"], result["n_layers"]
    figs = {}

    fig, ax = plt.subplots(figsize=(6, 4))
    for stream, values in result["probes"]["rms"].items():
        ax.plot([k / per for k in range(len(values))], values, marker=".", label=stream)
    ax.set(xlabel="depth (blocks; points between: after the attention sublayer)", ylabel="RMS",
           yscale="log", title="Hidden-state RMS per stream")
    integer_ticks(ax)
    ax.grid(alpha=0.3)
    legend_outside(ax, title="stream")
    figs["hidden_rms.png"] = fig

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(range(n), [v or 0.0 for v in result["probes"]["grad_norm"]["blocks"]])
    left.set(xlabel="block", ylabel="gradient norm", title="Per block, at the checkpoint")
    integer_ticks(left)
    curve = [(r["step"], r["grad_norm"]) for r in probes if r.get("grad_norm") is not None]
    if curve:
        right.plot(*zip(*curve), marker=marker(len(curve)), ms=4)
        right.set(yscale="log")
        right.grid(alpha=0.3)
    else:
        right.text(0.5, 0.5, "no probes.jsonl (analysis.every=0)", ha="center", va="center")
    right.set(xlabel="step", ylabel="total gradient norm (before clipping)", title="During training")
    integer_ticks(right)
    figs["grad_norm.png"] = fig

    gains = result["probes"]["gains"]
    lists = {k: v for k, v in gains.items() if isinstance(v, list)}
    singles = {k: v for k, v in gains.items() if not isinstance(v, list)}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4), width_ratios=(3, 2))
    for name, values in lists.items():
        left.plot(range(len(values)), values, marker=".", label=name)
    left.set(xlabel="index (sublayer, or block for per-block norms)", ylabel="mean |weight|",
             title="Norm gains per layer")
    integer_ticks(left)
    left.grid(alpha=0.3)
    legend_outside(left)
    right.bar(range(len(singles)), [v or 0.0 for v in singles.values()])
    right.set_xticks(range(len(singles)), list(singles), rotation=30, fontsize=8, ha="right")
    right.set(ylabel="mean |weight|", title="Single norms (final merge)")
    figs["gains.png"] = fig

    pruning = result["pruning"]
    unit = " (nats)" if result["lens"] is not None else ""   # cross-entropy; a DiT's is its objective
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(range(n), pruning["per_block"])
    depth = pruning["effective_depth"]
    left.set(xlabel="block skipped", ylabel=f"validation loss increase{unit}",
             title=f"Layer pruning (effective depth {'-' if depth is None else f'{depth:.1f}'} of {n})")
    right.plot(range(n + 1), pruning["depth_curve"], marker=".")
    right.set(xlabel="blocks kept (the first k)", ylabel=f"validation loss increase{unit}",
              title="Effective-depth curve")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        integer_ticks(ax)
    figs["pruning.png"] = fig

    lens = result["lens"]
    if lens is not None:  # None for models without logits to read (a DiT)
        fig, ax = plt.subplots(figsize=(6, 4))
        for stream, values in lens["by_depth"].items():
            ax.plot(range(len(values)), values, marker=".", label=f"{stream} (follows "
                    f"{_fmt(lens['follows'].get(stream))} where streams disagree)")
        ax.set(xlabel="blocks", ylabel="agreement with the model's prediction", ylim=(0, 1.02),
               title=f"Logit lens per stream (streams disagree on {_fmt(lens['disagree_fraction'])})")
        integer_ticks(ax)
        ax.grid(alpha=0.3)
        legend_outside(ax, title="stream")
        figs["logit_lens.png"] = fig

    fig, ax = plt.subplots(figsize=(6, 4))
    for stream, values in result["angular"].items():
        ax.plot(range(len(values)), values, marker=".", label=stream)
    ax.set(xlabel="block", ylabel="angular distance (input to output) / pi",
           title="Angular distance between consecutive blocks")
    integer_ticks(ax)
    ax.grid(alpha=0.3)
    legend_outside(ax, title="stream")
    figs["angular.png"] = fig
    return figs


def plot_analysis(out: Path, result: dict[str, Any], probes: list[dict]) -> list[str]:
    """Write the plots of ``result`` into ``out``; returns their names; ``probes`` adds the training
    curve."""
    out.mkdir(parents=True, exist_ok=True)
    return [save(fig, out / name) for name, fig in analysis_figures(result, probes).items()]
