"""The statistics of compare's seeds, against numbers worked out by hand.

Every expected number here was computed by hand from the fabricated figures, with the t quantiles
of a printed table (t_{0.975}: 12.706 at 1 degree of freedom, 4.303 at 2), not by the code under
test; the tolerances allow for those 3-decimal quantiles.
"""

from __future__ import annotations

import math

import pytest

from siamesenorm.experiments import stats
from siamesenorm.tasks.spec import Metric

FINAL = Metric("final_val_loss", "final val loss")
ACC = Metric("final_val_acc", "val top-1", higher_is_better=True)


def _row(scheme, lr, seed, loss, *, diverged=False, stalled=False, **extra):
    return {"run": f"{scheme}-lr{lr:g}-s{seed}", "scheme": scheme, "lr": lr, "seed": seed,
            "final_val_loss": loss, "best_val_loss": None if loss is None else loss - 0.5,
            "diverged": diverged, "diverged_at": 7 if diverged else None,
            "stalled_at": 5 if stalled else None, **extra}


# final validation loss of seeds 0, 1, 2; seed 1 of pre at lr 0.1 diverged (9.0 is its loss before
# it did: in no mean).
LOSSES = {(0.01, "pre"): [2.0, 2.2, 2.4], (0.01, "siamese"): [1.9, 2.05, 2.3],
          (0.01, "post"): [2.1, 2.0, 2.6],
          (0.1, "pre"): [2.5, 9.0, 2.7], (0.1, "siamese"): [2.3, 2.4, 2.45], (0.1, "post"): [3.1, 3.2, 3.3]}


@pytest.fixture
def rows():
    return [_row(s, lr, seed, v[seed], diverged=(lr == 0.1 and s == "pre" and seed == 1))
            for seed in range(3) for (lr, s), v in LOSSES.items()]


def _cell(agg, scheme, lr):
    [cell] = [c for c in agg if c["scheme"] == scheme and c["lr"] == lr]
    return cell


def _diff(diffs, scheme, lr, metric="final_val_loss"):
    [d] = [d for d in diffs if d["scheme"] == scheme and d["lr"] == lr and d["metric"] == metric]
    return d


# --- t quantiles ------------------------------------------------------------------------------

def _t_cdf_upper_half(t: float, df: int) -> float:
    """P(0 < T < t) for Student's t with ``df`` degrees of freedom, by Simpson's rule on its density
    (written here from the textbook formula, independently of the module)."""
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(df * math.pi)
    n = 20000
    h = t / n
    f = [c * (1 + (i * h) ** 2 / df) ** (-(df + 1) / 2) for i in range(n + 1)]
    return h / 3 * (f[0] + f[-1] + 4 * sum(f[1:-1:2]) + 2 * sum(f[2:-1:2]))


def _t_quantile(df: int) -> float:
    lo, hi = 0.0, 20.0
    for _ in range(40):   # bisection: P(0 < T < t) = 0.475
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _t_cdf_upper_half(mid, df) < 0.475 else (lo, mid)
    return (lo + hi) / 2


def test_t_quantiles_in_closed_form_and_from_printed_tables():
    assert stats.t975(1) == pytest.approx(math.tan(0.475 * math.pi), abs=1e-3)     # Cauchy: 12.706
    assert stats.t975(2) == pytest.approx(0.95 * math.sqrt(2 / (4 * 0.975 * 0.025)), abs=1e-3)  # 4.303
    for df, printed in ((3, 3.182), (5, 2.571), (10, 2.228), (30, 2.042),
                        (40, 2.021), (60, 2.000), (120, 1.980), (100000, 1.960)):
        assert stats.t975(df) == pytest.approx(printed, abs=1e-3), df
    with pytest.raises(ValueError):
        stats.t975(0)


@pytest.mark.parametrize("df", [1, 2, 4, 7, 13, 29, 30, 31, 45])
def test_t_quantiles_agree_with_the_integrated_density(df):
    assert stats.t975(df) == pytest.approx(_t_quantile(df), abs=1e-3)


def test_the_expansion_beyond_the_table_continues_it():
    # Across the seam the quantile keeps falling, by less each step.
    steps = [stats.t975(df) - stats.t975(df + 1) for df in range(27, 34)]
    assert all(s > 0 for s in steps) and steps == sorted(steps, reverse=True)


