"""Every figure a task declares is paired seed by seed with the baseline, with its interval and a
verdict in the direction right for it, in ``summary.json``, ``report.md`` and the printed tables.

The expected differences and intervals are worked out by hand from fabricated figures (t_{0.975}
at 2 degrees of freedom: 4.303), not by the code under test.
"""

from __future__ import annotations

import json

import pytest

from helpers import cli_in_process as run
from siamesenorm.experiments import stats
from siamesenorm.experiments.compare import text_table
from siamesenorm.tasks import TASKS
from siamesenorm.tasks.spec import Metric

# Which way each figure any task reports is better: written here, not read from the tasks.
DIRECTION = {"final_val_loss": "lower", "best_val_loss": "lower", "final_fd_proxy": "lower",
             "final_val_acc": "higher", "final_arith_acc": "higher", "final_sample_acc": "higher"}
_TINY_VIT = ["vit-digits", "model.dim=32", "model.n_layers=2", "train.steps=2", "train.eval_every=2",
             "train.warmup=1", "data.batch_size=32", "data.val_batches=2"]


def _rows(figures: dict, key: str, lr: float = 0.01) -> list[dict]:
    return [{"run": f"{s}-s{seed}", "scheme": s, "lr": lr, "seed": seed, "final_val_loss": 2.0,
             "best_val_loss": 2.0, "diverged": False, "diverged_at": None, "stalled_at": None, key: v[seed]}
            for seed in range(3) for s, v in figures.items()]


@pytest.mark.parametrize("task,metric", [(t, m) for t, task in TASKS.items() for m in task.metrics],
                         ids=lambda x: getattr(x, "key", x))
def test_each_declared_figure_is_better_in_its_own_direction(task, metric):
    assert metric.better == DIRECTION[metric.key]
    # up: +0.10, +0.09, +0.11 (CI 0.075 to 0.125); down: the negatives; noise: +0.1, -0.2, +0.2
    rows = _rows({"pre": [1.0, 1.1, 1.2], "up": [1.1, 1.19, 1.31], "down": [0.9, 1.01, 1.09],
                  "noise": [1.1, 0.9, 1.4]}, metric.key)
    diffs = {d["scheme"]: d for d in stats.paired_differences(rows, [metric], "pre")}
    higher = DIRECTION[metric.key] == "higher"
    assert diffs["up"]["verdict"] == ("better" if higher else "worse")
    assert diffs["down"]["verdict"] == ("worse" if higher else "better")
    assert diffs["noise"]["verdict"] == "indistinguishable"
    assert diffs["up"]["mean"] == pytest.approx(0.10)
    assert (diffs["up"]["ci_low"], diffs["up"]["ci_high"]) == pytest.approx((0.07516, 0.12484), abs=1e-4)
    assert all(d["better"] == DIRECTION[metric.key] for d in diffs.values())


def test_the_printed_table_has_a_verdict_column_per_learning_rate():
    acc = Metric("final_val_acc", "val top-1", higher_is_better=True)
    rows = _rows({"pre": [0.50, 0.52, 0.54], "siamese": [0.60, 0.61, 0.65], "post": [0.40, 0.41, 0.45],
                  "hyper": [0.60, 0.40, 0.60]}, "final_val_acc")
    diffs = stats.paired_differences(rows, [acc], "pre")
    lines = text_table(rows, ["pre", "siamese", "post", "hyper"], [0.01], "final_val_acc", diffs).splitlines()
    assert lines[0].split() == ["scheme", "lr", "0.01", "vs", "pre", "at", "0.01"]
    assert lines[1].split()[0] == "pre" and len(lines[1].split()) == 2      # the baseline: no verdict
    # siamese - pre: 0.10, 0.09, 0.11: half-width 4.303 * 0.01 / sqrt(3) = 0.0248
    assert lines[2].split()[2:] == ["+0.100+-0.025", "better"]
    assert lines[3].split()[2:] == ["-0.100+-0.025", "worse"]
    # hyper - pre: 0.10, -0.12, 0.06: sd 0.1172, half 0.291
    assert lines[4].split()[2:] == ["+0.013+-0.291", "no", "difference"]
    # One seed: no interval, no verdict, no column.
    one = [r for r in rows if r["seed"] == 0]
    table = text_table(one, ["pre", "siamese"], [0.01], "final_val_acc",
                       stats.paired_differences(one, [acc], "pre"))
    assert "vs pre" not in table and "+-" not in table


