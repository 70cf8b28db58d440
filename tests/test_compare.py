"""``siamesenorm compare`` end to end on the tiny preset: runs, table, report, plots, skipping."""

from __future__ import annotations

import csv
import json

from test_cli import run


def test_compare_trains_the_grid_writes_the_report_and_skips_finished_runs(tmp_path):
    out = tmp_path / "exp"
    args = ("compare", "tiny", "train.steps=4", "train.eval_every=2", "--schemes", "pre,siamese",
            "--lrs", "1e-3,1e4", "--out", str(out))
    first = run(*args)
    assert first.returncode == 0, first.stderr
    rows = list(csv.DictReader(open(out / "summary.csv")))
    assert [(r["scheme"], float(r["lr"])) for r in rows] == [
        ("pre", 1e-3), ("siamese", 1e-3), ("pre", 1e4), ("siamese", 1e4)]
    by_lr = {float(r["lr"]): r for r in rows if r["scheme"] == "pre"}
    assert by_lr[1e-3]["diverged"] == "False" and by_lr[1e4]["diverged"] == "True"
    assert len(json.loads((out / "summary.json").read_text())) == 4
    report = (out / "report.md").read_text()
    assert "| pre-lr0.001-s0 | pre |" in report and "yes (" in report
    for png in ("val_loss.png", "lr_grid.png"):
        assert f"]({png})" in report and (out / png).stat().st_size > 1000
    # Same runs on a repeat: nothing is trained again.
    second = run(*args)
    assert second.returncode == 0 and second.stdout.count("skipped") == 4


def test_compare_refuses_a_folder_holding_another_experiment(tmp_path):
    out = tmp_path / "exp"
    assert run("compare", "tiny", "train.steps=2", "--schemes", "pre", "--out", str(out)).returncode == 0
    res = run("compare", "tiny", "train.steps=3", "--schemes", "pre", "--out", str(out))
    assert res.returncode == 2 and "another experiment" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_compare_checks_every_scheme_before_training(tmp_path):
    res = run("compare", "tiny", "--schemes", "pre,nosuch", "--out", str(tmp_path / "exp"))
    assert res.returncode == 2 and "unknown scheme 'nosuch'" in res.stderr
    assert not (tmp_path / "exp").exists()
    res = run("compare", "tiny", "--lrs", "1e-3,abc", "--out", str(tmp_path / "exp"))
    assert res.returncode == 2 and "--lrs" in res.stderr
