"""How every plot of the package looks: one colour per scheme, one line style per learning rate,
legends outside the data, integer ticks on index axes, markers on short lines."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from ..rundir import save_figure

# Fixed colours of the registered schemes (stable across experiments); grey is kept for references.
_FIXED = {"pre": "#1f77b4", "post": "#d62728", "siamese": "#2ca02c", "hybridnorm": "#ff7f0e",
          "peri_ln": "#9467bd", "deepnorm": "#8c564b", "mix_ln": "#e377c2", "keel": "#bcbd22",
          "lns": "#17becf", "spannorm": "#393b79", "resi_dual": "#637939", "hyper": "#8c6d31",
          "mhc": "#843c39", "attn_res": "#7b4173"}
PALETTE = tuple(_FIXED.values()) + ("#6baed6", "#fd8d3c", "#74c476", "#9e9ac8", "#fdae6b")
REFERENCE = "0.35"            # unigram, chance, balanced: dark grey, never a scheme's colour
LR_STYLES = ("-", "--", ":", "-.", (0, (5, 1, 1, 1, 1, 1)), (0, (8, 2)), (0, (1, 3)))
FEW_POINTS = 10               # a line of at most this many points gets markers


def scheme_colours(schemes: Iterable[str]) -> dict[str, str]:
    """Scheme name -> colour: a registered scheme's own; other names (variants) the unused
    colours in order. Distinct within ``schemes`` up to ``len(PALETTE)`` names."""
    names = list(dict.fromkeys(schemes))
    out = {s: _FIXED[s] for s in names if s in _FIXED}
    free = [c for c in PALETTE if c not in out.values()]
    for i, s in enumerate(s for s in names if s not in out):
        out[s] = free[i % len(free)] if free else PALETTE[i % len(PALETTE)]
    return out


def lr_styles(lrs: Iterable[float]) -> dict[float, Any]:
    """Learning rate -> line style: solid for the smallest, then dashed, dotted, dash-dot ..."""
    return {lr: LR_STYLES[i % len(LR_STYLES)] for i, lr in enumerate(sorted(set(lrs)))}


def marker(n: int) -> str | None:
    """``"o"`` for a line of few points (where each is a measurement worth seeing), else none."""
    return "o" if n <= FEW_POINTS else None


def integer_ticks(ax, axis: str = "x") -> None:
    """Whole-number ticks only on ``axis`` (block and sublayer indices)."""
    from matplotlib.ticker import MaxNLocator

    locator = MaxNLocator(integer=True, steps=[1, 2, 5, 10])   # 0, 20, 40 rather than 0, 15, 30
    (ax.xaxis if axis == "x" else ax.yaxis).set_major_locator(locator)


def key_handles(colours: dict[str, str], styles: dict[float, Any]) -> list:
    """Legend entries that say what colour and style mean: one per scheme, then one per learning
    rate when there are several."""
    from matplotlib.lines import Line2D

    out = [Line2D([], [], color=c, lw=2, label=s) for s, c in colours.items()]
    if len(styles) > 1:
        out += [Line2D([], [], color="black", lw=1.2, ls=st, label=f"lr {lr:g}")
                for lr, st in styles.items()]
    return out


def seed_handles(centre: str, band: bool = False) -> list:
    """Legend entries for a cell's seeds as :func:`seed_lines` draws them: the thick ``centre``
    line, then the shaded band (``band``) or each seed's thin line."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    return [Line2D([], [], color="black", lw=2, label=f"{centre} over seeds"),
            Patch(color="black", alpha=0.15, lw=0, label="minimum to maximum") if band else
            Line2D([], [], color="black", lw=0.8, alpha=0.4, label="each seed")]


def legend_outside(ax, handles: Sequence | None = None, **options: Any):
    """The legend of ``ax`` right of its axes (never over the data); ``None`` without entries."""
    if handles is None:
        handles = ax.get_legend_handles_labels()[0]
    if not handles:
        return None
    kw = {"loc": "upper left", "bbox_to_anchor": (1.02, 1.0), "borderaxespad": 0.0, "fontsize": 8,
          "frameon": False, **options}
    return ax.legend(handles=list(handles), **kw)


def seed_lines(ax, curves: Sequence[Sequence[tuple[float, float]]], colour: str, dash: Any,
               mark: str | None = None, centre: str = "median", band: bool = False,
               gid: str | None = None) -> None:
    """The seeds of one cell in its colour and style: one curve alone as a line; several as a thick
    line through their ``centre`` (``mean`` or ``median``) where all have a point, and each seed thin
    and transparent (``band``: a shaded band from their minimum to maximum instead). ``gid`` names the
    cell on every line drawn (tests read it back)."""
    import math
    import statistics

    curves = [[(x, y) for x, y in c if y is not None and math.isfinite(y)] for c in curves]
    curves = [c for c in curves if c]
    if not curves:
        return
    if len(curves) == 1:
        xs, ys = zip(*curves[0])
        ax.plot(xs, ys, ls=dash, color=colour, lw=1.6, marker=mark or marker(len(xs)), ms=3.5, gid=gid)
        return
    common = sorted(set.intersection(*({x for x, _ in c} for c in curves)))
    at = [dict(c) for c in curves]
    if band and common:
        ax.fill_between(common, [min(a[x] for a in at) for x in common],
                        [max(a[x] for a in at) for x in common], color=colour, alpha=0.15, lw=0)
    for c in () if band else curves:
        ax.plot(*zip(*c), ls=dash, color=colour, lw=0.8, alpha=0.4, gid=gid)
    if common:
        average = statistics.median if centre == "median" else statistics.fmean
        ax.plot(common, [average([a[x] for a in at]) for x in common], ls=dash, color=colour, lw=2,
                marker=mark or marker(len(common)), ms=3.5, gid=gid)


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plain_log_labels(fig) -> None:
    """Log axes of ``fig`` labelled ``0.3, 1, 6`` rather than ``3x10^-1, 10^0, 6x10^0``."""
    from matplotlib.ticker import LogFormatter

    class Plain(LogFormatter):
        def _num_to_string(self, x: float, vmin: float, vmax: float) -> str:
            return f"{x:g}"

    for ax in fig.axes:
        for axis, scale in ((ax.xaxis, ax.get_xscale()), (ax.yaxis, ax.get_yscale())):
            if scale == "log":
                axis.set_major_formatter(Plain())
                axis.set_minor_formatter(Plain(minor_thresholds=(1, 0.4)))


def save(fig, path: Path, dpi: int = 110) -> str:
    """Write ``fig`` to ``path`` cropped to what it draws (legends outside included) and close it."""
    plain_log_labels(fig)
    fig.tight_layout()
    save_figure(fig, path, dpi=dpi, bbox_inches="tight")   # never through a link planted under its name
    pyplot().close(fig)
    return path.name
