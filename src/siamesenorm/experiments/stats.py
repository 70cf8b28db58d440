"""Seeds of a comparison, summed up honestly: means, 95% intervals, paired differences, verdicts.

Per cell (scheme, learning rate) and figure: ``n``, the mean, the sample sd (divisor ``n - 1``) and
the 95% interval ``mean +- t * sd / sqrt(n)`` (Student's t, ``n - 1`` degrees of freedom). Failed
runs (diverged, stalled) enter no mean and are counted per cell. A language-model run whose final
loss is not at least :data:`PLATEAU_MARGIN` (2%) below ``unigram_val_loss`` (at or above 0.98 x
it, however far above) is counted *at the plateau* and stays in the means. Each scheme is paired
seed by seed with the baseline, on the seeds where both ran: the mean difference (scheme minus
baseline) and its interval; a verdict only when the interval excludes zero (one pair: no
interval, no verdict). Lower is better except for a task's
``higher_is_better`` columns. Pure Python: t quantiles from a table for 1 to 30 degrees of freedom,
a Cornish-Fisher expansion beyond. The method, with examples: docs/reproduction.md, README.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass

# t_{0.975, df}: Student's t quantile with 97.5% below it, for df = 1 .. 30 (4 decimals).
T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
        2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
        2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)
Z975 = 1.959963984540054     # the standard normal's 97.5% quantile: the limit as df grows

# A final validation loss at or above (1 - PLATEAU_MARGIN) x the unigram loss is at the plateau.
PLATEAU_MARGIN = 0.02

# The figures every comparison has, both better lower; a task's columns follow them.
LOSSES = ("final_val_loss", "best_val_loss")


def t975(df: int) -> float:
    """Student's t quantile ``t_{0.975, df}`` (the 95% two-sided critical value).

    The table for ``df <= 30``; beyond, the Cornish-Fisher expansion of t in powers of ``1/df``
    around the normal quantile (four terms: off by under 1e-7 from df 30 on).
    """
    if df < 1:
        raise ValueError(f"t quantile needs at least 1 degree of freedom, got {df}")
    if df <= len(T975):
        return T975[df - 1]
    z, n = Z975, float(df)
    return (z + (z ** 3 + z) / (4 * n)
            + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * n ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * n ** 3)
            + (79 * z ** 9 + 776 * z ** 7 + 1482 * z ** 5 - 1920 * z ** 3 - 945 * z) / (92160 * n ** 4))


@dataclass(frozen=True)
class Estimate:
    """``n`` values summed up: their mean, sample standard deviation and the 95% interval of the
    mean. ``mean`` is ``None`` with no value; ``sd`` and the interval are ``None`` below 2 values."""

    n: int
    mean: float | None
    sd: float | None
    ci_low: float | None
    ci_high: float | None

    @property
    def half_width(self) -> float | None:
        """Half the interval's width (``None`` when there is no interval)."""
        return None if self.ci_low is None else (self.ci_high - self.ci_low) / 2

    def excludes_zero(self) -> bool:
        """Whether there is an interval and zero lies outside it."""
        return self.ci_low is not None and (self.ci_low > 0 or self.ci_high < 0)


def estimate(values: Iterable[float]) -> Estimate:
    """Mean, sample standard deviation (divisor ``n - 1``) and 95% t interval of ``values``."""
    xs = [float(v) for v in values]
    n = len(xs)
    if n == 0:
        return Estimate(0, None, None, None, None)
    mean = sum(xs) / n
    if n == 1:
        return Estimate(1, mean, None, None, None)
    sd = math.sqrt(sum((x - mean) ** 2 for x in xs) / (n - 1))
    half = t975(n - 1) * sd / math.sqrt(n)
    return Estimate(n, mean, sd, mean - half, mean + half)


def failed(row: dict) -> bool:
    """Whether a run diverged or stalled (a compare row, or a run's own summary)."""
    return bool(row.get("diverged") or row.get("stalled") or row.get("failed")
                or row.get("stalled_at") is not None)


def at_plateau(row: dict) -> bool | None:
    """Whether a run (a compare row or its summary) ended at the unigram plateau (see the module's
    docstring); ``None`` when that cannot be told: no unigram loss (not a language model, or a run
    from before it was recorded), no final loss, or a failed run."""
    unigram, final = _value(row, "unigram_val_loss"), _value(row, "final_val_loss")
    if unigram is None or final is None or failed(row):
        return None
    return final >= (1.0 - PLATEAU_MARGIN) * unigram


def _value(row: dict, key: str) -> float | None:
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) \
        else None


def metrics_present(rows: list[dict], columns: Iterable[str] = ()) -> list[str]:
    """The figures to sum up: both losses, then those of ``columns`` some row has a number for."""
    return list(LOSSES) + [k for k in columns if k not in LOSSES
                           and any(_value(r, k) is not None for r in rows)]


