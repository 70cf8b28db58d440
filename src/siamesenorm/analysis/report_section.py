"""The diagnostics section of a comparison's ``report.md``, from each run's ``metrics.jsonl``,
``probes.jsonl`` and ``analysis.json`` (preferred over the probes)."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

from ..rundir import RunDir
from ..shapes import ANALYSIS, METRICS_ROW, PROBE_ROW, mismatch, read_rows
from . import style

SPIKE_FACTOR = 5.0   # a gradient norm above this multiple of the run's median after warm-up is a spike


def _analysis(path: Path) -> dict | None:
    """``analysis.json`` when it is readable and of its shape, else ``None``."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):      # ValueError: not UTF-8, not JSON
        return None
    return data if mismatch(data, ANALYSIS) is None else None


def _warmup(run_dir: RunDir) -> int:
    train = run_dir.read_config().get("train")
    try:
        return int(train.get("warmup", 0)) if isinstance(train, dict) else 0
    except (TypeError, ValueError):
        return 0


def collect(out: Path, rows: list[dict]) -> list[dict]:
    """Per run: its name, scheme label, RMS profile, gradient curve, warm-up and pruning numbers."""
    runs = []
    for row in rows:
        run_dir = RunDir(out / row["run"])
        analysis = _analysis(run_dir.analysis)
        probes = [p for p in read_rows(run_dir.probes, PROBE_ROW) if isinstance(p.get("rms"), dict)]
        rms, per = None, 2
        if isinstance(analysis, dict):
            rms, per = analysis["probes"]["rms"], analysis.get("sublayers_per_block", 2)
        elif probes:
            rms = probes[-1]["rms"]
        grads = [(r["step"], r["grad_norm"]) for r in read_rows(run_dir.metrics, METRICS_ROW)
                 if isinstance(r.get("grad_norm"), (int, float))]
        runs.append({"run": row["run"], "scheme": row.get("scheme"), "lr": row.get("lr"),
                     "seed": row.get("seed"), "rms": rms, "per": per,
                     "grads": grads, "warmup": _warmup(run_dir),
                     "pruning": analysis.get("pruning") if isinstance(analysis, dict) else None,
                     "analysis": analysis if isinstance(analysis, dict) else None})
    return runs


# ---- numbers ---------------------------------------------------------------------------------
def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def rms_growth(rms: dict[str, list[float]], per: int) -> dict[str, float]:
    """Per stream: RMS after the last block over that after the first (both finite, the first not 0)."""
    return {s: v[-1] / v[per] for s, v in rms.items()
            if len(v) > per and _finite(v[per]) and _finite(v[-1]) and v[per]}


def grad_stats(grads: list[tuple[int, float]], warmup: int) -> dict[str, Any] | None:
    """After warm-up: the peak gradient norm and its step, the median, and the spike count."""
    after = [(s, g) for s, g in grads if s > warmup] or grads
    if not after:
        return None
    step, peak = max(after, key=lambda sg: sg[1])
    median = statistics.median(g for _, g in after)
    spikes = sum(g > SPIKE_FACTOR * median for _, g in after)
    return {"peak": peak, "peak_step": step, "median": median, "spikes": spikes}


def rms_sentence(runs: list[dict]) -> str:
    growth = [(r["run"], s, g) for r in runs if r["rms"] for s, g in rms_growth(r["rms"], r["per"]).items()]
    if not growth:
        return "No run has a stream RMS profile."
    hi, lo = max(growth, key=lambda t: t[2]), min(growth, key=lambda t: t[2])
    if len(growth) == 1:
        return f"From the first block to the last, the hidden RMS of {hi[0]} ({hi[1]}) changes x{hi[2]:.3g}."
    return (f"From the first block to the last, the hidden RMS grows most in {hi[0]} (stream {hi[1]}, "
            f"x{hi[2]:.3g}) and least in {lo[0]} (stream {lo[1]}, x{lo[2]:.3g}).")


def grad_sentence(runs: list[dict]) -> str:
    stats = [(r["run"], grad_stats(r["grads"], r["warmup"])) for r in runs]
    stats = [(name, st) for name, st in stats if st is not None]
    if not stats:
        return "No run logged a gradient norm."
    hi = max(stats, key=lambda t: t[1]["peak"])
    lo = min(stats, key=lambda t: t[1]["peak"])
    spiky = [f"{name} ({st['spikes']})" for name, st in stats if st["spikes"]]
    spikes = (f"{len(spiky)} of {len(stats)} runs have steps above {SPIKE_FACTOR:g}x their median: "
              f"{', '.join(spiky)}" if spiky else f"no run has a step above {SPIKE_FACTOR:g}x its median")
    return (f"After warm-up the largest gradient norm is {hi[1]['peak']:.3g} ({hi[0]}, step "
            f"{hi[1]['peak_step']}) and the smallest peak {lo[1]['peak']:.3g} ({lo[0]}); {spikes}.")


