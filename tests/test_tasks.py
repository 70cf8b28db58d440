"""The image tasks end to end through the command line: ``task=vit`` and ``task=dit`` runs,
their figures, sample grids, resume, compare, and the errors a user can cause."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from siamesenorm.errors import ConfigError
from siamesenorm.experiments.grid import run_name
from siamesenorm.tasks import load_config
from test_cli import run

pytest.importorskip("sklearn")


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def proxy_cache(tmp_path_factory) -> Path:
    """One cache folder (``SIAMESENORM_CACHE``) for this file's DiT runs, away from the user's:
    the FD proxy is trained by the first and loaded by the others (its training is deterministic:
    tests/test_fid_proxy.py, which also tests the cache itself)."""
    return tmp_path_factory.mktemp("cache")


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


def test_dit_run_writes_sample_grids_and_fd_proxy_scores(tmp_path, monkeypatch, proxy_cache):
    monkeypatch.setenv("SIAMESENORM_CACHE", str(proxy_cache))
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
    assert any(proxy_cache.rglob("*.safetensors"))  # the proxy is cached (by this run or this file's first)


def test_compare_of_vits_reports_accuracy(tmp_path):
    out = tmp_path / "exp"
    res = run("compare", "vit-digits", "train.steps=4", "train.eval_every=4", "model.n_layers=2",
              "--schemes", "pre,siamese", "--lrs", "1e-3", "--seeds", "0", "--out", str(out))
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
    (("task=dit", "diffusion.timesteps=20", "diffusion.sample_steps=10"),
     "scales beta_end 0.02 by 1000/20 to 1 >= 1; use at least 21 timesteps"),
    (("task=vit", "data.augment.smoothing=0.1"), "only smooths mixup/cutmix targets"),
    (("task=vit", "data.augment.mixup_alpha=0.8", "data.augment.smoothing=0.2"), "disagree"),
    (("task=vit", "data.dataset_options.size=3"), "has no option 'size'"),
    (("task=vit", "model.vocab_size=3"), "unknown key 'model.vocab_size'"),
])
def test_image_task_mistakes_are_one_line_exit_2(tmp_path, args, fragment):
    out = tmp_path / "run"
    res = run("train", *args, "--out", str(out))
    assert res.returncode == 2 and fragment in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert not out.exists()


def _npz(path, images, labels):
    np.savez(path, images=images, labels=np.asarray(labels, np.int64))
    return path


def _bad_sets(tmp_path):
    """name -> (overrides, message fragment) for image sets a run must refuse."""
    rng = np.random.default_rng(0)
    grey = rng.integers(0, 256, (20, 8, 8), dtype=np.uint8)
    two = [0, 1] * 10
    flat = tmp_path / "flat"                    # images but no class sub-folders
    flat.mkdir()
    (flat / "a.png").write_bytes(b"not a png")
    corrupt = tmp_path / "corrupt"              # a class folder holding a file that is not an image
    for name in ("a", "b"):
        (corrupt / name).mkdir(parents=True)
    Image = pytest.importorskip("PIL.Image")
    Image.new("L", (8, 8), 255).save(corrupt / "a" / "ok.png")
    (corrupt / "b" / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n truncated")
    single = tmp_path / "single"                # one class folder only
    (single / "only").mkdir(parents=True)
    for i in range(4):
        Image.new("L", (8, 8), 60 * i).save(single / "only" / f"{i}.png")
    return {
        "mismatched labels": ((f"data.dataset={_npz(tmp_path / 'm.npz', grey[:4], [0, 1, 0])}",),
                              "4 images but labels of shape (3,)"),
        "flat folder": ((f"data.dataset={flat}",), "has no class sub-folders"),
        "corrupt image": ((f"data.dataset={corrupt}", "data.dataset_options.image_size=8",
                           "data.dataset_options.channels=1"),
                          f"cannot read image {corrupt / 'b' / 'bad.png'}"),
        "one class npz": ((f"data.dataset={_npz(tmp_path / 'one.npz', grey, [3] * 20)}",
                           "data.dataset_options.num_classes=5"), "every image is of one class ('3')"),
        "one class folder": ((f"data.dataset={single}", "data.dataset_options.image_size=8"),
                             "every image is of one class ('only')"),
        "stray label": ((f"data.dataset={_npz(tmp_path / 'stray.npz', grey, two[:-1] + [10**9])}",),
                        "more than the 100000 supported"),
        "sparse labels": ((f"data.dataset={_npz(tmp_path / 'sparse.npz', grey, [0, 7] * 10)}",),
                          "only 2 of those 8 classes have an image"),
    }


@pytest.mark.parametrize("task", ["vit", "dit"])
@pytest.mark.parametrize("case", ["mismatched labels", "flat folder", "corrupt image", "one class npz",
                                  "one class folder", "stray label", "sparse labels"])
def test_bad_image_sets_are_refused_before_anything_is_written(tmp_path, task, case):
    args, fragment = _bad_sets(tmp_path)[case]
    out = tmp_path / "run"
    res = run("train", f"task={task}", *args, "--out", str(out))
    assert res.returncode == 2 and fragment in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not out.exists()


@pytest.mark.parametrize("task", ["vit", "dit"])
def test_compare_refuses_bad_image_data_before_claiming_its_folder(tmp_path, task):
    args, fragment = _bad_sets(tmp_path)["sparse labels"]
    out = tmp_path / "exp"
    res = run("compare", f"{task}-digits", *args, "--out", str(out))
    assert res.returncode == 2 and fragment in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not out.exists()           # no experiment.json: a corrected command may use the folder


@pytest.mark.parametrize("channels", [4, 2])
def test_dit_refuses_images_a_sample_grid_cannot_show(tmp_path, channels):
    images = np.random.default_rng(0).integers(0, 256, (20, channels, 8, 8), dtype=np.uint8)
    data = _npz(tmp_path / "c.npz", images, [0, 1] * 10)
    out = tmp_path / "run"
    res = run("train", "dit-digits", f"data.dataset={data}", "data.dataset_options.layout=nchw",
              "--out", str(out))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert f"images have {channels} channels; task=dit draws its samples as a grey (1 channel) or RGB " \
           "(3 channel) PNG grid" in res.stderr
    assert not out.exists()


@pytest.mark.parametrize("setting", ["data.augment.mixup_alpha=0.8", "data.augment.cutmix_alpha=1.0"])
def test_dit_refuses_mixup_and_cutmix_up_front(tmp_path, setting):
    out = tmp_path / "run"
    res = run("train", "dit-digits", setting, "--out", str(out))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "make soft class targets, which a DiT cannot take" in res.stderr
    assert not out.exists()


def test_an_unreadable_image_folder_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    """The CLI in process, with listing the folder failing as it does without read permission
    (the tests may run as root, which chmod does not stop)."""
    from pathlib import Path

    from siamesenorm.cli import main

    root = tmp_path / "images"
    (root / "a").mkdir(parents=True)
    real = Path.iterdir

    def iterdir(self):
        if self == root:
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    out = tmp_path / "run"
    assert main(["train", "task=vit", f"data.dataset={root}", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"cannot read {root} while reading an image folder: Permission denied" in err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


def _first_targets(preset, *overrides):
    from siamesenorm.tasks.vit import load_vit_data

    cfg = load_config(preset, ["data.dataset=digits", "data.dataset_options={}", "data.batch_size=32",
                               "data.val_batches=1", *overrides])
    x, y = load_vit_data(cfg).batches(cfg).next_batch()
    assert y.shape == (32, 10) and y.dtype.is_floating_point   # mixed soft targets
    torch.testing.assert_close(y.sum(1), torch.ones(32))
    return y


def test_label_smoothing_reaches_the_mixed_targets():
    """Under mixup/cutmix every class keeps at least smoothing / K of each target (DeiT's
    Mixup(label_smoothing=0.1)); without smoothing, classes absent from both images get 0."""
    # The DeiT-T preset (its data swapped for digits): smoothing 0.1 over 10 classes.
    assert _first_targets("deit-tiny").min() >= 0.1 / 10 - 1e-7
    mix = ("data.augment.mixup_alpha=0.8", "data.augment.cutmix_alpha=1.0")
    # model.label_smoothing alone (data.augment.smoothing left 0) is folded in, not dropped.
    assert _first_targets("vit-digits", *mix, "model.label_smoothing=0.2").min() >= 0.2 / 10 - 1e-7
    assert _first_targets("vit-digits", *mix, "data.augment.smoothing=0.1",
                          "model.label_smoothing=0").min() >= 0.1 / 10 - 1e-7
    assert _first_targets("vit-digits", *mix, "model.label_smoothing=0").min() == 0


def test_task_picks_the_configuration_class_wherever_it_is_set(tmp_path):
    assert load_config(None, ["task=dit"]).diffusion.timesteps == 1000
    preset = tmp_path / "p.yaml"
    preset.write_text("model: {dim: 32, n_heads: 2}\ntask: vit\n")
    assert load_config(str(preset)).model.dim == 32
    with pytest.raises(ConfigError, match="unknown key 'diffusion.timesteps'"):
        load_config(None, ["task=vit", "diffusion.timesteps=10"])


def test_image_runs_record_probes_and_analyze_reads_them(tmp_path, monkeypatch, proxy_cache):
    monkeypatch.setenv("SIAMESENORM_CACHE", str(proxy_cache))
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
    # Data the model cannot take is refused in one line, before any analysis: other channels, or
    # classes beyond the model's.
    rng = np.random.default_rng(0)
    rgb = _npz(tmp_path / "rgb.npz", rng.integers(0, 256, (20, 3, 8, 8), dtype=np.uint8), [0, 1] * 10)
    many = _npz(tmp_path / "many.npz", rng.integers(0, 256, (24, 8, 8), dtype=np.uint8), list(range(12)) * 2)
    for data, fragment in ((rgb, "3 channels, the run's model takes 1"), (many, "knows 10 classes")):
        res = run("analyze", str(dit), "--data", str(data), "--out", str(tmp_path / "refused"))
        assert res.returncode == 2 and fragment in res.stderr and len(res.stderr.strip().splitlines()) == 1
        assert not (tmp_path / "refused").exists()


def test_dit_compare_report_shows_fd_proxy_and_a_sample_grid_per_scheme(tmp_path, monkeypatch, proxy_cache):
    monkeypatch.setenv("SIAMESENORM_CACHE", str(proxy_cache))
    out = tmp_path / "exp"
    res = run("compare", "dit-digits", "train.steps=2", "train.eval_every=2", "model.n_layers=2",
              "diffusion.eval_samples=10", "diffusion.sample_steps=2", "--seeds", "0", "--out", str(out))
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
