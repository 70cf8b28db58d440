"""Seeds of a comparison, summed up honestly: means, 95% intervals, paired differences, verdicts."""

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


def metrics_present(rows: list[dict], columns: Iterable[str] = ()) -> list[str]:
    """The figures to sum up: both losses, then those of ``columns`` some row has a number for."""
    return list(LOSSES) + [k for k in columns if k not in LOSSES
                           and any(_value(r, k) is not None for r in rows)]


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


def paired_differences(rows: list[dict], metrics: list[str], baseline: str,
                       higher_is_better: Iterable[str] = ()) -> list[dict]:
    """Per scheme other than ``baseline``, learning rate and metric: scheme minus baseline over the seeds
    both ran without failing, its interval, and ``verdict``: ``better`` or ``worse`` when the interval
    excludes zero, ``indistinguishable`` when not, ``None`` under 2 pairs."""
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
    """One sentence for an entry of :func:`paired_differences`; ``title`` names the metric first."""
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
    """``1 of 3 diverged``, ``1 of 3 stalled``, both or ``none of 3``; then those at the unigram plateau."""
    parts = [f"{cell[k]} of {cell['runs']} {k}" for k in ("diverged", "stalled") if cell[k]]
    text = ", ".join(parts) if parts else f"none of {cell['runs']}"
    if cell.get("plateau"):
        text += f"; {cell['plateau']} of {cell['runs']} at the unigram plateau"
    return text
