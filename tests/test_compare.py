"""``siamesenorm compare`` end to end on the tiny preset: runs, table, report, plots, skipping, and
the seeds summed up (summary.json's aggregate and differences, the report's verdicts)."""

from __future__ import annotations

import csv
import io
import json
import math
import re
import shutil

import pytest
import yaml

from siamesenorm.errors import ConfigError
from siamesenorm.experiments import stats
from siamesenorm.experiments.compare import read_runs, text_table
from siamesenorm.experiments.grid import choose_baseline
from siamesenorm.experiments.report import seeds_section
from siamesenorm.tasks.spec import Metric
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
    # stderr, not a terminal: a line as each run starts and as it ends (its own final line), a
    # grid line now and then; none of the runs' step lines
    err = first.stderr.splitlines()
    for r in rows:
        own = [line for line in err if line.startswith(f"{r['run']}: ")]
        end = "diverged at step " if r["diverged"] == "True" else "done: 4/4 steps in "
        assert own[0] == f"{r['run']}: started, 4 steps" and own[1].startswith(f"{r['run']}: [train] {end}")
        assert len(own) == 2, own
    grid = [line for line in err if line.startswith("compare: ")]
    assert len(err) == 2 * len(rows) + len(grid) and not any("[train] step" in line for line in err)
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary) == {"runs", "aggregate", "differences", "baseline"}
    runs = summary["runs"]
    assert len(runs) == 4 and summary["baseline"] == "pre"
    for row in runs:  # each run's data, as its own summary.json recorded it
        own = json.loads((out / row["run"] / "summary.json").read_text())["data"]
        assert row["data"] == own and own["name"] == "pystdlib"
        assert set(own["fingerprint"]) == {"files", "bytes", "sha256", "python"}
    # One seed per cell: means of one, no interval, no verdict; the printed table as ever.
    assert all(c["runs"] == 1 and c["metrics"]["final_val_loss"]["ci_low"] is None
               for c in summary["aggregate"])
    assert [d["verdict"] for d in summary["differences"]] == [None] * 4    # 2 lrs x 2 losses
    assert "div@" in first.stdout and "+-" not in first.stdout
    report = (out / "report.md").read_text()
    assert "| pre-lr0.001-s0 | pre |" in report and "yes (" in report
    assert "One seed per scheme and learning rate: no confidence intervals and no verdicts" in report
    assert "95% CI" not in report and "seed noise" not in report
    for png in ("val_loss.png", "lr_grid.png"):
        assert f"]({png})" in report and (out / png).stat().st_size > 1000
    # Same runs on a repeat: nothing is trained again.
    second = run(*args)
    assert second.returncode == 0 and second.stdout.count("skipped") == 4 and second.stderr == ""


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
    (run_dir / ".summary.json.tmp-4242").write_text("left by the killed run's atomic write")
    (run_dir / "notes.txt").write_text("a user's file: not the run's to delete")
    again = run(*args)
    assert again.returncode == 0, again.stderr
    assert "pre-lr0.001-s0: training" in again.stdout
    assert not (run_dir / ".summary.json.tmp-4242").exists()
    assert (run_dir / "notes.txt").exists()
    assert [json.loads(r)["step"] for r in (run_dir / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 2


def _hand(values: list[float]) -> tuple[float, float | None]:
    """Mean and 95% half-width of one or two values, by hand: with two, sd = |a - b| / sqrt(2) and
    the half-width t_{0.975,1} * sd / sqrt(2) = 12.706 * |a - b| / 2."""
    mean = sum(values) / len(values)
    return mean, (12.706 * abs(values[0] - values[1]) / 2 if len(values) == 2 else None)


def test_compare_over_two_seeds_sums_them_up_and_counts_divergence(tmp_path):
    out = tmp_path / "exp"
    args = ("compare", "tiny", "train.steps=4", "train.eval_every=2", "--schemes", "pre,siamese",
            "--lrs", "1e-3,1e4", "--seeds", "0,1", "--out", str(out))
    first = run(*args)
    assert first.returncode == 0, first.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["baseline"] == "pre" and len(summary["runs"]) == 8
    assert len(list(csv.DictReader(open(out / "summary.csv")))) == 8      # still one row per run
    own = {(r["scheme"], r["lr"], r["seed"]): json.loads((out / r["run"] / "summary.json").read_text())
           for r in summary["runs"]}
    assert any(s["diverged"] for s in own.values())     # lr 1e4 diverges: the counting is exercised
    report = (out / "report.md").read_text()
    assert report.index("## Over seeds") < report.index("## Runs")
    for cell in summary["aggregate"]:
        runs = [own[(cell["scheme"], cell["lr"], seed)] for seed in (0, 1)]
        assert cell["seeds"] == [0, 1] and cell["runs"] == 2
        assert cell["diverged"] == sum(s["diverged"] for s in runs)
        kept = [s["final_val_loss"] for s in runs if not s["failed"]]
        est = cell["metrics"]["final_val_loss"]
        assert est["n"] == len(kept)
        if kept:
            mean, half = _hand(kept)
            assert est["mean"] == pytest.approx(mean, abs=1e-9)
            if half is None:
                assert est["ci_low"] is None and est["sd"] is None
            else:
                assert (est["ci_low"], est["ci_high"]) == pytest.approx((mean - half, mean + half), abs=1e-3)
        else:
            assert est["mean"] is None
        failed = stats.failures_text(cell)
        flat = sum(not s["failed"] and s["final_val_loss"] >= 0.98 * s["unigram_val_loss"] for s in runs)
        assert cell["plateau"] == flat
        assert failed == (f"{cell['diverged']} of 2 diverged" if cell["diverged"] else "none of 2") + \
            (f"; {flat} of 2 at the unigram plateau" if flat else "")
        assert f"| {cell['scheme']} | {cell['lr']:g} | 2 | " in report and f"| {failed} |" in report
    for d in summary["differences"]:
        assert d["scheme"] == "siamese" and d["baseline"] == "pre" and d["better"] == "lower"
        pairs = [own[("siamese", d["lr"], seed)][d["metric"]] - own[("pre", d["lr"], seed)][d["metric"]]
                 for seed in (0, 1) if not own[("siamese", d["lr"], seed)]["failed"]
                 and not own[("pre", d["lr"], seed)]["failed"]]
        assert d["n"] == len(pairs)
        if len(pairs) == 2:
            mean, half = _hand(pairs)
            assert d["mean"] == pytest.approx(mean, abs=1e-9)
            assert (d["ci_low"], d["ci_high"]) == pytest.approx((mean - half, mean + half), abs=1e-3)
            if abs(abs(mean) - half) > 1e-3:     # clearly in or out of the interval
                assert d["verdict"] == ("indistinguishable" if abs(mean) < half
                                        else "better" if mean < 0 else "worse")
        else:
            assert d["verdict"] is None
        assert f"- {stats.verdict_sentence(d)}" in report
    assert "mean over the seeds that did not diverge or stall" in report and "shaded" in report
    assert "+-" in first.stdout    # the printed table: means with intervals, and the verdicts
    header = next(line for line in first.stdout.splitlines() if line.startswith("scheme "))
    assert header.split()[-8:] == ["vs", "pre", "at", "0.001", "vs", "pre", "at", "10000"]
    # Another baseline re-reports the same runs: nothing trains again.
    again = run(*args, "--baseline", "siamese")
    assert again.returncode == 0, again.stderr
    assert again.stdout.count("skipped") == 8
    flipped = json.loads((out / "summary.json").read_text())
    assert flipped["baseline"] == "siamese" and {d["scheme"] for d in flipped["differences"]} == {"pre"}
    before = {(d["lr"], d["metric"]): d["mean"] for d in summary["differences"]}
    for d in flipped["differences"]:
        old = before[(d["lr"], d["metric"])]
        assert (d["mean"] is None and old is None) or d["mean"] == pytest.approx(-old)
    assert "### Compared with siamese" in (out / "report.md").read_text()


def test_an_unknown_baseline_is_one_line_and_writes_nothing(tmp_path):
    out = tmp_path / "exp"
    res = run("compare", "tiny", "--schemes", "pre,siamese", "--baseline", "post", "--out", str(out))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "--baseline 'post' is not among the compared schemes (pre, siamese)" in res.stderr
    assert not out.exists()
    preset = tmp_path / "p.yaml"
    preset.write_text(yaml.safe_dump({"train": {"steps": 2},
                                      "compare": {"schemes": ["pre", "siamese"], "baseline": "hyper"}}))
    res = run("compare", str(preset), "--out", str(out))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert "compare.baseline 'hyper' is not among" in res.stderr and not out.exists()
    preset.write_text(yaml.safe_dump({"compare": {"baseline": ["pre"]}}))
    res = run("compare", str(preset), "--out", str(out))
    assert res.returncode == 2 and "compare.baseline must be" in res.stderr and not out.exists()


def test_the_baseline_is_the_named_one_else_pre_else_the_first():
    assert choose_baseline(["post", "pre", "siamese"]) == "pre"
    assert choose_baseline(["post", "siamese"]) == "post"
    assert choose_baseline(["pre", "siamese"], None, {"baseline": "siamese"}) == "siamese"
    assert choose_baseline(["pre", "siamese"], "pre", {"baseline": "siamese"}) == "pre"
    with pytest.raises(ConfigError, match="--baseline 'x'"):
        choose_baseline(["pre", "siamese"], "x")


FINAL = Metric("final_val_loss", "final val loss")


def _rows(losses: dict, lr: float = 0.01) -> list[dict]:
    return [{"run": f"{s}-s{seed}", "scheme": s, "lr": lr, "seed": seed, "final_val_loss": v[seed],
             "best_val_loss": v[seed], "diverged": False, "diverged_at": None, "stalled_at": None}
            for seed in range(len(next(iter(losses.values())))) for s, v in losses.items()]


def test_the_report_gives_a_verdict_only_when_the_interval_excludes_zero():
    # siamese - pre: -0.1, -0.15, -0.1 (95% CI -0.188 to -0.045: lower); post - pre: +0.1, -0.2,
    # +0.2 (CI -0.484 to 0.550: noise). Worked out in tests/test_stats.py.
    rows = _rows({"pre": [2.0, 2.2, 2.4], "siamese": [1.9, 2.05, 2.3], "post": [2.1, 2.0, 2.6]})
    metrics = ["final_val_loss"]
    text = "\n".join(seeds_section(stats.aggregate(rows, metrics),
                                   stats.paired_differences(rows, [FINAL], "pre"), "pre"))
    [line] = [x for x in text.splitlines() if x.startswith("| pre | 0.01 |")]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[2] == "3" and cells[4] == "none of 3"
    mean, half, n = re.fullmatch(r"([\d.]+) ± ([\d.]+) \(n=(\d)\)", cells[3]).groups()
    assert (float(mean), float(half), n) == (2.2, pytest.approx(0.4969, abs=2e-4), "3")  # 4.303*0.2/sqrt(3)
    assert "- siamese is lower than pre by 0.117 (95% CI 0.045 to 0.188, 3 seeds) at lr 0.01: better" in text
    assert "- post vs pre at lr 0.01: not distinguishable from seed noise" in text
    assert "post is lower" not in text and "post is higher" not in text
    one = _rows({"pre": [2.0], "siamese": [1.0]})
    text = "\n".join(seeds_section(stats.aggregate(one, metrics),
                                   stats.paired_differences(one, [FINAL], "pre"), "pre"))
    assert "no verdicts" in text and "is lower than" not in text and "95% CI" not in text


def test_the_printed_table_shows_intervals_only_with_several_seeds():
    one = _rows({"pre": [2.0], "siamese": [1.5]})
    one[1].update(diverged=True, diverged_at=3)
    assert text_table(one, ["pre", "siamese"], [0.01]) == (
        "scheme        lr 0.01\n"
        "pre            2.0000\n"
        "siamese         div@3")
    three = _rows({"pre": [2.0, 2.2, 2.4], "siamese": [1.9, 9.0, 2.3]})
    three[3].update(diverged=True, diverged_at=5)        # siamese, seed 1
    lines = text_table(three, ["pre", "siamese"], [0.01]).splitlines()
    name, text = lines[1].split()
    mean, half = text.split("+-")
    assert name == "pre" and float(mean) == 2.2 and float(half) == pytest.approx(0.4969, abs=2e-4)
    # siamese over 1.9 and 2.3: mean 2.1, half 12.706 * 0.4 / 2 = 2.5412
    name, text, count, word = lines[2].split()
    mean, half = text.split("+-")
    assert (name, count, word) == ("siamese", "1/3", "div") and float(mean) == 2.1
    assert float(half) == pytest.approx(2.5412, abs=2e-4)


def test_flat_marks_a_loss_table_and_not_the_mfu_table():
    """``flat`` says a loss ended at the unigram plateau; the MFU table repeated it."""
    for seeds in (1, 3):
        rows = _rows({"pre": [3.2] * seeds, "siamese": [2.0] * seeds})
        for row in rows:
            row.update(unigram_val_loss=3.18, mfu=0.25)
        loss = text_table(rows, ["pre", "siamese"], [0.01]).splitlines()
        assert "flat" in loss[1] and "flat" not in loss[2]
        assert "flat" not in text_table(rows, ["pre", "siamese"], [0.01], "mfu")


def test_read_runs_takes_the_object_and_the_older_list(tmp_path):
    rows = _rows({"pre": [2.0]})
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"runs": rows, "aggregate": [], "differences": [], "baseline": "pre"}))
    assert read_runs(path) == rows
    path.write_text(json.dumps(rows))
    assert read_runs(path) == rows
    path.write_text(json.dumps({"rows": rows}))
    with pytest.raises(ConfigError, match="not a comparison's summary"):
        read_runs(path)


