"""``report.md`` and its PNG plots for a comparison."""

from __future__ import annotations

import json
import math
from pathlib import Path

from ..analysis.report_section import diagnostics_section


def _fmt(value, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _val_curve(run_dir: Path) -> tuple[list[int], list[float]]:
    steps, losses = [], []
    path = run_dir / "metrics.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row.get("val_loss") is not None:
                steps.append(row["step"])
                losses.append(row["val_loss"])
    return steps, losses


def _plot_curves(out: Path, rows: list[dict]) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for row in rows:
        steps, losses = _val_curve(out / row["run"])
        if steps:
            ax.plot(steps, losses, marker="o", ms=3, label=row["run"])
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title("Validation loss per run")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "val_loss.png", dpi=120)
    plt.close(fig)
    return "val_loss.png"


def _plot_grid(out: Path, rows: list[dict], schemes: list[str], lrs: list[float]) -> str:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    total = np.zeros((len(schemes), len(lrs)))
    count = np.zeros_like(total)
    diverged = np.zeros_like(total, dtype=bool)
    for row in rows:  # mean over seeds of the final loss; a cell is diverged if any seed diverged
        i, j = schemes.index(row["scheme"]), lrs.index(row["lr"])
        if row["diverged"]:
            diverged[i, j] = True
        elif row["final_val_loss"] is not None:
            total[i, j] += row["final_val_loss"]
            count[i, j] += 1
    grid = np.where(count > 0, total / np.maximum(count, 1), np.nan)
    fig, ax = plt.subplots(figsize=(1.6 * len(lrs) + 2, 0.5 * len(schemes) + 1.5))
    im = ax.imshow(np.where(diverged, np.nan, grid), cmap="viridis_r", aspect="auto")
    for i in range(len(schemes)):
        for j in range(len(lrs)):
            text = "diverged" if diverged[i, j] else _fmt(float(grid[i, j]), 3)
            ax.text(j, i, text, ha="center", va="center", fontsize=8,
                    color="red" if diverged[i, j] else "black",
                    bbox={"facecolor": "white", "alpha": 0.7, "edgecolor": "none"})
    ax.set_xticks(range(len(lrs)), [f"{lr:g}" for lr in lrs])
    ax.set_yticks(range(len(schemes)), schemes)
    ax.set_xlabel("learning rate")
    ax.set_title("Final validation loss (mean over seeds)")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(out / "lr_grid.png", dpi=120)
    plt.close(fig)
    return "lr_grid.png"


def write_report(out: Path, rows: list[dict], schemes: list[str], lrs: list[float]) -> None:
    lines = ["# Comparison", "", "| run | scheme | lr | seed | final val loss | best val loss | "
             "diverged (step) | tokens/s | parameters |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        div = f"yes ({r['diverged_at']})" if r["diverged"] else "no"
        lines.append(f"| {r['run']} | {r['scheme']} | {r['lr']:g} | {r['seed']} | "
                     f"{_fmt(r['final_val_loss'])} | {_fmt(r['best_val_loss'])} | {div} | "
                     f"{_fmt(r['tokens_per_s'], 0)} | {r['num_parameters']:,} |")
    lines += ["", f"![validation loss]({_plot_curves(out, rows)})", ""]
    if len(lrs) > 1:
        lines += [f"![final loss by scheme and learning rate]({_plot_grid(out, rows, schemes, lrs)})", ""]
    lines += diagnostics_section(out, rows)
    (out / "report.md").write_text("\n".join(lines))
