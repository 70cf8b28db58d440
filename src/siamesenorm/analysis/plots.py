"""PNG plots of one model's analysis (``siamesenorm analyze``): one figure per diagnostic."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..rundir import save_figure


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> str:
    fig.tight_layout()
    save_figure(fig, path, dpi=110)      # never through a link planted under its name
    pyplot().close(fig)
    return path.name


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f}%"


def plot_analysis(out: Path, result: dict[str, Any], probes: list[dict]) -> list[str]:
    """Write the plots of ``result`` into ``out``; returns their names. ``probes`` adds the training curve."""
    plt = pyplot()
    out.mkdir(parents=True, exist_ok=True)
    per, n = result["sublayers_per_block"], result["n_layers"]
    names = []

    fig, ax = plt.subplots(figsize=(6, 4))
    for stream, values in result["probes"]["rms"].items():
        ax.plot([k / per for k in range(len(values))], values, marker=".", label=stream)
    ax.set(xlabel="depth (blocks; fractions: after the attention sublayer)", ylabel="RMS",
           yscale="log", title="Hidden-state RMS per stream")
    ax.grid(alpha=0.3)
    ax.legend()
    names.append(save(fig, out / "hidden_rms.png"))

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(range(n), [v or 0.0 for v in result["probes"]["grad_norm"]["blocks"]])
    left.set(xlabel="block", ylabel="gradient norm", title="Per block, at the checkpoint")
    steps = [r["step"] for r in probes if r.get("grad_norm") is not None]
    if steps:
        right.plot(steps, [r["grad_norm"] for r in probes if r.get("grad_norm") is not None])
        right.set(yscale="log")
    else:
        right.text(0.5, 0.5, "no probes.jsonl (analysis.every=0)", ha="center", va="center")
    right.set(xlabel="step", ylabel="total gradient norm (before clipping)", title="During training")
    names.append(save(fig, out / "grad_norm.png"))

    gains = result["probes"]["gains"]
    lists = {k: v for k, v in gains.items() if isinstance(v, list)}
    singles = {k: v for k, v in gains.items() if not isinstance(v, list)}
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4), width_ratios=(3, 2))
    for name, values in lists.items():
        left.plot(range(len(values)), values, marker=".", label=name)
    left.set(xlabel="index (sublayer, or block for per-block norms)", ylabel="mean |weight|",
             title="Norm gains per layer")
    if lists:
        left.legend(fontsize=8)
    right.bar(range(len(singles)), list(singles.values()))
    right.set_xticks(range(len(singles)), list(singles), rotation=30, fontsize=8)
    right.set(ylabel="mean |weight|", title="Single norms (final merge)")
    names.append(save(fig, out / "gains.png"))

    pruning = result["pruning"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    left.bar(range(n), pruning["per_block"])
    left.set(xlabel="block skipped", ylabel="validation loss increase",
             title=f"Layer pruning (effective depth {pruning['effective_depth']:.1f} of {n})")
    right.plot(range(n + 1), pruning["depth_curve"], marker=".")
    right.set(xlabel="blocks kept (the first k)", ylabel="validation loss increase",
              title="Effective-depth curve")
    for ax in (left, right):
        ax.grid(alpha=0.3)
    names.append(save(fig, out / "pruning.png"))

    lens = result["lens"]
    if lens is not None:  # None for models without logits to read (a DiT)
        fig, ax = plt.subplots(figsize=(6, 4))
        for stream, values in lens["by_depth"].items():
            ax.plot(range(len(values)), values, marker=".", label=f"{stream} (follows "
                    f"{_fmt(lens['follows'].get(stream))} where streams disagree)")
        ax.set(xlabel="blocks", ylabel="agreement with the model's prediction", ylim=(0, 1.02),
               title=f"Logit lens per stream (streams disagree on {_fmt(lens['disagree_fraction'])})")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        names.append(save(fig, out / "logit_lens.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    for stream, values in result["angular"].items():
        ax.plot(range(len(values)), values, marker=".", label=stream)
    ax.set(xlabel="block", ylabel="angular distance (input to output) / pi",
           title="Angular distance between consecutive blocks")
    ax.grid(alpha=0.3)
    ax.legend()
    names.append(save(fig, out / "angular.png"))
    return names