def test_default_comparison_trains_every_cell_with_at_least_two_seeds():
    """`siamesenorm compare` with no arguments must give every (scheme, learning rate) cell at least
    two seeds, so that its table can show an interval (checked on the grid it builds, not by timing)."""
    from siamesenorm.cli import DEFAULT_PRESET
    from siamesenorm.experiments.grid import build_grid

    _, spec, cells = build_grid(DEFAULT_PRESET, [])
    per_cell: dict = {}
    for cell in cells:
        per_cell.setdefault((cell.variant.label, cell.lr), set()).add(cell.seed)
    assert set(spec["schemes"]) >= {"pre", "post", "siamese"} and len(spec["lrs"]) >= 2
    assert len(per_cell) == len(spec["schemes"]) * len(spec["lrs"])
    assert all(len(seeds) >= 2 for seeds in per_cell.values()), per_cell
    assert {c.config.seed for c in cells} == set(spec["seeds"])


@pytest.mark.parametrize("preset", ["table1", "table2", "table3", "arithmetic", "vit-digits", "dit-digits",
                                    "topologies", "topologies-gpu"])
def test_the_presets_of_docs_reproduction_train_three_seeds_per_cell(preset):
    """docs/reproduction.md states each claim over three seeds from `siamesenorm compare PRESET`."""
    from siamesenorm.experiments.grid import build_grid

    _, spec, cells = build_grid(preset, [])
    per_cell: dict = {}
    for cell in cells:
        per_cell.setdefault((cell.variant.label, cell.lr), set()).add(cell.seed)
    assert all(len(seeds) >= 3 for seeds in per_cell.values()), per_cell


