"""Seeds of a comparison, summed up honestly: means, 95% intervals, paired differences, verdicts."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass

from ..tasks.spec import LOSSES, Metric

# t_{0.975, df}: Student's t quantile with 97.5% below it, for df = 1 .. 30 (4 decimals).
T975 = (12.7062, 4.3027, 3.1824, 2.7764, 2.5706, 2.4469, 2.3646, 2.3060, 2.2622, 2.2281,
        2.2010, 2.1788, 2.1604, 2.1448, 2.1314, 2.1199, 2.1098, 2.1009, 2.0930, 2.0860,
        2.0796, 2.0739, 2.0687, 2.0639, 2.0595, 2.0555, 2.0518, 2.0484, 2.0452, 2.0423)
Z975 = 1.959963984540054     # the standard normal's 97.5% quantile: the limit as df grows

# A final validation loss at or above (1 - PLATEAU_MARGIN) x the unigram loss is at the plateau.
PLATEAU_MARGIN = 0.02


def t975(df: int) -> float:
    """Student's ``t_{0.975, df}``: the table up to 30, then Cornish-Fisher (off by under 1e-7)."""
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
    """Mean, sample sd and 95% interval of ``n`` values (``None`` where there are too few)."""

    n: int
    mean: float | None
    sd: float | None
    ci_low: float | None
    ci_high: float | None

    @property
    def half_width(self) -> float | None:
        return None if self.ci_low is None else (self.ci_high - self.ci_low) / 2

    def excludes_zero(self) -> bool:
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
    return bool(row.get("diverged") or row.get("stalled") or row.get("failed")
                or row.get("stalled_at") is not None)


def at_plateau(row: dict) -> bool | None:
    """Whether a run ended at the unigram plateau (final loss at or above ``1 - PLATEAU_MARGIN`` times the
    unigram loss); ``None`` when that cannot be told (no unigram or final loss, a failed run)."""
    unigram, final = _value(row, "unigram_val_loss"), _value(row, "final_val_loss")
    if unigram is None or final is None or failed(row):
        return None
    return final >= (1.0 - PLATEAU_MARGIN) * unigram


def _value(row: dict, key: str) -> float | None:
    v = row.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) \
        else None


def metrics_present(rows: list[dict], metrics: Iterable[Metric]) -> list[Metric]:
    """Of the declared ``metrics``, those to sum up: the losses, and the others some row has a number for."""
    return [m for m in metrics if m.key in LOSSES or any(_value(r, m.key) is not None for r in rows)]


def cells(rows: list[dict]) -> dict[tuple[str, float], list[dict]]:
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


def paired_differences(rows: list[dict], metrics: Sequence[Metric], baseline: str) -> list[dict]:
    """Per scheme other than ``baseline``, learning rate and metric: scheme minus baseline over the seeds
    both ran without failing, its interval, and ``verdict`` (:func:`verdict`)."""
    by_cell = cells(rows)
    out = []
    for (scheme, lr), group in by_cell.items():
        if scheme == baseline:
            continue
        base = {r["seed"]: r for r in by_cell.get((baseline, lr), []) if not failed(r)}
        mine = {r["seed"]: r for r in group if not failed(r)}
        for metric in metrics:
            key = metric.key
            pairs = [(s, a, b) for s in mine if s in base
                     and (a := _value(mine[s], key)) is not None
                     and (b := _value(base[s], key)) is not None]
            est = estimate(a - b for _, a, b in pairs)
            out.append({"scheme": scheme, "baseline": baseline, "lr": lr, "metric": key,
                        "better": metric.better, "seeds": [s for s, _, _ in pairs], **asdict(est),
                        "verdict": verdict(est, metric)})
    return out


def verdict(diff: Estimate, metric: Metric) -> str | None:
    """``better`` or ``worse`` (by ``metric``'s direction) when the interval of the paired differences
    excludes zero, ``indistinguishable`` when it holds it, ``None`` under two pairs."""
    if diff.n < 2:
        return None
    if not diff.excludes_zero():
        return "indistinguishable"
    return "better" if (diff.mean > 0) == metric.higher_is_better else "worse"


# How the printed table words each verdict.
VERDICT_WORDS = {"better": "better", "worse": "worse", "indistinguishable": "no difference"}


def difference_text(diff: dict) -> str:
    """A paired difference in a table cell: ``-0.480+-0.132 better``, ``+0.004+-0.053 no difference``,
    ``-0.500 (1 seed)``, or ``-`` when no seed paired."""
    if diff["n"] == 0:
        return "-"
    if diff["ci_low"] is None:
        return f"{diff['mean']:+.3f} (1 seed)"
    half, d = (diff["ci_high"] - diff["ci_low"]) / 2, _decimals(diff)
    return f"{diff['mean']:+.{d}f}+-{half:.{d}f} {VERDICT_WORDS[diff['verdict']]}"


def _decimals(diff: dict) -> int:
    """3, or as many as show two digits of a narrower interval's half-width (0.000097+-0.000040)."""
    half = 0.0 if diff["ci_low"] is None else (diff["ci_high"] - diff["ci_low"]) / 2
    return 3 if not 0 < half < 0.01 else min(12, 1 - math.floor(math.log10(half)))


def verdict_sentence(diff: dict, title: str | None = None) -> str:
    """One sentence for an entry of :func:`paired_differences`; ``title`` names the metric first."""
    scheme, base, lr, n = diff["scheme"], diff["baseline"], format(diff["lr"], "g"), diff["n"]
    head = f"{title}: " if title else ""
    if n == 0:
        return (f"{head}{scheme} vs {base} at lr {lr}: no seed where both ran without diverging "
                "or stalling: no verdict")
    if n == 1:
        return f"{head}{scheme} vs {base} at lr {lr}: one seed: no verdict (difference {diff['mean']:+.3f})"
    lo, hi, d = diff["ci_low"], diff["ci_high"], _decimals(diff)
    if diff["verdict"] == "indistinguishable":
        return (f"{head}{scheme} vs {base} at lr {lr}: not distinguishable from seed noise "
                f"(difference {diff['mean']:+.{d}f}, 95% CI {lo:.{d}f} to {hi:.{d}f}, {n} seeds)")
    word, lo, hi = ("higher", lo, hi) if diff["mean"] > 0 else ("lower", -hi, -lo)
    return (f"{head}{scheme} is {word} than {base} by {abs(diff['mean']):.{d}f} (95% CI {lo:.{d}f} "
            f"to {hi:.{d}f}, {n} seeds) at lr {lr}: {diff['verdict']}")


def failures_text(cell: dict) -> str:
    """``1 of 3 diverged``, ``1 of 3 stalled``, both or ``none of 3``; then those at the unigram plateau."""
    parts = [f"{cell[k]} of {cell['runs']} {k}" for k in ("diverged", "stalled") if cell[k]]
    text = ", ".join(parts) if parts else f"none of {cell['runs']}"
    if cell.get("plateau"):
        text += f"; {cell['plateau']} of {cell['runs']} at the unigram plateau"
    return text
