"""``siamesenorm analyze`` end to end on a tiny trained run, its one-line errors, probes written by a
run, and the diagnostics section of a comparison's report."""

from __future__ import annotations

import json
import re

import pytest

from siamesenorm.analysis import mean_loss, read_probes
from siamesenorm.analysis.report_section import rms_growth
from siamesenorm.cli import main
from siamesenorm.data import validation_batches
from siamesenorm.experiments import compare
from siamesenorm.run import run_training
from siamesenorm.tasks import load_config, load_trained
from siamesenorm.tasks.lm import analysis_tokens
from test_cli import run

PLOTS = ("hidden_rms.png", "grad_norm.png", "gains.png", "pruning.png", "logit_lens.png", "angular.png")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny SiameseNorm run with probes every 2 steps and no analysis at the end."""
    out = tmp_path_factory.mktemp("analyze") / "run"
    cfg = load_config("tiny", ["model.scheme=siamese", "train.steps=6", "train.eval_every=3",
                               "analysis.every=2", "analysis.at_end=false"])
    run_training(cfg, out, progress=False)
    return out


def test_a_run_with_probes_writes_probes_jsonl(trained):
    records = read_probes(trained)
    assert [r["step"] for r in records] == [2, 4, 6]
    assert set(records[0]["rms"]) == {"x", "y"} and len(records[0]["rms"]["x"]) == 5
    assert len(records[0]["grad_norm_blocks"]) == 2
    assert not (trained / "analysis.json").exists()       # at_end=false


def test_analyze_command_end_to_end(trained, tmp_path):
    out = tmp_path / "out"
    res = run("analyze", str(trained), "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "effective depth" in res.stdout and "analysis.json" in res.stdout
    result = json.loads((out / "analysis.json").read_text())
    assert result["scheme"] == "siamese" and result["n_layers"] == 2 and result["data"] == "validation"
    assert len(result["pruning"]["per_block"]) == 2 and len(result["pruning"]["depth_curve"]) == 3
    assert set(result["lens"]["agreement"]) == {"x", "y"} and result["lens"]["positions"] == 2 * 4 * 32
    assert all(0 <= v <= 1 for v in result["angular"]["x"] + result["angular"]["y"])
    assert "merge_norm_x" in result["probes"]["gains"] and len(result["probes"]["rms"]["y"]) == 5
    for png in PLOTS:
        assert f"analysis/{png}" in result["plots"] and (out / "analysis" / png).stat().st_size > 1000
    # It analysed the run's own validation batches: the same loss the run logged at its last step.
    summary = json.loads((trained / "summary.json").read_text())
    assert result["loss"] == pytest.approx(summary["final_val_loss"], abs=1e-5)
    model, cfg = load_trained(trained)
    batches = validation_batches(analysis_tokens(trained, cfg), 4, 32, cfg.analysis.batches)
    assert result["pruning"]["base_loss"] == pytest.approx(mean_loss(model, batches), abs=1e-6)


def test_analyze_reads_other_data_with_the_runs_tokenizer(trained, tmp_path, capsys):
    data = tmp_path / "text.txt"
    data.write_text("def f(x):\n    return x * 2\n" * 40)
    assert main(["analyze", str(trained), "--data", str(data), "--batches", "1",
                 "--out", str(tmp_path / "o")]) == 0
    result = json.loads((tmp_path / "o" / "analysis.json").read_text())
    assert result["data"] == str(data) and result["batches"] == 1
    assert result["lens"]["positions"] == 4 * 32


def _error(args: list[str], capsys) -> str:
    assert main(args) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    return err


def test_analyze_user_errors_are_one_line_with_exit_status_2(trained, tmp_path, capsys):
    assert "does not exist" in _error(["analyze", str(tmp_path / "nowhere")], capsys)
    bare = tmp_path / "bare"
    bare.mkdir()
    assert "not a run directory" in _error(["analyze", str(bare)], capsys)
    (bare / "config.yaml").write_text((trained / "config.yaml").read_text())
    assert "no checkpoint" in _error(["analyze", str(bare)], capsys)
    out = ["--out", str(tmp_path / "o")]
    assert "does not exist" in _error(["analyze", str(trained), "--data", str(tmp_path / "no.txt"), *out],
                                      capsys)
    short = tmp_path / "short.txt"
    short.write_text("too short")
    assert "fewer than batch_size" in _error(["analyze", str(trained), "--data", str(short), *out], capsys)
    assert "--batches must be positive" in _error(["analyze", str(trained), "--batches", "0", *out], capsys)
    afile = tmp_path / "afile"
    afile.write_text("keep me")
    assert f"--out {afile} is a file" in _error(["analyze", str(trained), "--out", str(afile)], capsys)
    assert "which is a file" in _error(["analyze", str(trained), "--out", str(afile / "sub")], capsys)
    assert afile.read_text() == "keep me"
    assert not (tmp_path / "o").exists() and not (bare / "analysis.json").exists()


def test_compare_report_has_the_diagnostics_section_with_its_plots(tmp_path):
    out = tmp_path / "exp"
    compare("tiny", ["train.steps=4", "train.eval_every=2", "analysis.every=2"], out,
            schemes=["pre", "siamese"], log=lambda *a: None)
    report = (out / "report.md").read_text()
    section = report[report.index("## Diagnostics"):]
    for png in ("diag_hidden_rms.png", "diag_grad_norm.png", "diag_pruning.png"):
        assert f"]({png})" in section and (out / png).stat().st_size > 1000
    runs = {name: json.loads((out / name / "analysis.json").read_text())
            for name in ("pre-lr0.001-s0", "siamese-lr0.001-s0")}
    for name, analysis in runs.items():   # analysed as each run finished, on its validation batches
        summary = json.loads((out / name / "summary.json").read_text())
        assert analysis["loss"] == pytest.approx(summary["final_val_loss"], abs=1e-5)
    # The sentences name the runs and numbers the analyses hold.
    mean = {n: sum(a["pruning"]["per_block"]) / 2 for n, a in runs.items()}
    most = max(mean, key=mean.get)
    assert f"raises the validation loss most for {most} ({mean[most]:+.3g} on average" in section
    growth = [(n, s, g) for n, a in runs.items() for s, g in rms_growth(a["probes"]["rms"], 2).items()]
    name, stream, value = max(growth, key=lambda t: t[2])
    assert f"grows most in {name} (stream {stream}, x{value:.3g})" in section
    peak = max((json.loads(line)["grad_norm"], n) for n in runs
               for line in (out / n / "metrics.jsonl").read_text().splitlines()
               if json.loads(line)["step"] > 2)
    assert re.search(rf"largest gradient norm is {peak[0]:.3g} \({peak[1]}, step \d+\)", section)
    assert "| siamese-lr0.001-s0 |" in section and "merge_norm_x" in section


# ---- presets for the paper's tables -------------------------------------------------------------
def _grid(preset: str) -> list:
    from siamesenorm.experiments import build_grid

    return build_grid(preset, [])[2]


def _cells(preset: str) -> dict:
    return {c.variant.label: c for c in _grid(preset)}


@pytest.mark.parametrize("suffix", ["", "-gpu"])
def test_table_presets_lay_out_the_papers_grids(suffix):
    import dataclasses

    import torch

    from siamesenorm.models import LanguageModel

    t1 = _cells("table1" + suffix)
    assert set(t1) == {"pre", "post", "deepnorm", "hybridnorm", "spannorm", "resi_dual", "hyper", "siamese"}
    lrs = sorted({c.lr for c in _grid("table1" + suffix)})
    assert [lr / lrs[0] for lr in lrs] == pytest.approx([1, 2.5, 5])    # as 4e-4, 1e-3, 2e-3
    assert t1["siamese"].config.model.scheme_options == {"form": "hybrid_pre"}

    t3 = {label: c.config.model.scheme_options for label, c in _cells("table3" + suffix).items()}
    combos = {(o["topology"] if "topology" in o else "siamese", o["input_norm"], o["depth_scale"])
              for o in t3.values()}
    assert combos == {("single", True, False), ("single", True, True), ("resi_dual", True, False),
                      ("siamese", False, False), ("siamese", True, False), ("siamese", False, True),
                      ("siamese", True, True)}                          # the seven rows of Table 3
    assert all(o["form"] == "hybrid_pre" for o in t3.values())

    t2 = _cells("table2" + suffix)
    sizes = {}
    for label, cell in t2.items():
        with torch.device("meta"):
            model = LanguageModel(dataclasses.replace(cell.config.model, vocab_size=256), device="meta")
        sizes[label] = (cell.config.model.n_layers, model.num_parameters(non_embedding=True))
    depths = sorted({n for n, _ in sizes.values()})
    assert len(depths) == 4 and {label.split("-")[0] for label in t2} == {"pre", "siamese"}
    params = [p for _, p in sizes.values()]
    assert max(params) / min(params) < 1.2                              # a fixed parameter budget


def test_rms_growth_leaves_out_streams_without_finite_values():
    rms = {"x": [1.0, 2.0, 3.0, 4.0, 8.0], "y": [1.0, 2.0, 3.0, 4.0, None], "z": [1.0, 1.0, 0.0, 1.0, 1.0]}
    assert rms_growth(rms, 2) == {"x": 8.0 / 3.0}


def test_report_plots_keep_one_colour_per_scheme_and_one_panel_per_learning_rate(tmp_path):
    from siamesenorm.analysis.report_section import _Layout, _plot_grads

    runs = [{"run": f"{s}-lr{lr}-s{seed}", "scheme": s, "lr": lr, "seed": seed, "rms": None, "per": 2,
             "grads": [(1, 1.0), (2, 0.5)], "warmup": 0, "pruning": None, "analysis": None}
            for lr in (2e-3, 1e-2) for s in ("pre", "post", "siamese") for seed in (0, 1)]
    layout = _Layout(runs)
    assert layout.lrs == [2e-3, 1e-2]
    colours = {(r["scheme"], layout.color(r)) for r in runs}
    assert len(colours) == 3 and len({c for _, c in colours}) == 3     # a scheme keeps its colour
    assert {layout.style(r) for r in runs if r["scheme"] == "pre"} == {"-", "--"}   # seeds by style
    fig, panels = layout.figure("t", "x", "y")
    assert len(panels) == 2 and set(panels) == {2e-3, 1e-2}
    assert (tmp_path / _plot_grads(tmp_path, runs)).stat().st_size > 1000