# --- one sample ---------------------------------------------------------------------------------

def test_estimate_mean_sample_sd_and_interval():
    est = stats.estimate([2.0, 2.2, 2.4])
    # mean 2.2; sd sqrt((0.04 + 0 + 0.04) / 2) = 0.2; half-width 4.303 * 0.2 / sqrt(3) = 0.4969
    assert est.n == 3 and est.mean == pytest.approx(2.2) and est.sd == pytest.approx(0.2)
    assert est.ci_low == pytest.approx(1.7031, abs=2e-4) and est.ci_high == pytest.approx(2.6969, abs=2e-4)
    assert est.half_width == pytest.approx(0.4969, abs=2e-4)
    two = stats.estimate([1.0, 3.0])   # sd with n - 1: sqrt(2), not 1; half 12.706 * sqrt(2) / sqrt(2)
    assert two.sd == pytest.approx(math.sqrt(2)) and two.ci_low == pytest.approx(2 - 12.706, abs=1e-3)


def test_one_value_has_no_interval_and_none_has_no_mean():
    one = stats.estimate([2.5])
    assert (one.n, one.mean, one.sd, one.ci_low, one.ci_high) == (1, 2.5, None, None, None)
    assert one.half_width is None and not one.excludes_zero()
    assert stats.estimate([]) == stats.Estimate(0, None, None, None, None)


# --- cells --------------------------------------------------------------------------------------

def test_aggregate_per_cell_by_hand(rows):
    agg = stats.aggregate(rows, ["final_val_loss", "best_val_loss"])
    assert len(agg) == 6
    pre = _cell(agg, "pre", 0.01)
    assert pre["seeds"] == [0, 1, 2] and pre["runs"] == 3 and pre["diverged"] == 0
    loss = pre["metrics"]["final_val_loss"]
    assert loss["n"] == 3 and loss["mean"] == pytest.approx(2.2) and loss["sd"] == pytest.approx(0.2)
    assert (loss["ci_low"], loss["ci_high"]) == pytest.approx((1.7031, 2.6969), abs=2e-4)
    best = pre["metrics"]["best_val_loss"]    # 1.5, 1.7, 1.9
    assert best["mean"] == pytest.approx(1.7) and best["sd"] == pytest.approx(0.2)
    post = _cell(agg, "post", 0.1)["metrics"]["final_val_loss"]   # 3.1, 3.2, 3.3: sd 0.1, half 0.2484
    assert (post["ci_low"], post["ci_high"]) == pytest.approx((2.9516, 3.4484), abs=2e-4)


def test_a_diverged_seed_is_counted_and_left_out_of_the_mean(rows):
    agg = stats.aggregate(rows, ["final_val_loss"])
    cell = _cell(agg, "pre", 0.1)
    assert cell["runs"] == 3 and cell["diverged"] == 1 and cell["stalled"] == 0
    assert stats.failures_text(cell) == "1 of 3 diverged"
    loss = cell["metrics"]["final_val_loss"]
    # over 2.5 and 2.7 only: mean 2.6, sd sqrt(0.02) = 0.14142, half 12.706 * 0.14142 / sqrt(2) = 1.2706
    assert loss["n"] == 2 and loss["mean"] == pytest.approx(2.6)
    assert loss["sd"] == pytest.approx(0.141421, abs=1e-6)
    assert (loss["ci_low"], loss["ci_high"]) == pytest.approx((1.3294, 3.8706), abs=1e-3)
    assert stats.failures_text(_cell(agg, "pre", 0.01)) == "none of 3"


def test_a_stalled_seed_is_counted_as_stalled():
    rows = [_row("pre", 0.01, 0, 2.0), _row("pre", 0.01, 1, 2.4, stalled=True), _row("pre", 0.01, 2, 2.2)]
    [cell] = stats.aggregate(rows, ["final_val_loss"])
    assert (cell["diverged"], cell["stalled"]) == (0, 1)
    assert stats.failures_text(cell) == "1 of 3 stalled"
    assert cell["metrics"]["final_val_loss"]["mean"] == pytest.approx(2.1)   # (2.0 + 2.2) / 2
    assert stats.failed({"failed": True}) and not stats.failed({"diverged": False, "stalled_at": None})


