"""``report.md`` and its PNG plots for a comparison."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..analysis import style
from ..analysis.report_section import diagnostics_section
from ..rundir import RunDir, write_text
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
# Accuracies whose chance level is 1 / classes (the classes from the runs' config.yaml).
_CHANCE = ("val_acc", "sample_acc")
# A best validation loss this much (relative) below the final one is shown beside it in the table.
BEST_MARGIN = 0.01


def _shared(values) -> object | None:
    """The one value all of ``values`` agree on (``None`` ignored), else ``None``."""
    distinct = {v for v in values if v is not None}
    return distinct.pop() if len(distinct) == 1 else None


def _axis_label(out: Path, rows: list[dict], key: str, label: str) -> str:
    """``label`` with its unit: a cross-entropy loss (``lm``, ``vit``) is in nats."""
    if key != "val_loss":
        return label
    task = _shared(RunDir(out / r["run"]).read_config().get("task", "lm") for r in rows)
    return f"{label} (nats)" if task in ("lm", "vit") else f"{label} (the training objective)"


def _chance(out: Path, rows: list[dict], key: str) -> float | None:
    """1 / classes for an accuracy over classes when every run names the same class count."""
    if key not in _CHANCE:
        return None
    model = (RunDir(out / r["run"]).read_config().get("model") for r in rows)
    k = _shared(m.get("num_classes") for m in model if isinstance(m, dict))
    return 1.0 / k if isinstance(k, int) and k > 1 else None


def _cap(text: str) -> str:
    return text[:1].upper() + text[1:]


def _plot_expert_load(out: Path, rows: list[dict], schemes: list[str] | None = None) -> str | None:
    """Each expert's share of the token-expert assignments at each run's last evaluation (mean
    over its MoE layers), one line per scheme and learning rate; ``None`` without MoE layers."""
    fig = expert_load_figure(out, rows, schemes)
    return None if fig is None else style.save(fig, out / "expert_load.png", dpi=120)


def expert_load_figure(out: Path, rows: list[dict], schemes: list[str] | None = None):
    """The figure of :func:`_plot_expert_load` (``None`` without MoE layers)."""
    loads = {}
    for row in rows:
        last = [r["expert_load"] for r in read_rows(RunDir(out / row["run"]).metrics, METRICS_ROW)
                if isinstance(r.get("expert_load"), list) and r["expert_load"]]
        if last:
            layers = last[-1]
            loads[row["run"]] = [sum(col) / len(layers) for col in zip(*layers)]
    if not loads:
        return None
    plt = style.pyplot()
    colours, styles = _keys(rows, schemes)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for (scheme, lr), group in stats.cells(rows).items():
        style.seed_lines(ax, [list(enumerate(loads[r["run"]])) for r in group if r["run"] in loads],
                         colours[scheme], styles[lr], centre="mean", gid=f"{scheme} lr {lr:g}")
    n = len(next(iter(loads.values())))
    ax.axhline(1 / n, color=style.REFERENCE, lw=1, label=f"balanced (1/{n})")
    ax.set(xlabel="expert", ylabel="share of assignments (mean over layers)",
           title="Expert load at the last evaluation")
    style.integer_ticks(ax)
    ax.grid(alpha=0.3)
    drawn = {r["scheme"] for r in rows if r["run"] in loads}
    style.legend_outside(ax, style.key_handles({s: c for s, c in colours.items() if s in drawn},
                                               styles) + ax.get_legend_handles_labels()[0]
                         + _seed_handles(rows, "mean"))
    return fig


def _keys(rows: list[dict], schemes: list[str] | None) -> tuple[dict, dict]:
    """The experiment's colour per scheme and line style per learning rate."""
    return (style.scheme_colours([*(schemes or ()), *(r["scheme"] for r in rows)]),
            style.lr_styles(r["lr"] for r in rows))


def _seed_handles(rows: list[dict], centre: str, band: bool = False) -> list:
    """:func:`style.seed_handles` where some cell has several seeds."""
    several = any(len(g) > 1 for g in stats.cells(rows).values())
    return style.seed_handles(centre, band) if several else []


def _plot_curves(out: Path, rows: list[dict], key: str, label: str, filename: str,
                 schemes: list[str] | None = None) -> str | None:
    """Write :func:`curves_figure` to ``out/filename``; ``None`` when no run logged ``key``."""
    fig = curves_figure(out, rows, key, label, schemes)
    return None if fig is None else style.save(fig, out / filename, dpi=120)