def test_runs_that_learn_nothing_beyond_token_frequencies_are_reported_at_the_plateau(tmp_path):
    out = tmp_path / "exp"
    res = run("compare", "tiny", "train.steps=2", "train.eval_every=2", "--schemes", "pre",
              "--lrs", "1e-9", "--seeds", "0,1", "--out", str(out))
    assert res.returncode == 0, res.stderr
    rows = list(csv.DictReader(open(out / "summary.csv")))
    assert [r["plateau"] for r in rows] == ["True", "True"]             # ln 256 is far above it
    for r in rows:
        unigram = float(r["unigram_val_loss"])
        assert 0 < unigram < math.log(256) and float(r["final_val_loss"]) > unigram
    assert "2/2 flat" in res.stdout and "flat: the final loss is at or above 98% of the unigram loss (" \
        in res.stdout
    data = json.loads((out / "summary.json").read_text())
    assert data["aggregate"][0]["plateau"] == 2 and data["aggregate"][0]["diverged"] == 0
    report = (out / "report.md").read_text()
    assert "2 of 2 at the unigram plateau" in report and "at or above 98% of the unigram loss" in report


def test_a_twelve_run_compare_reads_its_preset_and_loads_its_corpus_once_per_distinct_setting(
        tmp_path, monkeypatch):
    import siamesenorm.config as config
    import siamesenorm.experiments.grid as grid
    import siamesenorm.tasks.lm as lm
    from siamesenorm.experiments import compare

    counts = {"preset": 0, "corpus": []}

    def counted(module, name, key):
        real = getattr(module, name)

        def wrapper(*args, **kwargs):
            if key == "preset":
                counts["preset"] += 1
            else:
                counts["corpus"].append(args[0])
            return real(*args, **kwargs)
        monkeypatch.setattr(module, name, wrapper)

    counted(config, "read_preset", "preset")
    counted(grid, "read_preset", "preset")
    counted(lm, "load_corpus", "corpus")
    preset = tmp_path / "grid.yaml"
    preset.write_text(yaml.safe_dump({
        "model": {"dim": 16, "n_layers": 1, "n_heads": 2, "max_seq_len": 16},
        "data": {"batch_size": 2, "seq_len": 16, "max_bytes": 20000, "val_batches": 1},
        "train": {"steps": 1, "warmup": 0, "eval_every": 1, "checkpoint_every": 1},
        "compare": {"schemes": ["pre", "post", "short"], "lrs": [1e-3, 2e-3], "seeds": [0, 1],
                    "variants": {"short": {"scheme": "siamese",
                                           "overrides": {"data.seq_len": 8}}}}}))
    rows = compare(str(preset), [], tmp_path / "exp", log=lambda *_: None)
    assert len(rows) == 12 and all(r["steps"] == 1 for r in rows)
    assert counts["preset"] == 1
    # two data settings (seq_len 16 for pre and post, 8 for the variant), each loaded once
    assert counts["corpus"] == ["pystdlib", "pystdlib"]
    counts["corpus"].clear()
    counts["preset"] = 0
    compare(str(preset), [], tmp_path / "exp", log=lambda *_: None)     # all done: nothing trains
    assert counts["preset"] == 1 and len(counts["corpus"]) == 2          # the data is still checked


