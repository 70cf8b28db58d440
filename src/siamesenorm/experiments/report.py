"""``report.md`` and its PNG plots for a comparison."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..analysis.report_section import diagnostics_section
from ..rundir import RunDir, save_figure, write_text
from ..shapes import METRICS_ROW, read_rows
from ..tasks.spec import LOSSES, Metric, default_title
from . import stats


def _fmt(value, digits: int = 4) -> str:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _curve(run_dir: Path, key: str = "val_loss") -> tuple[list[int], list[float]]:
    """``(steps, values)`` of ``key`` over the evaluation rows of a run's metrics.jsonl."""
    steps, values = [], []
    for row in read_rows(RunDir(run_dir).metrics, METRICS_ROW):
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
        last = [r["expert_load"] for r in read_rows(RunDir(out / row["run"]).metrics, METRICS_ROW)
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
    save_figure(fig, out / "expert_load.png", dpi=120)
    plt.close(fig)
    return "expert_load.png"


def _plot_curves(out: Path, rows: list[dict], key: str, label: str, filename: str) -> str | None:
    """``key`` against step: a line per run, or with several seeds the mean per cell shaded from min to max
    and failed runs dashed; ``None`` when no run logged ``key``."""
    curves = {row["run"]: _curve(out / row["run"], key) for row in rows}
    if not any(steps for steps, _ in curves.values()):
        return None
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = stats.cells(rows)
    several = any(len(group) > 1 for group in groups.values())
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if not several:
        for name, (steps, values) in curves.items():
            if steps:
                ax.plot(steps, values, marker="o", ms=3, label=name)
        ax.set_title(f"{label[0].upper()}{label[1:]} per run")
    for (scheme, lr), group in groups.items() if several else ():
        kept = [curves[r["run"]] for r in group if not stats.failed(r) and curves[r["run"]][0]]
        if kept:   # the steps every kept seed evaluated (the same ones, for one configuration)
            steps = sorted(set.intersection(*(set(s) for s, _ in kept)))
            at = [[dict(zip(*curve))[step] for curve in kept] for step in steps]
            (line,) = ax.plot(steps, [sum(v) / len(v) for v in at], marker="o", ms=3,
                              label=f"{scheme} lr {lr:g} (mean of {len(kept)})")
            if len(kept) > 1:
                ax.fill_between(steps, [min(v) for v in at], [max(v) for v in at],
                                color=line.get_color(), alpha=0.2, lw=0)
        for r in group:
            if stats.failed(r) and curves[r["run"]][0]:
                ax.plot(*curves[r["run"]], ls="--", lw=0.8, marker="x", ms=4,
                        label=f"{r['run']} ({'diverged' if r.get('diverged') else 'stalled'})")
    if several:
        ax.set_title(f"{label[0].upper()}{label[1:]}: mean over seeds, shaded min to max",
                     fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(label)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, out / filename, dpi=120)
    plt.close(fig)
    return filename


def _last_sample_grid(run_dir: Path) -> Path | None:
    grids = RunDir(run_dir).sample_grids()
    return grids[-1] if grids else None


def _plot_grid(out: Path, aggregate: list[dict], schemes: list[str], lrs: list[float]) -> str:
    """Mean final validation loss per scheme and learning rate over the seeds that did not fail;
    a cell names how many of its seeds diverged or stalled, and is red when all did."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    grid = np.full((len(schemes), len(lrs)), np.nan)
    texts = [["-"] * len(lrs) for _ in schemes]
    lost = np.zeros_like(grid, dtype=bool)
    for cell in aggregate:
        i, j = schemes.index(cell["scheme"]), lrs.index(cell["lr"])
        est = cell["metrics"]["final_val_loss"]
        fails = cell["diverged"] + cell["stalled"]
        lost[i, j] = est["mean"] is None and fails > 0
        if est["mean"] is not None:
            grid[i, j] = est["mean"]
        if cell["runs"] == 1:
            texts[i][j] = "diverged" if cell["diverged"] else "stalled" if cell["stalled"] \
                else _fmt(est["mean"], 3)
        else:
            texts[i][j] = "\n".join([_fmt(est["mean"], 3)] + [
                f"{cell[k]}/{cell['runs']} {k}" for k in ("diverged", "stalled") if cell[k]])
    fig, ax = plt.subplots(figsize=(1.6 * len(lrs) + 2, 0.5 * len(schemes) + 1.5))
    im = ax.imshow(grid, cmap="viridis_r", aspect="auto")
    for i in range(len(schemes)):
        for j in range(len(lrs)):
            ax.text(j, i, texts[i][j], ha="center", va="center", fontsize=8,
                    color="red" if lost[i, j] else "black",
                    bbox={"facecolor": "white", "alpha": 0.7, "edgecolor": "none"})
    ax.set_xticks(range(len(lrs)), [f"{lr:g}" for lr in lrs])
    ax.set_yticks(range(len(schemes)), schemes)
    ax.set_xlabel("learning rate")
    ax.set_title("Final validation loss (mean over the seeds that did not fail)")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    save_figure(fig, out / "lr_grid.png", dpi=120)
    plt.close(fig)
    return "lr_grid.png"


def _title(key: str, titles: Mapping[str, str] | None) -> str:
    return (titles or {}).get(key) or default_title(key)


def _estimate_text(est: dict, digits: int = 4) -> str:
    """``mean ± half-width (n=k)``; ``mean (n=1, no interval)``; ``- (n=0)``."""
    if est["mean"] is None:
        return "- (n=0)"
    if est["ci_low"] is None:
        return f"{est['mean']:.{digits}f} (n={est['n']}, no interval)"
    half = (est["ci_high"] - est["ci_low"]) / 2
    return f"{est['mean']:.{digits}f} ± {half:.{digits}f} (n={est['n']})"


def seeds_section(aggregate: list[dict], differences: list[dict], baseline: str,
                  unigram: bool = False, titles: Mapping[str, str] | None = None) -> list[str]:
    """Markdown lines of the seeds summed up: the table per scheme and learning rate, and the verdicts
    against ``baseline`` for every figure; ``unigram``: the plateau is explained; ``titles``: each
    figure's name."""
    if all(cell["runs"] <= 1 for cell in aggregate):
        return ["One seed per scheme and learning rate: no confidence intervals and no verdicts "
                "(run several, e.g. `--seeds 0,1,2`). The runs are below.", ""]
    metrics = list(aggregate[0]["metrics"]) if aggregate else []
    head = ["scheme", "lr", "seeds", *(_title(k, titles) for k in metrics), "failed"]
    lines = ["## Over seeds", "",
             "Each figure is the mean over the seeds of a scheme and learning rate that did not "
             "diverge or stall, ± the half-width of its 95% confidence interval (Student t, n - 1 "
             "degrees of freedom); n is how many seeds the mean is over (one seed: no interval). "
             "Diverged and stalled seeds are counted, never averaged." + (
                 f" A seed whose final loss is at or above {1 - stats.PLATEAU_MARGIN:.0%} of the "
                 "unigram loss (what knowing only the token frequencies gives) is counted as at the "
                 "unigram plateau, and stays in the mean." if unigram else ""), "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for cell in aggregate:
        lines.append("| " + " | ".join([cell["scheme"], f"{cell['lr']:g}", str(cell["runs"]),
                                        *(_estimate_text(cell["metrics"][k]) for k in metrics),
                                        stats.failures_text(cell)]) + " |")
    lines += ["", f"### Compared with {baseline}", "",
              f"Each scheme minus {baseline}, seed by seed, over the seeds both ran without diverging "
              "or stalling; a difference is called only when its 95% interval (Student t on the "
              "paired differences) excludes zero.", ""]
    for key in metrics:
        diffs = [d for d in differences if d["metric"] == key]
        if diffs:
            better = diffs[0]["better"]
            lines += [f"{_title(key, titles)} ({better} is better):", ""]
            lines += [f"- {stats.verdict_sentence(d)}" for d in diffs] + [""]
    if not differences:
        lines += [f"No scheme besides {baseline}: nothing to compare.", ""]
    return lines


def write_report(out: Path, rows: list[dict], schemes: list[str], lrs: list[float], *,
                 aggregate: list[dict], differences: list[dict], baseline: str,
                 metrics: Sequence[Metric] = ()) -> None:
    """``out/report.md`` and its plots: ``aggregate`` and ``differences`` (from :mod:`.stats`) of the
    figures ``metrics`` summed up over seeds against ``baseline``, then every run of ``rows``."""
    titles = {m.key: m.title for m in metrics}
    keys = [m.key for m in metrics] or (list(aggregate[0]["metrics"]) if aggregate else list(LOSSES))
    extra = [(k, _title(k, titles)) for k in keys
             if k not in LOSSES and any(r.get(k) is not None for r in rows)]
    head = ["run", "scheme", "lr", "seed", "final val loss", "best val loss", *(t for _, t in extra),
            "diverged (step)", "max grad norm (step)", "tokens/s", "parameters"]
    unigram = any(r.get("unigram_val_loss") is not None for r in rows)
    lines = ["# Comparison", "", *seeds_section(aggregate, differences, baseline, unigram, titles),
             "## Runs", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
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
            if len(rows) > len(stats.cells(rows)):
                lines += [f"*{label[0].upper()}{label[1:]}: per scheme and learning rate, the mean "
                          "over the seeds that did not diverge or stall; the shaded band spans their "
                          "minimum to maximum; a failed run is dashed, on its own.*", ""]
    load = _plot_expert_load(out, rows)
    if load is not None:
        lines += [f"![expert load per run]({load})", ""]
    if len(lrs) > 1:
        lines += [f"![final loss by scheme and learning rate]({_plot_grid(out, aggregate, schemes, lrs)})",
                  ""]
    grids = [(r["run"], _last_sample_grid(out / r["run"])) for r in rows]
    if any(g for _, g in grids):
        lines += ["## Samples", "", "The last evaluation's class-conditional samples of each run "
                  "(one row per class).", ""]
        lines += [f"**{name}** ({grid.stem.replace('_', ' ')})\n\n![{name} samples]"
                  f"({grid.relative_to(out).as_posix()})\n" for name, grid in grids if grid]
    lines += diagnostics_section(out, rows)
    write_text(out / "report.md", "\n".join(lines))