def curves_figure(out: Path, rows: list[dict], key: str, label: str, schemes: list[str] | None = None):
    """``key`` against step, the scheme's colour and the learning rate's line style: a line per
    cell (with several seeds, their mean over the seeds that did not fail, shaded from minimum to
    maximum); a failed run alone, thin, crossed at its end; the unigram loss or chance level as a
    grey line. ``None`` when no run logged ``key``."""
    from matplotlib.lines import Line2D

    curves = {row["run"]: _curve(out / row["run"], key) for row in rows}
    if not any(steps for steps, _ in curves.values()):
        return None
    plt = style.pyplot()
    colours, styles = _keys(rows, schemes)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    kept_values, failed_any, ends = [], False, []
    for (scheme, lr), group in stats.cells(rows).items():
        kept = [list(zip(*curves[r["run"]])) for r in group if not stats.failed(r)]
        style.seed_lines(ax, kept, colours[scheme], styles[lr], centre="mean", band=True,
                         gid=f"{scheme} lr {lr:g}")
        kept_values += [v for c in kept for _, v in c if math.isfinite(v)]
        for r in group:
            steps, values = curves[r["run"]]
            if stats.failed(r) and steps:
                failed_any = True
                ax.plot(steps, values, ls=styles[lr], color=colours[scheme], lw=0.8, alpha=0.6,
                        gid=f"{scheme} lr {lr:g} failed")
                ends.append((steps[-1], values[-1], colours[scheme]))
    references = []
    unigram = _shared(round(r["unigram_val_loss"], 4) for r in rows
                      if key == "val_loss" and r.get("unigram_val_loss") is not None)
    if unigram is not None:
        references.append((unigram, "unigram", f"unigram ({unigram:.3f} nats)"))
    chance = _chance(out, rows, key)
    if chance is not None:
        references.append((chance, "chance", f"chance (1/{round(1 / chance)})"))
    for y, name, text in references:
        ax.axhline(y, color=style.REFERENCE, lw=1.2, label=text, zorder=1)
        ax.annotate(name, (0.01, y), xycoords=("axes fraction", "data"), xytext=(0, 2),
                    textcoords="offset points", va="bottom", fontsize=8, color=style.REFERENCE)
    if failed_any and kept_values:       # a diverged run must not squash the others to a line
        lo, hi = min(kept_values + [y for y, _, _ in references]), \
            max(kept_values + [y for y, _, _ in references])
        pad = 0.08 * (hi - lo or abs(hi) or 1.0)
        ax.set_ylim(lo - pad, hi + pad)
    top = ax.get_ylim()[1]
    for step, value, colour in ends:      # where a failed run ended, on the top edge when above it
        ax.plot([step], [min(value, top) if math.isfinite(value) else top], ls="", marker="x", ms=7,
                mew=2, color=colour, clip_on=False)
    seeds = _seed_handles(rows, "mean", band=True)
    ax.set_title(f"{_cap(label)}: " + ("mean over seeds, shaded from minimum to maximum" if seeds
                                        else "one line per run"), fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(_axis_label(out, rows, key, label))
    style.integer_ticks(ax)
    ax.grid(alpha=0.3)
    drawn = {r["scheme"] for r in rows if curves[r["run"]][0]}
    handles = style.key_handles({s: c for s, c in colours.items() if s in drawn}, styles)
    handles += ax.get_legend_handles_labels()[0] + seeds
    if failed_any:
        handles.append(Line2D([], [], color="black", ls="", marker="x", ms=7, mew=2,
                              label="diverged or stalled (alone, not in the mean)"))
    style.legend_outside(ax, handles)
    return fig


def _last_sample_grid(run_dir: Path) -> Path | None:
    """The grid of the run's last evaluation (one row per class, labelled, tiles apart)."""
    grids = RunDir(run_dir).sample_grids()
    return grids[-1] if grids else None


def _plot_grid(out: Path, aggregate: list[dict], schemes: list[str], lrs: list[float]) -> str:
    """Write :func:`grid_figure` to ``out/lr_grid.png``."""
    return style.save(grid_figure(aggregate, schemes, lrs), out / "lr_grid.png", dpi=120)


FLAT_HATCH = "///"


def grid_figure(aggregate: list[dict], schemes: list[str], lrs: list[float]):
    """Mean final validation loss per scheme and learning rate over the seeds that did not fail; a
    cell names how many of its seeds diverged, stalled or ended flat (at the unigram plateau,
    :func:`stats.at_plateau`), and is hatched when every seed did one of these."""
    import numpy as np
    from matplotlib.patches import Patch, Rectangle

    plt = style.pyplot()
    grid = np.full((len(schemes), len(lrs)), np.nan)
    texts = [["-"] * len(lrs) for _ in schemes]
    dead = np.zeros_like(grid, dtype=bool)
    for cell in aggregate:
        i, j = schemes.index(cell["scheme"]), lrs.index(cell["lr"])
        est = cell["metrics"]["final_val_loss"]
        flat, runs = cell.get("plateau", 0), cell["runs"]
        dead[i, j] = cell["diverged"] + cell["stalled"] + flat >= runs > 0
        if est["mean"] is not None:
            grid[i, j] = est["mean"]
        if runs == 1:
            texts[i][j] = "diverged" if cell["diverged"] else "stalled" if cell["stalled"] \
                else _fmt(est["mean"], 3) + ("\nflat" if flat else "")
        else:
            texts[i][j] = "\n".join([_fmt(est["mean"], 3)] + [
                f"{n}/{runs} {word}" for n, word in ((cell["diverged"], "diverged"),
                                                     (cell["stalled"], "stalled"), (flat, "flat")) if n])
    fig, ax = plt.subplots(figsize=(1.7 * len(lrs) + 2.6, 0.62 * len(schemes) + 1.9))
    im = ax.imshow(grid, cmap="viridis_r", aspect="auto")
    for i in range(len(schemes)):
        for j in range(len(lrs)):
            if dead[i, j]:
                ax.add_patch(Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, hatch=FLAT_HATCH,
                                       edgecolor="0.3", lw=0))
            ax.text(j, i, texts[i][j], ha="center", va="center", fontsize=8,
                    color="#b00000" if dead[i, j] else "black",
                    bbox={"facecolor": "white", "alpha": 0.8, "edgecolor": "none", "pad": 1.5})
    ax.set_xticks(range(len(lrs)), [f"{lr:g}" for lr in lrs])
    ax.set_yticks(range(len(schemes)), schemes)
    for tick, colour in zip(ax.get_yticklabels(), style.scheme_colours(schemes).values()):
        tick.set_color(colour)
        tick.set_fontweight("bold")
    ax.set_xlabel("learning rate")
    ax.set_title("Final validation loss (mean over the seeds that did not fail)", fontsize=10)
    fig.colorbar(im, ax=ax, label="final validation loss")
    if dead.any():
        ax.legend(handles=[Patch(facecolor="white", edgecolor="0.3", hatch=FLAT_HATCH,
                                 label="every seed diverged, stalled or ended flat\n(final loss at or "
                                       f"above {1 - stats.PLATEAU_MARGIN:.0%} of the unigram loss)")],
                  loc="upper center", bbox_to_anchor=(0.5, -0.18), fontsize=8, frameon=False)
    return fig