def test_with_a_peak_the_table_and_summary_csv_show_each_run_s_mfu(tmp_path):
    """MFU needs a peak: a GPU's from the table, or train.peak_tflops (here, on the CPU). Each run's
    TFLOP/s and MFU reach summary.csv as its summary.json has them, and a second table shows MFU."""
    def compare(out, *extra):
        result = run("compare", "tiny", "train.steps=4", "train.eval_every=2", *extra, "--schemes",
                     "pre,siamese", "--out", str(tmp_path / out))
        assert result.returncode == 0, result.stderr
        return result.stdout, list(csv.DictReader(open(tmp_path / out / "summary.csv")))

    stdout, rows = compare("peak", "train.peak_tflops=0.5")
    assert len(rows) == 2 and "MFU: model FLOPs utilisation" in stdout
    for row in rows:
        own = json.loads((tmp_path / "peak" / row["run"] / "summary.json").read_text())
        assert float(row["mfu"]) == pytest.approx(own["mfu"]) and 0 < own["mfu"] < 1
        assert float(row["tflops"]) == pytest.approx(own["tflops"])
        assert own["mfu"] == pytest.approx(own["tflops"] / 0.5)
    table = stdout[stdout.index("MFU: model FLOPs"):].splitlines()[1:4]
    assert table[0].split() == ["scheme", "lr", "0.001"] and table[1].split()[0] == "pre"
    assert float(table[1].split()[1]) == pytest.approx(float(rows[0]["mfu"]), abs=1e-4)
    # On the CPU without a peak: TFLOP/s but no MFU, and no MFU table.
    stdout, rows = compare("cpu")
    assert "mfu" not in rows[0] and float(rows[0]["tflops"]) > 0 and "MFU" not in stdout


