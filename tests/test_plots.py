"""What the plots show: a scheme's colour in every plot of an experiment, a learning rate's line style,
the unigram and chance lines, legends off the data, integer block ticks, markers on short lines,
flat cells marked, and a sample grid with gaps and class labels. Built by hand: no training."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import yaml

from siamesenorm.analysis import style
from siamesenorm.analysis.plots import analysis_figures
from siamesenorm.analysis.report_section import collect, grads_figure, rms_figure
from siamesenorm.diffusion.grid import class_labels, image_grid, save_image_grid
from siamesenorm.experiments import stats
from siamesenorm.experiments.report import curves_figure, expert_load_figure, grid_figure, write_report

SCHEMES, LRS, SEEDS = ["pre", "post", "siamese"], [1e-3, 1e-2], [0, 1]
UNIGRAM = 4.6


def _experiment(out, classes: int | None = None) -> list[dict]:
    """Run folders and compare rows of 3 schemes x 2 lrs x 2 seeds: post at 1e-2 diverges (seed 0)
    and stays at the unigram plateau (seed 1); pre at 1e-3 got worse after its best (seed 0)."""
    rows = []
    for s_i, scheme in enumerate(SCHEMES):
        for lr in LRS:
            for seed in SEEDS:
                run = f"{scheme}-lr{lr:g}-s{seed}"
                folder = out / run
                folder.mkdir(parents=True)
                diverged = scheme == "post" and lr == 1e-2 and seed == 0
                flat = scheme == "post" and lr == 1e-2 and seed == 1
                steps = [10, 20, 30, 40] if diverged else [10, 20, 30, 40, 50, 60]
                slope = 0.4 + 0.1 * s_i + 10 * lr
                losses = [UNIGRAM + 0.3 + 0.01 * k if flat else 6.0 - slope * k + 0.05 * seed
                          for k in range(len(steps))]
                if diverged:
                    losses[-1] = 40.0
                metrics = [{"step": st, "loss": v, "val_loss": v, "grad_norm": 1.0 + 0.1 * seed,
                            "val_acc": 0.1 + 0.1 * k, "expert_load": [[0.5 - 0.1 * s_i, 0.5 + 0.1 * s_i]]}
                           for k, (st, v) in enumerate(zip(steps, losses))]
                (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
                config = {"task": "lm", "train": {"warmup": 0}}
                if classes:
                    config["model"] = {"num_classes": classes}
                (folder / "config.yaml").write_text(yaml.safe_dump(config))
                rms = {"x": [1.0, 1.5, 2.0, 2.5, 3.0], "y": [1.0, 1.1, 1.2, 1.3, 1.4]} \
                    if scheme == "siamese" else {"h": [1.0, 2.0, 3.0, 4.0, 5.0]}
                (folder / "probes.jsonl").write_text(json.dumps({"step": 60, "rms": rms}) + "\n")
                final = None if diverged else losses[-1]
                best = 3.0 if (scheme, lr, seed) == ("pre", 1e-3, 0) else final
                rows.append({"run": run, "scheme": scheme, "lr": lr, "seed": seed,
                             "final_val_loss": final, "best_val_loss": best, "diverged": diverged,
                             "diverged_at": 40 if diverged else None, "stalled_at": None,
                             "steps": steps[-1], "tokens_per_s": 100.0, "num_parameters": 1000,
                             "max_grad_norm": 1.1, "max_grad_norm_step": 10,
                             "unigram_val_loss": UNIGRAM})
    for row in rows:
        row["plateau"] = stats.at_plateau(row)
    return rows


def _cells(fig) -> dict[str, tuple]:
    """``gid`` (scheme and lr) -> the (colour, line style) its lines share; fails if they differ."""
    from matplotlib.colors import to_hex

    out: dict[str, set] = {}
    for ax in fig.axes:
        for line in ax.get_lines():
            if line.get_gid():
                out.setdefault(line.get_gid(), set()).add((to_hex(line.get_color()), line.get_linestyle()))
    assert all(len(v) == 1 for v in out.values()), out
    return {k: next(iter(v)) for k, v in out.items()}


@pytest.fixture(scope="module")
def experiment(tmp_path_factory):
    out = tmp_path_factory.mktemp("exp")
    return out, _experiment(out, classes=10)


def test_a_scheme_keeps_its_colour_and_a_learning_rate_its_style_across_plots(experiment):
    out, rows = experiment
    figures = [curves_figure(out, rows, "val_loss", "validation loss", SCHEMES),
               expert_load_figure(out, rows, SCHEMES),
               grads_figure(collect(out, rows), SCHEMES), rms_figure(collect(out, rows), SCHEMES)]
    seen = [_cells(fig) for fig in figures]
    for cells in seen:
        assert {k for k in cells if "failed" not in k} == {f"{s} lr {lr:g}" for s in SCHEMES for lr in LRS}
        for scheme in SCHEMES:
            assert cells[f"{scheme} lr 0.001"][0] == cells[f"{scheme} lr 0.01"][0] \
                == seen[0][f"{scheme} lr 0.001"][0]                  # one colour per scheme, everywhere
            assert cells[f"{scheme} lr 0.001"][1] != cells[f"{scheme} lr 0.01"][1]   # style is the lr
        assert len({cells[f"{s} lr 0.001"][0] for s in SCHEMES}) == 3
    assert seen[0]["post lr 0.01 failed"][0] == seen[0]["post lr 0.001"][0]


def test_scheme_colours_are_fixed_for_known_schemes_and_distinct_for_the_rest():
    a, b = style.scheme_colours(["pre", "siamese", "v1"]), style.scheme_colours(["v2", "siamese", "pre"])
    assert a["pre"] == b["pre"] and a["siamese"] == b["siamese"]
    many = style.scheme_colours([f"v{i}" for i in range(12)] + ["pre"])
    assert len(set(many.values())) == 13 and style.REFERENCE not in many.values()
    assert list(style.lr_styles([1e-2, 1e-3]).values())[:2] == ["-", "--"]


def test_loss_curves_carry_the_unigram_line_units_and_a_legend_off_the_data(experiment):
    out, rows = experiment
    fig = curves_figure(out, rows, "val_loss", "validation loss", SCHEMES)
    [ax] = fig.axes
    [unigram] = [line for line in ax.get_lines() if line.get_label().startswith("unigram")]
    assert set(unigram.get_ydata()) == {UNIGRAM}
    assert ax.get_xlabel() == "step" and ax.get_ylabel() == "validation loss (nats)"
    assert ax.get_ylim()[1] < 10            # the diverged run (40 nats) does not squash the others
    fig.canvas.draw()
    box, legend = ax.get_window_extent(), ax.get_legend().get_window_extent()
    assert legend.x0 >= box.x1 and {"pre", "lr 0.001", "lr 0.01"} <= {
        t.get_text() for t in ax.get_legend().get_texts()}
    acc = curves_figure(out, rows, "val_acc", "validation top-1 accuracy", SCHEMES)
    [chance] = [line for line in acc.axes[0].get_lines() if line.get_label().startswith("chance")]
    assert set(chance.get_ydata()) == {0.1}


def test_no_chance_line_without_a_class_count(tmp_path):
    rows = _experiment(tmp_path)
    fig = curves_figure(tmp_path, rows, "val_acc", "validation top-1 accuracy", SCHEMES)
    assert not [line for line in fig.axes[0].get_lines() if line.get_label().startswith("chance")]


def test_short_lines_have_markers_and_long_ones_none():
    plt = style.pyplot()
    fig, ax = plt.subplots()
    style.seed_lines(ax, [[(1, 1.0), (2, 0.5)]], "red", "-", gid="short")
    style.seed_lines(ax, [[(k, 1.0 / (k + 1)) for k in range(40)]], "red", "-", gid="long")
    marks = {line.get_gid(): line.get_marker() for line in ax.get_lines()}
    assert marks == {"short": "o", "long": "None"}
    plt.close(fig)


def _analysis() -> dict:
    return {"scheme": "siamese", "n_layers": 3, "sublayers_per_block": 2, "batches": 1, "loss": 2.0,
            "pruning": {"base_loss": 2.0, "per_block": [0.5, 0.1, 0.2], "depth_curve": [1, 0.5, 0.2, 0.0],
                        "effective_depth": 2.1},
            "lens": {"positions": 8, "agreement": {"x": 0.5, "y": 0.7}, "by_depth": {"x": [0.1, 0.5, 0.9],
                     "y": [0.2, 0.6, 1.0]}, "follows": {"x": 0.4, "y": 0.6}, "disagree_fraction": 0.1},
            "angular": {"x": [0.1, 0.2, 0.3], "y": [0.1, 0.1, 0.1]},
            "probes": {"rms": {"x": [1.0 + k for k in range(7)], "y": [1.0] * 7},
                       "gains": {"norm_x": [1.0, 1.1, 1.2], "merge_norm_x": 1.3},
                       "grad_norm": {"blocks": [0.1, 0.2, 0.3]}}}


def test_analysis_plots_tick_blocks_with_integers_and_mark_a_two_point_curve():
    figs = analysis_figures(_analysis(), [{"step": 2, "grad_norm": 1.0}, {"step": 4, "grad_norm": 0.8}])
    for name in ("hidden_rms.png", "pruning.png", "angular.png", "logit_lens.png", "grad_norm.png"):
        ax = figs[name].axes[0]
        figs[name].canvas.draw()
        assert all(float(t).is_integer() for t in ax.get_xticks()), (name, ax.get_xticks())
    [during] = figs["grad_norm.png"].axes[1].get_lines()
    assert during.get_marker() == "o"
    rms = figs["hidden_rms.png"].axes[0]
    assert rms.get_legend().get_window_extent().x0 >= rms.get_window_extent().x1
    style.pyplot().close("all")


def test_log_axes_read_as_plain_numbers(tmp_path):
    """Not 6x10^0: a hidden-state RMS from 1 to 7 reads 1, 2, 3, 4, 6 on its axis."""
    fig = analysis_figures(_analysis(), [])["hidden_rms.png"]
    ax = fig.axes[0]
    ax.set_ylim(1, 7)
    style.plain_log_labels(fig)
    fig.canvas.draw()
    labels = [t.get_text() for t in ax.get_yticklabels() + ax.get_yticklabels(minor=True) if t.get_text()]
    assert {"1", "2", "6"} <= set(labels), labels
    assert all(float(x) > 0 for x in labels), labels        # "$\\mathdefault{6\\times10^{0}}$" before
    style.pyplot().close("all")


def test_the_lr_grid_marks_a_cell_whose_seeds_all_failed_or_went_flat(tmp_path):
    from matplotlib.patches import Rectangle

    rows = _experiment(tmp_path)
    aggregate = stats.aggregate(rows, ["final_val_loss"])
    fig = grid_figure(aggregate, SCHEMES, LRS)
    ax = fig.axes[0]
    hatched = [p for p in ax.patches if isinstance(p, Rectangle) and p.get_hatch()]
    assert [(round(p.get_x() + 0.5), round(p.get_y() + 0.5)) for p in hatched] == [(1, 1)]  # post, 1e-2
    texts = [t.get_text() for t in ax.texts]
    assert any("1/2 diverged" in t and "1/2 flat" in t for t in texts)
    assert "flat" in ax.get_legend().get_texts()[0].get_text()
    rows = [r for r in rows if (r["scheme"], r["lr"]) != ("post", 1e-2)] + \
        [dict(r, run=f"{r['run']}-ok", final_val_loss=1.0, diverged=False, plateau=False)
         for r in rows if (r["scheme"], r["lr"]) == ("post", 1e-2)]
    fig = grid_figure(stats.aggregate(rows, ["final_val_loss"]), SCHEMES, LRS)
    assert not [p for p in fig.axes[0].patches if p.get_hatch()] and fig.axes[0].get_legend() is None
    style.pyplot().close("all")


def test_report_table_shows_the_best_loss_only_where_it_differs(tmp_path):
    rows = _experiment(tmp_path)
    aggregate = stats.aggregate(rows, ["final_val_loss", "best_val_loss"])
    write_report(tmp_path, rows, SCHEMES, LRS, aggregate=aggregate, differences=[], baseline="pre")
    report = (tmp_path / "report.md").read_text()
    table = [line for line in report.splitlines() if line.startswith("| pre-") or line.startswith("| post-")]
    assert "best val loss" not in report.split("## Runs")[1].split("\n\n")[1]
    assert [line.split(" | ")[4] for line in table if "(best" in line] == ["3.9500 (best 3.0000)"]
    assert "more than 1% lower" in report
    for png in ("val_loss.png", "lr_grid.png", "diag_grad_norm.png", "expert_load.png"):
        assert (tmp_path / png).stat().st_size > 1000


def test_the_sample_grid_has_gaps_and_class_labels(tmp_path):
    images = -torch.ones(6, 1, 4, 4)            # black tiles: 3 classes x 2 samples
    plain = image_grid(images, nrow=2, padding=2, upscale=4, pad_value=255)
    assert plain.shape == (3 * 18 + 2, 2 * 18 + 2, 1)
    assert (plain[:, 18:20] == 255).all() and (plain[18:20] == 255).all()   # the gaps between tiles
    assert (plain[2:18, 2:18] == 0).all()
    assert image_grid(images, nrow=2, padding=1)[0].max() == 0                # the old default: black
    labels = class_labels(["0", "1", "cat"])
    assert labels == ["class 0", "class 1", "cat"]
    pytest.importorskip("PIL.Image")
    from PIL import Image

    path = save_image_grid(images, tmp_path / "grid.png", nrow=2, padding=2, upscale=4, pad_value=255,
                           row_labels=labels)
    with Image.open(path) as img:
        arr = np.asarray(img)
    assert arr.shape[0] == plain.shape[0] and arr.shape[1] > plain.shape[1] + 10
    strip = arr[:, : arr.shape[1] - plain.shape[1]]
    assert (arr[:, -plain.shape[1]:] == plain[..., 0]).all()                   # the grid beside it
    for row in range(3):                                                         # ink on every row
        assert strip[2 + row * 18: 18 + row * 18].min() < 128
    with pytest.raises(Exception, match="row labels"):
        save_image_grid(images, tmp_path / "bad.png", nrow=2, row_labels=["a"])