def pruning_sentence(runs: list[dict]) -> str:
    cost = [(r["run"], r["pruning"]) for r in runs if r["pruning"] and r["pruning"]["per_block"]]
    if not cost:
        return "No run has a layer-pruning analysis."

    def mean(p: dict) -> float:
        return sum(p["per_block"]) / len(p["per_block"])

    def detail(p: dict) -> str:
        b = max(range(len(p["per_block"])), key=lambda i: p["per_block"][i])
        return (f"{mean(p):+.3g} on average, most at block {b}: {p['per_block'][b]:+.3g}; "
                f"effective depth {p['effective_depth']:.1f} of {len(p['per_block'])}")

    hi, lo = max(cost, key=lambda t: mean(t[1])), min(cost, key=lambda t: mean(t[1]))
    text = f"Skipping one block raises the validation loss most for {hi[0]} ({detail(hi[1])})"
    if len(cost) == 1:
        return text + "."
    return text + f" and least for {lo[0]} ({detail(lo[1])})."


# ---- plots -----------------------------------------------------------------------------------
# One panel per learning rate (shared axes), the scheme's colour and the learning rate's line style
# of every plot of the experiment (:mod:`.style`); the seeds of a cell share both: thin lines each,
# and a thick line through their median, so a 24-run grid stays readable.
_STREAM_MARKERS = ("o", "s", "^", "D", "v", "P")


class _Layout:
    def __init__(self, runs: list[dict], schemes: list[str] | None = None) -> None:
        self.lrs = sorted({r["lr"] for r in runs}, key=lambda v: (v is None, v or 0.0))
        self.schemes = list(dict.fromkeys([*(schemes or ()), *(r["scheme"] for r in runs)]))
        self.seeds = sorted({r["seed"] for r in runs}, key=lambda v: (v is None, v or 0))
        self.colours = style.scheme_colours(self.schemes)
        self.styles = style.lr_styles([lr for lr in self.lrs if lr is not None])

    def figure(self, title: str, xlabel: str, ylabel: str, **axes: Any):
        plt = style.pyplot()
        n = len(self.lrs)
        fig, panels = plt.subplots(1, n, figsize=(max(6.0, 4.0 * n), 4.2), sharex=True, sharey=True,
                                   squeeze=False)
        for lr, ax in zip(self.lrs, panels[0]):
            ax.set(xlabel=xlabel, **axes, title=title if n == 1 else "lr ?" if lr is None else f"lr {lr:g}")
            ax.grid(alpha=0.3)
        if n > 1:
            fig.suptitle(title)
        panels[0][0].set_ylabel(ylabel)
        return fig, dict(zip(self.lrs, panels[0]))

    def color(self, r: dict) -> str:
        return self.colours[r["scheme"]]

    def style(self, r: dict) -> Any:
        return self.styles.get(r["lr"], "-")

    def cells(self, runs: list[dict]) -> dict[tuple, list[dict]]:
        """The runs by (scheme, lr), in the experiment's scheme order."""
        out: dict[tuple, list[dict]] = {}
        for r in sorted(runs, key=lambda r: self.schemes.index(r["scheme"])):
            out.setdefault((r["scheme"], r["lr"]), []).append(r)
        return out

    def legend(self, panels: dict, drawn: set, extra: list | None = None) -> None:
        """One legend, right of the last panel: colours are the ``drawn`` schemes, styles learning
        rates."""
        used = {s: c for s, c in self.colours.items() if s in drawn}
        handles = style.key_handles(used, self.styles) + list(extra or [])
        if len(self.seeds) > 1:
            handles += style.seed_handles("median")
        style.legend_outside(list(panels.values())[-1], handles)


def _gid(scheme: str, lr: float | None) -> str:
    return f"{scheme} lr {lr:g}" if lr is not None else str(scheme)


def _plot_rms(out: Path, runs: list[dict], schemes: list[str] | None = None) -> str:
    return style.save(rms_figure(runs, schemes), out / "diag_hidden_rms.png")


def rms_figure(runs: list[dict], schemes: list[str] | None = None):
    """Hidden-state RMS against depth per learning rate; streams by marker."""
    from matplotlib.lines import Line2D

    layout = _Layout(runs, schemes)
    fig, panels = layout.figure("Hidden-state RMS vs depth", "depth (blocks)", "hidden-state RMS",
                                yscale="log")
    streams = list(dict.fromkeys(s for r in runs if r["rms"] for s in r["rms"]))
    for (scheme, lr), group in layout.cells(runs).items():
        for stream in streams:
            curves = [[(k / r["per"], v) for k, v in enumerate(r["rms"][stream]) if _finite(v)]
                      for r in group if r["rms"] and stream in r["rms"]]
            style.seed_lines(panels[lr], curves, layout.color(group[0]), layout.style(group[0]),
                             _STREAM_MARKERS[streams.index(stream) % len(_STREAM_MARKERS)],
                             gid=_gid(scheme, lr))
    for ax in panels.values():
        style.integer_ticks(ax)
    extra = [Line2D([], [], color="black", ls="", marker=_STREAM_MARKERS[i % len(_STREAM_MARKERS)],
                    ms=4, label=f"stream {s}") for i, s in enumerate(streams)] if len(streams) > 1 else []
    layout.legend(panels, {r["scheme"] for r in runs if r["rms"]}, extra)
    return fig