def test_the_topologies_preset_compares_the_2026_designs_at_two_rates():
    """Issues 28 and 38: pre, siamese, hyper, mhc, attn_res (full and block), Pre-Norm with DyT or
    Derf, Keel, and Pre-Norm and SiameseNorm with Depth-Attention."""
    from siamesenorm.experiments.grid import build_grid

    for preset in ("topologies", "topologies-gpu"):
        _, spec, cells = build_grid(preset, [])
        built = {c.variant.label: (c.config.model.scheme, c.config.model.norm,
                                   dict(c.config.model.scheme_options)) for c in cells}
        assert built["attn_res"] == ("attn_res", built["pre"][1], {})
        assert built["attn_res-block"][0] == "attn_res" and built["attn_res-block"][2]["block_size"] > 1
        assert built["pre-dyt"] == ("pre", "dyt", {}) and built["pre"][1] != "dyt"
        assert {built[k][0] for k in ("siamese", "hyper", "mhc")} == {"siamese", "hyper", "mhc"}
        assert built["keel"] == ("keel", built["pre"][1], {})
        assert built["pre-derf"] == ("pre", "derf", {})
        assert len(spec["lrs"]) == 2 and len(cells) == 11 * 2 * 3
        # DyT as its paper's language models have it: the embedding's learnable sqrt(d) scale, on an
        # embedding of std 1/sqrt(d) (OLMo's init, every design's), so the stream enters at std 1
        models = {c.variant.label: c.config.model for c in cells}
        assert models["pre-dyt"].embed_scale == "sqrt_dim" and models["pre"].embed_scale is None
        assert models["pre-derf"].embed_scale == "sqrt_dim"
        assert {m.init for m in models.values()} == {"mitchell"}
        # Depth-Attention beside the same residual designs: only the option differs
        assert [k for k, m in models.items() if m.depth_attention] == ["pre-da", "siamese-da"]
        assert built["pre-da"] == built["pre"] and built["siamese-da"] == built["siamese"]


# ---- what compare shows while it trains (experiments/view.py) ------------------------------------

class Terminal(io.StringIO):
    """A fake terminal: a stream that says it is one."""

    encoding = "utf-8"

    def isatty(self) -> bool:
        return True


def screen(text: str) -> list[str]:
    """The lines a terminal shows after ``text``: ``ESC[nA`` (up n lines), ``\\r``, ``ESC[J`` (clear
    below) and newlines, the only controls the view writes (any other escape fails the test)."""
    lines, row, col = [""], 0, 0
    for part in re.split(r"(\x1b\[\d*[A-Za-z]|\r|\n)", text):
        if part == "\n":
            row, col = row + 1, 0
            lines += [""] * (row + 1 - len(lines))
        elif part == "\r":
            col = 0
        elif part.startswith("\x1b["):
            assert part[-1] in "AJ", repr(part)
            if part[-1] == "A":
                row = max(0, row - int(part[2:-1] or 1))
            else:
                lines[row] = lines[row][:col]
                del lines[row + 1:]
        elif part:
            lines[row] = lines[row][:col] + part + lines[row][col + len(part):]
            col += len(part)
    return lines[:-1] if lines[-1] == "" else lines


class Clock:
    """A clock that moves when a test sets ``now``."""

    now = 0.0

    def __call__(self) -> float:
        return self.now


def _clocked(names, steps=100):
    from siamesenorm.experiments.eta import Eta

    clock = Clock()
    eta = Eta(clock=clock)
    for name in names:
        eta.add(name, steps, 1.0)
    return clock, eta


