"""``report.md`` and its PNG plots for a comparison."""

from __future__ import annotations

import math
from pathlib import Path

from ..analysis.report_section import diagnostics_section
from ..rundir import RunDir, read_jsonl, write_text


def _fmt(value, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _curve(run_dir: Path, key: str = "val_loss") -> tuple[list[int], list[float]]:
    """``(steps, values)`` of ``key`` over the evaluation rows of a run's metrics.jsonl."""
    steps, values = [], []
    for row in read_jsonl(RunDir(run_dir).metrics):
        if row.get(key) is not None:
            steps.append(row["step"])
            values.append(row[key])
    return steps, values


# Curves a report plots when its runs logged them: (metrics key, axis label, file).
CURVES = (("val_loss", "validation loss", "val_loss.png"),
          ("val_acc", "validation top-1 accuracy", "val_acc.png"),
          ("arith_acc", "arithmetic exact-match accuracy", "arith_acc.png"),
          ("fd_proxy", "FD-proxy (lower is better; not Inception FID)", "fd_proxy.png"),
          ("sample_acc", "class accuracy of samples (proxy classifier)", "sample_acc.png"),
          ("expert_load_max", "largest expert share (1 / experts when balanced)",
           "expert_load_max.png"),
          ("router_entropy", "router entropy (nats)", "router_entropy.png"))


def _plot_expert_load(out: Path, rows: list[dict]) -> str | None:
    """Each expert's share of the token-expert assignments at each run's last evaluation (mean
    over its MoE layers), one line per run; ``None`` when no run has mixture-of-experts layers."""
    loads = []
    for row in rows:
        last = [r["expert_load"] for r in read_jsonl(RunDir(out / row["run"]).metrics)
                if isinstance(r.get("expert_load"), list) and r["expert_load"]]
        if last:
            layers = last[-1]
            loads.append((row["run"], [sum(col) / len(layers) for col in zip(*layers)]))
    if not loads:
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, load in loads:
        ax.plot(range(len(load)), load, marker="o", ms=3, label=name)
    ax.axhline(1 / len(loads[0][1]), color="grey", lw=0.8, ls="--", label="balanced")
    ax.set_xlabel("expert")
    ax.set_ylabel("share of assignments (mean over layers)")
    ax.set_title("Expert load at the last evaluation")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "expert_load.png", dpi=120)
    plt.close(fig)
    return "expert_load.png"


def _plot_curves(out: Path, rows: list[dict], key: str, label: str, filename: str) -> str | None:
    """One line per run of ``key`` against step; ``None`` (no file) when no run logged it."""
    curves = [(row["run"], *_curve(out / row["run"], key)) for row in rows]
    if not any(steps for _, steps, _ in curves):
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, steps, values in curves:
        if steps:
            ax.plot(steps, values, marker="o", ms=3, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel(label)
    ax.set_title(f"{label[0].upper()}{label[1:]} per run")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / filename, dpi=120)
    plt.close(fig)
    return filename


def _last_sample_grid(run_dir: Path) -> Path | None:
    grids = RunDir(run_dir).sample_grids()
    return grids[-1] if grids else None


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


# Figures of some tasks, shown as extra table columns when any run has them.
_EXTRA = (("final_val_acc", "val top-1"), ("final_arith_acc", "arith acc"),
          ("final_fd_proxy", "FD-proxy"), ("final_sample_acc", "sample acc"))


def write_report(out: Path, rows: list[dict], schemes: list[str], lrs: list[float]) -> None:
    extra = [(k, title) for k, title in _EXTRA if any(r.get(k) is not None for r in rows)]
    head = ["run", "scheme", "lr", "seed", "final val loss", "best val loss", *(t for _, t in extra),
            "diverged (step)", "max grad norm (step)", "tokens/s", "parameters"]
    lines = ["# Comparison", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        div = f"yes ({r['diverged_at']})" if r["diverged"] else "no"
        peak = "-" if r.get("max_grad_norm") is None else \
            f"{r['max_grad_norm']:.3g} ({r['max_grad_norm_step']})"
        cells = [r["run"], r["scheme"], f"{r['lr']:g}", str(r["seed"]), _fmt(r["final_val_loss"]),
                 _fmt(r["best_val_loss"]), *(_fmt(r.get(k)) for k, _ in extra), div, peak,
                 _fmt(r["tokens_per_s"], 0), f"{r['num_parameters']:,}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for key, label, filename in CURVES:
        name = _plot_curves(out, rows, key, label, filename)
        if name is not None:
            lines += [f"![{label}]({name})", ""]
    load = _plot_expert_load(out, rows)
    if load is not None:
        lines += [f"![expert load per run]({load})", ""]
    if len(lrs) > 1:
        lines += [f"![final loss by scheme and learning rate]({_plot_grid(out, rows, schemes, lrs)})", ""]
    grids = [(r["run"], _last_sample_grid(out / r["run"])) for r in rows]
    if any(g for _, g in grids):
        lines += ["## Samples", "", "The last evaluation's class-conditional samples of each run "
                  "(one row per class).", ""]
        lines += [f"**{name}** ({grid.stem.replace('_', ' ')})\n\n![{name} samples]"
                  f"({grid.relative_to(out).as_posix()})\n" for name, grid in grids if grid]
    lines += diagnostics_section(out, rows)
    write_text(out / "report.md", "\n".join(lines))