def test_a_vit_compare_pairs_its_accuracy_with_the_baseline(tmp_path):
    out = tmp_path / "exp"
    args = ("compare", *_TINY_VIT, "--schemes", "pre,siamese,post", "--lrs", "1e-3", "--seeds", "0,1,2",
            "--out", str(out))
    first = run(*args)
    assert first.returncode == 0, first.stderr
    # Fabricated accuracies with a known answer; the repeated command re-reports without training.
    acc = {"pre": [0.50, 0.52, 0.54], "siamese": [0.60, 0.61, 0.65], "post": [0.40, 0.41, 0.45]}
    for scheme, values in acc.items():
        for seed, value in enumerate(values):
            path = out / f"{scheme}-lr0.001-s{seed}" / "summary.json"
            summary = json.loads(path.read_text())
            summary["final_val_acc"] = value
            path.write_text(json.dumps(summary))
    again = run(*args)
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("skipped") == 9
    diffs = json.loads((out / "summary.json").read_text())["differences"]
    assert {d["metric"] for d in diffs} == {"final_val_loss", "best_val_loss", "final_val_acc"}
    by = {(d["scheme"], d["metric"]): d for d in diffs}
    better, worse = by["siamese", "final_val_acc"], by["post", "final_val_acc"]
    assert better["better"] == "higher" and better["verdict"] == "better" and better["n"] == 3
    assert better["mean"] == pytest.approx(0.10) and better["ci_low"] == pytest.approx(0.07516, abs=1e-4)
    assert worse["verdict"] == "worse" and worse["mean"] == pytest.approx(-0.10)
    assert by["siamese", "final_val_loss"]["better"] == "lower"
    report = (out / "report.md").read_text()
    section = report[report.index("### Compared with pre"):report.index("## Runs")]
    assert "val top-1 (higher is better):" in section
    assert ("- siamese is higher than pre by 0.100 (95% CI 0.075 to 0.125, 3 seeds) at lr 0.001: better"
            in section)
    assert "- post is lower than pre by 0.100 (95% CI 0.075 to 0.125, 3 seeds) at lr 0.001: worse" in section
    # The printed headline table (accuracy) and the validation loss's, each with its verdict column.
    text = again.stdout
    head = text.index("final validation top-1 accuracy")
    [siamese] = [line for line in text[head:].splitlines() if line.startswith("siamese ")][:1]
    assert siamese.split()[1:] == ["0.6200+-0.0657", "+0.100+-0.025", "better"]
    assert "vs pre at 0.001" in text[head:text.index("final val loss, lower is better")]
    assert text.count("vs pre at 0.001") == 2


def test_a_dit_compare_pairs_its_loss_fd_proxy_and_sample_accuracy(tmp_path):
    out = tmp_path / "exp"
    res = run("compare", "dit-digits", "model.dim=32", "model.n_layers=2", "train.steps=2",
              "train.eval_every=2", "train.warmup=1", "data.batch_size=32", "data.val_batches=2",
              "diffusion.eval_samples=10", "diffusion.sample_steps=2", "diffusion.grid_per_class=1",
              "--schemes", "pre,siamese", "--lrs", "1e-3", "--seeds", "0,1", "--out", str(out))
    assert res.returncode == 0, res.stderr
    diffs = json.loads((out / "summary.json").read_text())["differences"]
    assert {d["metric"]: d["better"] for d in diffs} == {
        k: DIRECTION[k] for k in ("final_val_loss", "best_val_loss", "final_fd_proxy", "final_sample_acc")}
    assert all(d["n"] == 2 and d["verdict"] is not None for d in diffs)
    report = (out / "report.md").read_text()
    for title in ("final val loss (lower", "FD-proxy (lower", "sample acc (higher"):
        assert f"{title} is better):" in report
    # Three printed tables, the headline's first, each with the verdict column.
    for title in ("final FD-proxy, lower is better", "final val loss, lower is better",
                  "sample acc, higher is better"):
        assert title in res.stdout
    assert res.stdout.count("vs pre at 0.001") == 3