def test_on_a_terminal_one_view_of_the_grid_is_redrawn_in_place():
    from siamesenorm.experiments.view import GridView

    clock, eta = _clocked(["pre-s0", "siamese-s0", "post-s0"])
    term = Terminal()
    view = GridView(3, 0, eta, term, clock=clock)
    assert view.live
    view.started("pre-s0", 0, 100)
    view.started("siamese-s0", 0, 100)
    for step in range(1, 41):       # many step lines, one view
        clock.now = step * 0.25
        view.run_line("pre-s0", f"[train] step {step}/100 | loss 3.1416 | lr 1.00e-03")
        view.run_line("siamese-s0", f"[train] step {step // 2}/100 | loss 3.5000 | lr 1.00e-03")
    view.run_line("pre-s0", "[train] step 40/100 | loss 3.1000 | val loss 3.2000 | lr 1.00e-03")
    clock.now = 11.0
    view.tick()
    shown = screen(term.getvalue())
    # done 60 of 300 units of work in 11 s: 240 left at that speed, 44 s
    assert len(shown) == 3 and "[train]" not in term.getvalue()
    assert shown[0].startswith("compare") and \
        shown[0].endswith("0/3 done, 2 running, 1 pending, elapsed 11s, ETA 44s")
    assert shown[1].startswith("  pre-s0 ") and shown[1].endswith("40/100 loss 3.1000, val loss 3.2000")
    assert shown[2].startswith("  siamese-s0 ") and shown[2].endswith("20/100 loss 3.5000")
    # a run's other lines scroll above the view; its final line is the view's business
    view.run_line("siamese-s0", "a warning")
    view.run_line("pre-s0", "[train] done: 100/100 steps in 25s | loss 3.0000")
    view.ended("pre-s0", 100)
    view.wrap(lambda text: term.write(text + "\n"))("  pre-s0: final val loss 3.0000")
    shown = screen(term.getvalue())
    assert shown[:2] == ["siamese-s0: a warning", "  pre-s0: final val loss 3.0000"]
    assert len(shown) == 4 and "1/3 done, 1 running, 1 pending" in shown[2]
    view.close()
    assert screen(term.getvalue()) == shown[:2]         # the view leaves the screen when done


def test_compare_on_a_terminal_shows_its_view_instead_of_each_step(tmp_path, monkeypatch):
    """In this process (one run at a time): the runs' lines feed the view and are not shown."""
    from contextlib import redirect_stderr

    from siamesenorm.experiments import compare, view

    monkeypatch.setattr(view, "REDRAW_S", 0.0)      # every line redraws it

    term, printed = Terminal(), []
    with redirect_stderr(term):
        compare("tiny", ["train.steps=4", "train.eval_every=2", "train.warmup=0", "data.max_bytes=40000"],
                tmp_path / "exp", schemes=["pre", "siamese"], jobs=1, log=printed.append)
    text = term.getvalue()
    assert "[train]" not in text and "\x1b[" in text
    assert "0/2 done, 1 running, 1 pending" in text and "1/2 done, 1 running, 0 pending" in text
    for name in ("pre-lr0\\.001-s0", "siamese-lr0\\.001-s0"):
        assert re.search(rf"\n  {name} +50%\|.*\| 2/4 loss \d\.\d{{4}}, val loss \d\.\d{{4}}\n", text), text
    assert screen(text) == []                   # erased at the end: stdout holds the record
    assert any(line.startswith("  siamese-lr0.001-s0: final val loss ") and "; 2/2 done in " in line
               for line in printed)


def test_many_runs_at_once_fit_the_terminal_and_the_log_s_grid_line():
    from siamesenorm.experiments.view import GridView

    names = [f"run-{i}" for i in range(30)]
    clock, eta = _clocked(names)
    log = io.StringIO()
    view = GridView(30, 0, eta, log, clock=clock)
    for name in names:
        view.started(name, 0, 100)
    for name in names:
        view.run_line(name, "[train] step 20/100 | loss 3.0000")
    grid = [line for line in log.getvalue().splitlines() if line.startswith("compare: ")]
    assert len(grid) == 2 and all(line.endswith("; run-3 step 20/100, loss 3.0000; 26 more running")
                                  for line in grid)
    shown = view.lines(6)
    assert len(shown) == 6 and shown[1].startswith("  run-0 ") and shown[-1] == "  and 26 more running"


class _Pipe:
    """What a worker's pipe hands the view: each line as it is written."""

    def __init__(self, view, name):
        self.view, self.name, self.partial = view, name, ""

    def write(self, text):
        *lines, self.partial = (self.partial + text).split("\n")
        for line in lines:
            self.view.run_line(self.name, line)

    def flush(self):
        pass