def test_metrics_present_takes_the_losses_and_the_task_columns_that_have_numbers():
    rows = [_row("pre", 0.01, 0, 2.0, final_val_acc=0.5, final_fd_proxy=None)]
    declared = [FINAL, Metric("best_val_loss", "best"), ACC, Metric("final_fd_proxy", "FD"),
                Metric("final_arith_acc", "arith", True)]
    assert [m.key for m in stats.metrics_present(rows, declared)] == [
        "final_val_loss", "best_val_loss", "final_val_acc"]


# --- paired differences and verdicts -----------------------------------------------------------

def test_paired_difference_that_excludes_zero_gets_a_verdict(rows):
    diffs = stats.paired_differences(rows, [FINAL], "pre")
    assert {d["scheme"] for d in diffs} == {"siamese", "post"}       # no pre-minus-pre
    d = _diff(diffs, "siamese", 0.01)
    # differences -0.1, -0.15, -0.1: mean -0.11667, sd 0.028868, half 4.303 * 0.028868 / sqrt(3) = 0.07172
    assert d["n"] == 3 and d["seeds"] == [0, 1, 2] and d["baseline"] == "pre"
    assert d["mean"] == pytest.approx(-0.116667, abs=1e-6) and d["sd"] == pytest.approx(0.028868, abs=1e-6)
    assert (d["ci_low"], d["ci_high"]) == pytest.approx((-0.18838, -0.04495), abs=1e-4)
    assert d["better"] == "lower" and d["verdict"] == "better"
    assert stats.verdict_sentence(d) == (
        "siamese is lower than pre by 0.117 (95% CI 0.045 to 0.188, 3 seeds) at lr 0.01: better")


def test_paired_difference_whose_interval_holds_zero_is_seed_noise(rows):
    diffs = stats.paired_differences(rows, [FINAL], "pre")
    d = _diff(diffs, "post", 0.01)
    # differences +0.1, -0.2, +0.2: mean 0.03333, sd 0.20817, half 4.303 * 0.20817 / sqrt(3) = 0.51716
    assert d["mean"] == pytest.approx(0.033333, abs=1e-6) and d["sd"] == pytest.approx(0.208167, abs=1e-6)
    assert (d["ci_low"], d["ci_high"]) == pytest.approx((-0.48382, 0.55049), abs=1e-4)
    assert d["verdict"] == "indistinguishable"
    text = stats.verdict_sentence(d)
    assert text == ("post vs pre at lr 0.01: not distinguishable from seed noise "
                    "(difference +0.033, 95% CI -0.484 to 0.550, 3 seeds)")
    assert " is lower than " not in text and " is higher than " not in text


def test_pairs_leave_out_the_seeds_where_either_run_diverged(rows):
    d = _diff(stats.paired_differences(rows, [FINAL], "pre"), "siamese", 0.1)
    # pre's seed 1 diverged: pairs of seeds 0 and 2, differences -0.2 and -0.25: mean -0.225,
    # sd 0.035355, half 12.706 * 0.035355 / sqrt(2) = 0.31765: -0.54265 to 0.09265, holds zero
    assert d["seeds"] == [0, 2] and d["n"] == 2 and d["mean"] == pytest.approx(-0.225)
    assert (d["ci_low"], d["ci_high"]) == pytest.approx((-0.54265, 0.09265), abs=1e-3)
    assert d["verdict"] == "indistinguishable"
    assert "2 seeds" in stats.verdict_sentence(d)


def test_one_seed_gives_no_interval_and_no_verdict():
    rows = [_row("pre", 0.01, 0, 2.0), _row("siamese", 0.01, 0, 1.5)]
    [d] = stats.paired_differences(rows, [FINAL], "pre")
    assert d["n"] == 1 and d["mean"] == pytest.approx(-0.5)
    assert d["ci_low"] is None and d["ci_high"] is None and d["sd"] is None and d["verdict"] is None
    text = stats.verdict_sentence(d)
    assert text == "siamese vs pre at lr 0.01: one seed: no verdict (difference -0.500)"
    rows[0]["diverged"] = True
    [d] = stats.paired_differences(rows, [FINAL], "pre")
    assert d["n"] == 0 and d["mean"] is None and d["verdict"] is None
    assert stats.verdict_sentence(d).endswith("no verdict")