def _final_text(row: dict) -> str:
    """The final validation loss, and the best in brackets where it is more than ``BEST_MARGIN``
    lower (a run that got worse after its best; otherwise the two all but repeat each other)."""
    final, best = row.get("final_val_loss"), row.get("best_val_loss")
    text = _fmt(final)
    if isinstance(final, (int, float)) and isinstance(best, (int, float)) and math.isfinite(final) \
            and math.isfinite(best) and best < final - BEST_MARGIN * abs(final):
        text += f" (best {best:.4f})"
    return text


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
    head = ["run", "scheme", "lr", "seed", "final val loss", *(t for _, t in extra),
            "diverged (step)", "max grad norm (step)", "tokens/s", "parameters"]
    unigram = any(r.get("unigram_val_loss") is not None for r in rows)
    lines = ["# Comparison", "", *seeds_section(aggregate, differences, baseline, unigram, titles),
             "## Runs", "",
             "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        div = f"yes ({r['diverged_at']})" if r["diverged"] else "no"
        peak = "-" if r.get("max_grad_norm") is None else \
            f"{r['max_grad_norm']:.3g} ({r['max_grad_norm_step']})"
        cells = [r["run"], r["scheme"], f"{r['lr']:g}", str(r["seed"]), _final_text(r),
                 *(_fmt(r.get(k)) for k, _ in extra), div, peak,
                 _fmt(r["tokens_per_s"], 0), f"{r['num_parameters']:,}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if any("(best" in _final_text(r) for r in rows):
        lines += [f"A final validation loss is followed by the best, in brackets, where the best is "
                  f"more than {BEST_MARGIN:.0%} lower (the run got worse after it); summary.json "
                  "has both for every run.", ""]
    for key, label, filename in CURVES:
        name = _plot_curves(out, rows, key, label, filename, schemes)
        if name is not None:
            lines += [f"![{label}]({name})", ""]
            if len(rows) > len(stats.cells(rows)):
                lines += [f"*{_cap(label)}: colour is the scheme, line style the learning rate; "
                          "each line is the mean over the seeds that did not diverge or stall, the "
                          "shaded band spans their minimum to maximum; a failed run is drawn alone, "
                          "thin, and crossed where it ended.*", ""]
    load = _plot_expert_load(out, rows, schemes)
    if load is not None:
        lines += [f"![expert load per run]({load})", ""]
    if len(lrs) > 1:
        lines += [f"![final loss by scheme and learning rate]({_plot_grid(out, aggregate, schemes, lrs)})",
                  "", "*Each cell names how many of its seeds diverged, stalled or ended flat (at "
                  "the unigram plateau); a hatched cell had every seed do one of these: no learning "
                  "rate to read from it.*", ""]
    grids = [(r["run"], _last_sample_grid(out / r["run"])) for r in rows]
    if any(g for _, g in grids):
        lines += ["## Samples", "", "The last evaluation's class-conditional samples of each run "
                  "(one row per class, named at its left).", ""]
        lines += [f"**{name}** ({grid.stem.replace('_', ' ')})\n\n![{name} samples]"
                  f"({grid.relative_to(out).as_posix()})\n" for name, grid in grids if grid]
    lines += diagnostics_section(out, rows, schemes)
    write_text(out / "report.md", "\n".join(lines))