def test_the_log_of_the_default_comparison_is_a_few_lines_per_run():
    """The default comparison's 18 runs, two at a time, each logging as a worker does (a line
    every 2 steps, validation every 25): a start and an end line a run and a grid line now and
    then, under 150 lines (they were 1,872)."""
    from siamesenorm.cli import DEFAULT_PRESET
    from siamesenorm.experiments.grid import build_grid
    from siamesenorm.experiments.view import PROGRESS_MARKS, GridView
    from siamesenorm.train.progress import RunLog, log_interval

    _, _, cells = build_grid(DEFAULT_PRESET, [])
    steps, every = cells[0].config.train.steps, cells[0].config.train.eval_every
    names = [cell.name for cell in cells]
    clock, eta = _clocked(names, steps)
    log = io.StringIO()
    view = GridView(len(names), 0, eta, log, clock=clock)
    assert not view.live
    for pair in (names[i:i + 2] for i in range(0, len(names), 2)):
        runs = {}
        for name in pair:
            view.started(name, 0, steps)
            runs[name] = RunLog(steps, 0, log_interval(None, steps), "lines", stream=_Pipe(view, name))
        for step in range(1, steps + 1):
            clock.now += 0.05
            for display in runs.values():
                display.step(step, loss=3.0, lr=2e-3, tokens=1024, seconds=0.05, elapsed=clock.now,
                             session_s=clock.now, evaluated={"val_loss": 3.1} if step % every == 0 else None)
        for name, display in runs.items():
            display.finish({"steps": steps, "wall_time_s": 10.0, "final_loss": 3.0, "final_val_loss": 3.1,
                            "best_val_loss": 3.1, "best_val_step": steps})
            view.ended(name, steps)
    lines = log.getvalue().splitlines()
    assert len(lines) < 150 and not any("[train] step" in line for line in lines)
    for name in names:
        assert [line for line in lines if line.startswith(f"{name}: ")] == [
            f"{name}: started, {steps} steps",
            f"{name}: [train] done: {steps}/{steps} steps in 10s | loss 3.0000 | val loss 3.1000 "
            f"(best 3.1000 at step {steps})"]
    grid = [line for line in lines if line.startswith("compare: ")]
    assert len(lines) == 2 * len(names) + len(grid) and 5 <= len(grid) < PROGRESS_MARKS
    assert re.fullmatch(r"compare: \d+/18 done, 2 running, \d+ pending, elapsed \S+, ETA \S+; "
                        r"\S+ step \d+/200, loss 3\.0000(, val loss 3\.1000)?; \S+ step .*", grid[0])


def test_a_broken_stderr_or_a_failing_reader_never_stops_a_run(tmp_path):
    import subprocess
    import sys

    from siamesenorm.experiments.view import GridView
    from siamesenorm.experiments.workers import Worker

    class Broken(Terminal):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    for live in (True, False):
        clock, eta = _clocked(["pre-s0"])
        view = GridView(1, 0, eta, Broken(), live=live, clock=clock)
        view.started("pre-s0", 0, 100)
        view.run_line("pre-s0", "[train] step 1/100 | loss 3.0000")
        view.run_line("pre-s0", "a warning")
        view.note("compare: interrupt")
        view.ended("pre-s0", 100)
        view.close()
        assert view.stream.mute and eta.work_left() == 0
    # a worker's pipe is drained to its end however its reader fails
    calls = []

    def failing(line):
        calls.append(line)
        raise RuntimeError("reader bug")

    worker = Worker("pre-s0", tmp_path, False, 1, on_line=failing)
    worker.proc = subprocess.Popen([sys.executable, "-c", "for i in range(5000): print(i)"],
                                   stdout=subprocess.PIPE)
    worker._pass_through()
    assert worker.proc.wait(timeout=60) == 0 and len(calls) == 5000


def test_flat_means_what_the_legend_says():
    """At or above 98% of the unigram loss, however far above (4.95 where it is 3.18), is flat."""
    from siamesenorm.experiments.compare import plateau_legend

    rows = _rows({"pre": [3.18 * 0.99], "post": [4.95], "siamese": [3.18 * 0.97]})
    for row in rows:
        row["unigram_val_loss"] = 3.18
    assert [stats.at_plateau(r) for r in rows] == [True, True, False]
    legend = plateau_legend(rows)
    assert legend.startswith("flat: the final loss is at or above 98% of the unigram loss (3.1800, ")
    assert "within" not in legend


def test_the_unigram_paragraph_is_only_in_a_language_model_s_report(tmp_path):
    from siamesenorm.experiments.report import write_report

    rows = _rows({"pre": [2.0, 2.2], "siamese": [1.9, 2.1]})
    for row in rows:
        row.update(tokens_per_s=1.0, num_parameters=10, max_grad_norm=None)
    metrics = ["final_val_loss"]
    parts = (stats.aggregate(rows, metrics), stats.paired_differences(rows, [FINAL], "pre"), "pre")
    assert "unigram" not in "\n".join(seeds_section(*parts))
    assert "at or above 98% of the unigram loss" in "\n".join(seeds_section(*parts, unigram=True))
    write_report(tmp_path, rows, ["pre", "siamese"], [0.01], aggregate=parts[0], differences=parts[1],
                 baseline="pre")
    assert "unigram" not in (tmp_path / "report.md").read_text()         # a ViT's, a DiT's
    for row in rows:
        row["unigram_val_loss"] = 3.18
    write_report(tmp_path, rows, ["pre", "siamese"], [0.01], aggregate=parts[0], differences=parts[1],
                 baseline="pre")
    assert "at or above 98% of the unigram loss" in (tmp_path / "report.md").read_text()


