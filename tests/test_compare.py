"""``siamesenorm compare`` end to end on the tiny preset: runs, table, report, plots, skipping."""

from __future__ import annotations

import csv
import json
import shutil

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
    runs = json.loads((out / "summary.json").read_text())
    assert len(runs) == 4
    for row in runs:  # each run's data, as its own summary.json recorded it
        own = json.loads((out / row["run"] / "summary.json").read_text())["data"]
        assert row["data"] == own and own["name"] == "pystdlib"
        assert set(own["fingerprint"]) == {"files", "bytes", "sha256", "python"}
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


def test_a_compare_refused_for_its_data_writes_nothing_and_the_corrected_one_runs(tmp_path):
    out = tmp_path / "exp"
    res = run("compare", "tiny", "train.steps=2", "data.corpus=/no/such.txt", "--schemes", "pre",
              "--out", str(out))
    assert res.returncode == 2 and "does not exist" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not out.exists()
    text = tmp_path / "text.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 200)
    res = run("compare", "tiny", "train.steps=2", f"data.corpus={text}", "--schemes", "pre",
              "--out", str(out))
    assert res.returncode == 0, res.stderr
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    # A variant whose data is bad is refused before the (existing) folder is touched.
    res = run("compare", "tiny", "train.steps=2", f"data.corpus={text}", "data.val_batches=1000",
              "data.seq_len=32", "data.batch_size=64", "--schemes", "pre", "--out", str(out))
    assert res.returncode == 2 and "validation data has" in res.stderr, res.stderr
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_a_run_killed_before_its_first_checkpoint_starts_afresh(tmp_path):
    out = tmp_path / "exp"
    args = ("compare", "tiny", "train.steps=2", "--schemes", "pre", "--out", str(out))
    assert run(*args).returncode == 0
    run_dir = out / "pre-lr0.001-s0"
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    # What kill -9 after step 1 leaves: config.yaml, the tokenizer and one metrics row, no checkpoint.
    shutil.rmtree(run_dir / "checkpoints")
    (run_dir / "summary.json").unlink()
    (run_dir / "metrics.jsonl").write_text(rows[0] + "\n")
    (run_dir / "stray.tmp").write_text("left by the killed run")
    again = run(*args)
    assert again.returncode == 0, again.stderr
    assert "pre-lr0.001-s0: training" in again.stdout
    assert not (run_dir / "stray.tmp").exists()
    assert [json.loads(r)["step"] for r in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2