def test_higher_accuracy_is_better_and_higher_loss_is_worse():
    acc = {"pre": [0.50, 0.52, 0.54], "siamese": [0.60, 0.61, 0.65]}
    loss = {"pre": [1.0, 1.1, 1.2], "siamese": [1.2, 1.3, 1.45]}
    rows = [_row(s, 0.001, seed, loss[s][seed], final_val_acc=acc[s][seed])
            for seed in range(3) for s in ("pre", "siamese")]
    diffs = stats.paired_differences(rows, [FINAL, ACC], "pre")
    a = _diff(diffs, "siamese", 0.001, "final_val_acc")
    # differences 0.10, 0.09, 0.11: mean 0.10, sd 0.01, half 4.303 * 0.01 / sqrt(3) = 0.02484
    assert a["better"] == "higher" and a["mean"] == pytest.approx(0.10)
    assert (a["ci_low"], a["ci_high"]) == pytest.approx((0.07516, 0.12484), abs=1e-4)
    assert a["verdict"] == "better"
    assert stats.verdict_sentence(a, "val top-1") == (
        "val top-1: siamese is higher than pre by 0.100 (95% CI 0.075 to 0.125, 3 seeds) at lr 0.001: better")
    w = _diff(diffs, "siamese", 0.001, "final_val_loss")
    # differences 0.2, 0.2, 0.25: mean 0.21667, half 0.07172: 0.14495 to 0.28838, higher loss
    assert w["better"] == "lower" and w["verdict"] == "worse"
    assert (w["ci_low"], w["ci_high"]) == pytest.approx((0.14495, 0.28838), abs=1e-4)
    assert stats.verdict_sentence(w).startswith("siamese is higher than pre by 0.217 (95% CI 0.145 to 0.288")


def test_the_tasks_say_which_figures_are_better_higher():
    from siamesenorm.tasks import TASKS

    better = {name: {m.key: m.better for m in task.metrics} for name, task in TASKS.items()}
    losses = {"final_val_loss": "lower", "best_val_loss": "lower"}
    assert better == {"lm": {**losses, "final_arith_acc": "higher"},
                      "vit": {**losses, "final_val_acc": "higher"},
                      "dit": {**losses, "final_fd_proxy": "lower", "final_sample_acc": "higher"}}


def test_a_run_within_two_percent_of_the_unigram_loss_is_at_the_plateau_and_stays_in_the_mean():
    # unigram loss 3.0: the plateau starts at 0.98 * 3.0 = 2.94
    group = [_row("post", 0.01, 0, 3.05, unigram_val_loss=3.0),
             _row("post", 0.01, 1, 2.95, unigram_val_loss=3.0),
             _row("post", 0.01, 2, 2.93, unigram_val_loss=3.0),
             _row("post", 0.01, 3, 9.0, diverged=True, unigram_val_loss=3.0)]
    assert [stats.at_plateau(r) for r in group] == [True, True, False, None]   # a diverged run: None
    assert stats.at_plateau(_row("pre", 0.01, 0, 3.5)) is None                  # no unigram loss
    assert stats.at_plateau(_row("pre", 0.01, 0, None, unigram_val_loss=3.0)) is None
    [cell] = stats.aggregate(group, ["final_val_loss"])
    assert (cell["runs"], cell["diverged"], cell["stalled"], cell["plateau"]) == (4, 1, 0, 2)
    assert cell["metrics"]["final_val_loss"]["n"] == 3                          # plateau runs averaged in
    assert cell["metrics"]["final_val_loss"]["mean"] == pytest.approx((3.05 + 2.95 + 2.93) / 3)
    assert stats.failures_text(cell) == "1 of 4 diverged; 2 of 4 at the unigram plateau"
    [clean] = stats.aggregate(group[2:3], ["final_val_loss"])
    assert stats.failures_text(clean) == "none of 1"


def test_the_unigram_loss_is_the_cross_entropy_under_training_frequencies_add_one_smoothed():
    import numpy as np
    import torch

    from siamesenorm.tasks.lm import unigram_loss

    # training counts 0: 2, 1: 1, 2: 0 over 3 ids -> add one -> 3/6, 2/6, 1/6
    batches = [(None, torch.tensor([[0, 2], [1, 0]]))]
    expected = -(2 * math.log(3 / 6) + math.log(1 / 6) + math.log(2 / 6)) / 4
    got = unigram_loss(np.array([0, 1, 0], dtype=np.uint16), batches, 3)
    assert got == pytest.approx(expected, abs=1e-12)