def _kept_figures(stdout: str, out) -> tuple[float, float]:
    """The MB figures of compare's last line: what the folder keeps, and of it checkpoints."""
    line = stdout.strip().splitlines()[-1]
    found = re.fullmatch(rf"{re.escape(str(out))} keeps ([\d.]+) MB \(([\d.]+) MB of it checkpoints\): (.*)",
                         line)
    assert found, line
    return float(found[1]), float(found[2])


def _checkpoint_folders(run_dir) -> list[str]:
    return sorted(p.name for p in (run_dir / "checkpoints").iterdir())


def test_a_finished_run_keeps_only_its_last_checkpoint_and_compare_says_how_much_is_kept(tmp_path):
    out = tmp_path / "exp"
    res = run("compare", "tiny", "train.steps=4", "train.eval_every=2", "train.checkpoint_every=1",
              "train.keep_checkpoints=3", "--schemes", "pre", "--lrs", "1e-3,1e4", "--jobs", "2",
              "--out", str(out))
    assert res.returncode == 0, res.stderr
    # finished (in a worker process): checkpoints/last alone, and it still loads for what reads it
    finished, diverged = out / "pre-lr0.001-s0", out / "pre-lr10000-s0"
    assert _checkpoint_folders(finished) == ["last"]
    assert run("generate", str(finished), "--prompt", "x", "--max-new-tokens", "2").returncode == 0
    # diverged: every checkpoint it kept, for a resume with other settings
    assert json.loads((diverged / "summary.json").read_text())["diverged"]
    assert _checkpoint_folders(diverged)[0] == "last" and len(_checkpoint_folders(diverged)) > 1
    total = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    checkpoints = sum(p.stat().st_size for p in out.glob("*/checkpoints/**/*") if p.is_file())
    kept, of_checkpoints = _kept_figures(res.stdout, out)
    assert kept == pytest.approx(total / 1e6, abs=0.051)
    assert of_checkpoints == pytest.approx(checkpoints / 1e6, abs=0.051) and of_checkpoints < kept
    assert res.stdout.strip().endswith("2 runs, the last checkpoint of each, and older ones of 1")


def test_keep_checkpoints_all_keeps_them_and_a_bad_value_is_one_line(tmp_path):
    from siamesenorm.config import PRESET_DIR
    from siamesenorm.experiments.disk import keep_last_checkpoint

    tiny = yaml.safe_load((PRESET_DIR / "tiny.yaml").read_text())
    preset, out = tmp_path / "keep.yaml", tmp_path / "exp"
    preset.write_text(yaml.safe_dump({**tiny, "compare": {"schemes": ["pre"], "keep_checkpoints": "some"}}))
    res = run("compare", str(preset), "--out", str(out))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "compare.keep_checkpoints must be last" in res.stderr and "'some'" in res.stderr
    assert not out.exists()
    preset.write_text(yaml.safe_dump({**tiny, "compare": {"schemes": ["pre"], "keep_checkpoints": "all"}}))
    res = run("compare", str(preset), "train.steps=3", "train.eval_every=3", "train.checkpoint_every=1",
              "--jobs", "1", "--out", str(out))
    assert res.returncode == 0, res.stderr
    run_dir = out / "pre-lr0.001-s0"
    assert _checkpoint_folders(run_dir) == ["last", "step_2"]      # train.keep_checkpoints: 2
    assert res.stdout.strip().endswith("1 run, its last checkpoint, and older ones of 1 "
                                       "(compare.keep_checkpoints: all)")
    # What `last` does to a run as it ends: only a cleanly finished one loses its step folders,
    # and only those it wrote.
    summary = json.loads((run_dir / "summary.json").read_text())
    for unfinished in ({"interrupted": True}, {"diverged": True, "failed": True},
                       {"stalled": True, "failed": True}, {"checkpoint_step": 2}):
        keep_last_checkpoint(run_dir, {**summary, **unfinished})
        assert _checkpoint_folders(run_dir) == ["last", "step_2"]
    (run_dir / "checkpoints" / "step_1").mkdir()
    (run_dir / "checkpoints" / "step_1" / "notes.txt").write_text("a person's, not the run's")
    keep_last_checkpoint(run_dir, summary)
    assert _checkpoint_folders(run_dir) == ["last", "step_1"]