def _plot_grads(out: Path, runs: list[dict], schemes: list[str] | None = None) -> str:
    return style.save(grads_figure(runs, schemes), out / "diag_grad_norm.png")


def grads_figure(runs: list[dict], schemes: list[str] | None = None):
    """Gradient norm against step per learning rate."""
    layout = _Layout(runs, schemes)
    fig, panels = layout.figure("Gradient norm during training", "step",
                                "gradient norm (before clipping)", yscale="log")
    for ax in panels.values():
        style.integer_ticks(ax)
    for (scheme, lr), group in layout.cells(runs).items():
        style.seed_lines(panels[lr], [r["grads"] for r in group], layout.color(group[0]),
                         layout.style(group[0]), gid=_gid(scheme, lr))
    layout.legend(panels, {r["scheme"] for r in runs if r["grads"]})
    return fig


def _plot_pruning(out: Path, runs: list[dict], schemes: list[str] | None = None) -> str:
    return style.save(pruning_figure(runs, schemes), out / "diag_pruning.png")


def pruning_figure(runs: list[dict], schemes: list[str] | None = None):
    """Validation loss increase when one block is skipped, per learning rate."""
    layout = _Layout(runs, schemes)
    fig, panels = layout.figure("Layer pruning sensitivity", "block skipped", "validation loss increase")
    for (scheme, lr), group in layout.cells(runs).items():
        style.seed_lines(panels[lr], [list(enumerate(r["pruning"]["per_block"])) for r in group
                                      if r["pruning"]], layout.color(group[0]), layout.style(group[0]),
                         gid=_gid(scheme, lr))
    for ax in panels.values():
        ax.axhline(0.0, color="gray", lw=0.8)
        style.integer_ticks(ax)
    layout.legend(panels, {r["scheme"] for r in runs if r["pruning"]})
    return fig


def _table(runs: list[dict]) -> list[str]:
    lines = ["| run | hidden RMS growth (last / first block) | peak grad norm after warm-up (spikes) | "
             "pruning: mean loss increase (effective depth) | logit lens agreement | followed where "
             "streams disagree | single-norm gains |", "|---|---|---|---|---|---|---|"]
    for r in runs:
        growth = ", ".join(f"{s} x{g:.3g}" for s, g in rms_growth(r["rms"], r["per"]).items()) \
            if r["rms"] else "-"
        st = grad_stats(r["grads"], r["warmup"])
        grad = f"{st['peak']:.3g} ({st['spikes']})" if st else "-"
        p, a = r["pruning"], r["analysis"]
        prune = f"{sum(p['per_block']) / len(p['per_block']):+.3g} ({p['effective_depth']:.1f})" \
            if p and p["per_block"] else "-"
        lens = a["lens"] if a else None
        agree = ", ".join(f"{s} {100 * v:.1f}%" for s, v in lens["agreement"].items()) if lens else "-"
        follows = ", ".join(f"{s} {100 * v:.1f}%" for s, v in lens["follows"].items() if v is not None) \
            if lens else ""
        gains = ", ".join(f"{k} {v:.3g}" for k, v in a["probes"]["gains"].items()
                          if isinstance(v, (int, float))) if a else "-"
        lines.append(f"| {r['run']} | {growth} | {grad} | {prune} | {agree} | {follows or '-'} | {gains} |")
    return lines


def diagnostics_section(out: Path, rows: list[dict], schemes: list[str] | None = None) -> list[str]:
    """Markdown lines of the diagnostics section of ``out/report.md``; writes its plots into ``out``
    (``schemes``: the experiment's order, which picks the colours)."""
    runs = collect(Path(out), rows)
    lines = ["## Diagnostics", ""]
    if any(r["rms"] for r in runs):
        lines += [rms_sentence(runs), "", f"![hidden RMS vs depth]({_plot_rms(out, runs, schemes)})", ""]
    else:
        lines += ["No stream RMS recorded: set `analysis.every=N` to record probes every N steps.", ""]
    lines += [grad_sentence(runs), "", f"![gradient norm]({_plot_grads(out, runs, schemes)})", ""]
    if any(r["pruning"] for r in runs):
        lines += [pruning_sentence(runs), "", f"![layer pruning]({_plot_pruning(out, runs, schemes)})", ""]
    else:
        lines += ["No layer-pruning analysis: run `siamesenorm analyze RUN_DIR`, or train with "
                  "`analysis.every=N` (and `analysis.at_end=true`).", ""]
    if any(r["rms"] or r["analysis"] for r in runs):
        lines += _table(runs) + [""]
    return lines
