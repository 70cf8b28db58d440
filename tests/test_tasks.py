"""The image tasks end to end through the command line: ``task=vit`` and ``task=dit`` runs,
their figures, sample grids, resume, compare, and the errors a user can cause."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from siamesenorm.config import load_config
from siamesenorm.errors import ConfigError
from siamesenorm.experiments.grid import run_name
from test_cli import run

pytest.importorskip("sklearn")


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_tiny_vit_learns_the_digits_within_seconds(tmp_path):
    out = tmp_path / "vit"
    res = run("train", "vit-digits", "train.steps=150", "train.eval_every=150", "train.lr=2e-3",
              "train.warmup=10", "--out", str(out))
    assert res.returncode == 0, res.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_val_acc"] > 0.5          # chance is 0.1
    assert summary["tokens_seen"] == 150 * 64 * (1 + 16)  # class token + 4x4 patches, not pixels
    cfg = load_config(str(out / "config.yaml"))
    assert (cfg.task, cfg.model.image_size, cfg.model.in_chans, cfg.model.num_classes) == ("vit", 8, 1, 10)


def test_vit_resume_continues_exactly(tmp_path):
    straight, split = tmp_path / "straight", tmp_path / "split"
    common = ("vit-digits", "train.eval_every=4", "train.checkpoint_every=3", "model.n_layers=2")
    assert run("train", *common, "train.steps=6", "--out", str(straight)).returncode == 0
    assert run("train", *common, "train.steps=3", "--out", str(split)).returncode == 0
    cfg = (split / "config.yaml").read_text().replace("steps: 3\n", "steps: 6\n", 1)
    (split / "config.yaml").write_text(cfg)
    res = run("train", "--resume", "--out", str(split))
    assert res.returncode == 0, res.stderr
    assert [r["loss"] for r in _rows(split)] == [r["loss"] for r in _rows(straight)]


def test_dit_run_writes_sample_grids_and_fd_proxy_scores(tmp_path, monkeypatch):
    monkeypatch.setenv("SIAMESENORM_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "dit"
    res = run("train", "dit-digits", "train.steps=30", "train.eval_every=15", "train.warmup=3",
              "diffusion.eval_samples=40", "diffusion.sample_steps=5", "diffusion.grid_per_class=2",
              "--out", str(out))
    assert res.returncode == 0, res.stderr
    rows = _rows(out)
    assert rows[-1]["loss"] < rows[0]["loss"]
    evals = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in evals] == [15, 30]
    for r in evals:
        assert r["fd_proxy"] > 0 and 0 <= r["sample_acc"] <= 1 and r["proxy_acc"] > 0.8
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    for step in (15, 30):
        png = out / "samples" / f"step_{step}.png"
        assert png.stat().st_size > 100
    from PIL import Image

    assert Image.open(out / "samples" / "step_30.png").size[1] > Image.open(
        out / "samples" / "step_30.png").size[0]  # 10 class rows of 2 samples: taller than wide
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_fd_proxy"] == evals[-1]["fd_proxy"]
    assert any((tmp_path / "cache").rglob("*.safetensors"))  # the proxy was cached


def test_compare_of_vits_reports_accuracy(tmp_path):
    out = tmp_path / "exp"
    res = run("compare", "vit-digits", "train.steps=4", "train.eval_every=4", "model.n_layers=2",
              "--schemes", "pre,siamese", "--lrs", "1e-3", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "top-1 accuracy" in res.stdout
    rows = list(csv.DictReader(open(out / "summary.csv")))
    assert [r["scheme"] for r in rows] == ["pre", "siamese"]
    assert all(0 <= float(r["final_val_acc"]) <= 1 for r in rows)


@pytest.mark.parametrize("args, fragment", [
    (("task=vit", "data.dataset=/no/such/folder"), "does not exist"),
    (("task=vision",), "task: unknown value 'vision'; choose one of lm, vit, dit"),
    (("task=vit", "data.augment.translate=-1"), "must not be negative"),
    (("task=dit", "diffusion.sampler=euler"), "diffusion.sampler: unknown value 'euler'"),
    (("task=dit", "diffusion.sample_steps=2000"), "exceeds diffusion.timesteps"),
    (("task=vit", "data.dataset_options.size=3"), "has no option 'size'"),
    (("task=vit", "model.vocab_size=3"), "unknown key 'model.vocab_size'"),
])
def test_image_task_mistakes_are_one_line_exit_2(tmp_path, args, fragment):
    out = tmp_path / "run"
    res = run("train", *args, "--out", str(out))
    assert res.returncode == 2 and fragment in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert not (out / "metrics.jsonl").exists()


def test_bad_image_files_are_refused_before_training(tmp_path):
    bad = tmp_path / "bad.npz"
    np.savez(bad, images=np.zeros((4, 8, 8), np.uint8), labels=np.zeros(3, np.int64))
    res = run("train", "task=vit", f"data.dataset={bad}", "--out", str(tmp_path / "r1"))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    folder = tmp_path / "flat"
    folder.mkdir()
    (folder / "a.png").write_bytes(b"not a png")
    res = run("train", "task=vit", f"data.dataset={folder}", "--out", str(tmp_path / "r2"))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    for name in ("r1", "r2"):
        assert not (tmp_path / name / "metrics.jsonl").exists()


def test_task_picks_the_configuration_class_wherever_it_is_set(tmp_path):
    assert load_config(None, ["task=dit"]).diffusion.timesteps == 1000
    preset = tmp_path / "p.yaml"
    preset.write_text("model: {dim: 32, n_heads: 2}\ntask: vit\n")
    assert load_config(str(preset)).model.dim == 32
    with pytest.raises(ConfigError, match="unknown key 'diffusion.timesteps'"):
        load_config(None, ["task=vit", "diffusion.timesteps=10"])


def test_image_runs_record_probes_and_analyze_reads_them(tmp_path, monkeypatch):
    monkeypatch.setenv("SIAMESENORM_CACHE", str(tmp_path / "cache"))
    vit, dit = tmp_path / "vit", tmp_path / "dit"
    assert run("train", "vit-digits", "train.steps=4", "train.eval_every=4", "model.n_layers=2",
               "model.scheme=siamese", "analysis.every=2", "--out", str(vit)).returncode == 0
    probes = [json.loads(x) for x in (vit / "probes.jsonl").read_text().splitlines()]
    assert [p["step"] for p in probes] == [2, 4] and set(probes[0]["rms"]) == {"x", "y"}
    analysis = json.loads((vit / "analysis.json").read_text())
    assert set(analysis["lens"]["agreement"]) == {"x", "y"} and len(analysis["pruning"]["per_block"]) == 2
    assert run("train", "dit-digits", "train.steps=2", "train.eval_every=2", "model.n_layers=2",
               "diffusion.eval_samples=10", "diffusion.sample_steps=2", "--out", str(dit)).returncode == 0
    res = run("analyze", str(dit), "--out", str(tmp_path / "dit-analysis"))
    assert res.returncode == 0, res.stderr
    assert "no logit lens" in res.stdout
    result = json.loads((tmp_path / "dit-analysis" / "analysis.json").read_text())
    assert result["lens"] is None and len(result["pruning"]["per_block"]) == 2


def test_dit_compare_report_shows_fd_proxy_and_a_sample_grid_per_scheme(tmp_path, monkeypatch):
    monkeypatch.setenv("SIAMESENORM_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "exp"
    res = run("compare", "dit-digits", "train.steps=2", "train.eval_every=2", "model.n_layers=2",
              "diffusion.eval_samples=10", "diffusion.sample_steps=2", "--out", str(out))
    assert res.returncode == 0, res.stderr
    assert "FD-proxy" in res.stdout
    report = (out / "report.md").read_text()
    assert "| FD-proxy | sample acc |" in report
    for png in ("fd_proxy.png", "sample_acc.png"):
        assert f"]({png})" in report and (out / png).stat().st_size > 1000
    lr = load_config("dit-digits").train.lr
    for scheme in ("pre", "siamese"):
        grid = f"{run_name(scheme, lr, 0)}/samples/step_2.png"
        assert f"]({grid})" in report and (out / grid).is_file()