def cells(rows: list[dict]) -> dict[tuple[str, float], list[dict]]:
    """The rows of each (scheme, lr) cell, in the rows' order."""
    out: dict[tuple[str, float], list[dict]] = {}
    for r in rows:
        out.setdefault((r["scheme"], r["lr"]), []).append(r)
    return out


def aggregate(rows: list[dict], metrics: list[str]) -> list[dict]:
    """One entry per (scheme, lr) cell: its seeds, how many diverged and stalled, and an
    :class:`Estimate` (as a dict) of each of ``metrics`` over the seeds that did not fail."""
    out = []
    for (scheme, lr), group in cells(rows).items():
        ok = [r for r in group if not failed(r)]
        out.append({
            "scheme": scheme, "lr": lr, "seeds": [r["seed"] for r in group], "runs": len(group),
            "diverged": sum(bool(r.get("diverged")) for r in group),
            "stalled": sum(not r.get("diverged") and failed(r) for r in group),
            "plateau": sum(bool(at_plateau(r)) for r in group),
            "metrics": {k: asdict(estimate(v for r in ok if (v := _value(r, k)) is not None))
                        for k in metrics},
        })
    return out


def paired_differences(rows: list[dict], metrics: list[str], baseline: str,
                       higher_is_better: Iterable[str] = ()) -> list[dict]:
    """Per scheme other than ``baseline``, learning rate and metric: the mean of ``scheme minus
    baseline`` over the seeds both ran without failing, its interval and the verdict.

    ``verdict`` is ``"better"`` or ``"worse"`` (by the metric's direction: lower is better unless
    it is in ``higher_is_better``) when the interval excludes zero, ``"indistinguishable"`` when it
    does not, and ``None`` with fewer than 2 pairs (no interval).
    """
    higher = set(higher_is_better)
    by_cell = cells(rows)
    out = []
    for (scheme, lr), group in by_cell.items():
        if scheme == baseline:
            continue
        base = {r["seed"]: r for r in by_cell.get((baseline, lr), []) if not failed(r)}
        mine = {r["seed"]: r for r in group if not failed(r)}
        for key in metrics:
            pairs = [(s, a, b) for s in mine if s in base
                     and (a := _value(mine[s], key)) is not None
                     and (b := _value(base[s], key)) is not None]
            est = estimate(a - b for _, a, b in pairs)
            better = "higher" if key in higher else "lower"
            if est.n < 2:
                verdict = None
            elif not est.excludes_zero():
                verdict = "indistinguishable"
            else:
                verdict = "better" if (est.mean > 0) == (better == "higher") else "worse"
            out.append({"scheme": scheme, "baseline": baseline, "lr": lr, "metric": key,
                        "better": better, "seeds": [s for s, _, _ in pairs], **asdict(est),
                        "verdict": verdict})
    return out


def _num(x: float) -> str:
    return f"{x:.3f}"


def verdict_sentence(diff: dict, title: str | None = None) -> str:
    """One sentence for a paired difference (an entry of :func:`paired_differences`).

    "siamese is lower than pre by 0.083 (95% CI 0.041 to 0.125, 3 seeds) at lr 0.01: better";
    "post vs pre at lr 0.01: not distinguishable from seed noise (difference +0.012, 95% CI -0.030
    to 0.054, 3 seeds)"; "... one seed: no verdict (...)". ``title`` names the metric first.
    """
    scheme, base, lr, n = diff["scheme"], diff["baseline"], format(diff["lr"], "g"), diff["n"]
    head = f"{title}: " if title else ""
    if n == 0:
        return (f"{head}{scheme} vs {base} at lr {lr}: no seed where both ran without diverging "
                "or stalling: no verdict")
    if n == 1:
        return f"{head}{scheme} vs {base} at lr {lr}: one seed: no verdict (difference {diff['mean']:+.3f})"
    lo, hi = diff["ci_low"], diff["ci_high"]
    if diff["verdict"] == "indistinguishable":
        return (f"{head}{scheme} vs {base} at lr {lr}: not distinguishable from seed noise "
                f"(difference {diff['mean']:+.3f}, 95% CI {_num(lo)} to {_num(hi)}, {n} seeds)")
    word, lo, hi = ("higher", lo, hi) if diff["mean"] > 0 else ("lower", -hi, -lo)
    return (f"{head}{scheme} is {word} than {base} by {_num(abs(diff['mean']))} (95% CI {_num(lo)} "
            f"to {_num(hi)}, {n} seeds) at lr {lr}: {diff['verdict']}")


def failures_text(cell: dict) -> str:
    """``"1 of 3 diverged"``, ``"1 of 3 stalled"``, both, or ``"none of 3"``; then, when some
    ended there, ``"2 of 3 at the unigram plateau"``."""
    parts = [f"{cell[k]} of {cell['runs']} {k}" for k in ("diverged", "stalled") if cell[k]]
    text = ", ".join(parts) if parts else f"none of {cell['runs']}"
    if cell.get("plateau"):
        text += f"; {cell['plateau']} of {cell['runs']} at the unigram plateau"
    return text
