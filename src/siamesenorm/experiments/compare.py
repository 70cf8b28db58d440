"""``compare``: every (scheme, learning rate, seed) as its own run, then one table and one report
(docs/compare.md). ``summary.json`` holds ``runs``, ``aggregate``, ``differences`` and ``baseline``."""

from __future__ import annotations

import csv
import dataclasses
import io
import json
from collections.abc import Sequence
from pathlib import Path

import torch

from ..config import config_to_dict
from ..devices import check_threads, resolve_device
from ..errors import UserError
from ..locks import LOCK_NAME, check_free, folder_lock
from ..parallel.env import launched_world_size
from ..rundir import RunDir, check_out_dir, read_json, write_text
from ..shapes import EXPERIMENT_ROWS, check, read_summary
from ..tasks import TASKS, get_task
from ..tasks.dryrun import check_fits
from ..tasks.spec import Metric
from ..train.metrics import check_loggers
from . import stats
from .disk import kept_line
from .grid import plan
from .jobs import Concurrency, check_jobs, choose
from .report import write_report
from .training import RunsFailed, Todo, data_key, grad_norm_peak, raise_failures, train_runs

__all__ = ["COLUMNS", "RunsFailed", "compare", "data_key", "grad_norm_peak", "grid_metrics", "read_runs",
           "text_table"]

COLUMNS = ("run", "scheme", "lr", "seed", "final_val_loss", "best_val_loss", "diverged",
           "diverged_at", "stalled_at", "steps", "tokens_per_s", "num_parameters", "max_grad_norm",
           "max_grad_norm_step")


# A run's achieved TFLOP/s a device and MFU (on GPUs, or with train.peak_tflops), when it has them.
SPEED_COLUMNS = ("tflops", "mfu")
# Task-specific figures a run's summary may hold (``final_<name>`` from its evaluations): every
# task's ``columns``, in the registry's order.
EXTRA_COLUMNS = tuple(dict.fromkeys(c for task in TASKS.values() for c in task.columns))


def grid_metrics(grid: list) -> list[Metric]:
    """The figures the tasks of ``grid``'s runs declare (:attr:`Task.metrics`), each once, in order."""
    out: dict[str, Metric] = {}
    for cell in grid:
        for metric in get_task(cell.config.task).metrics:
            out.setdefault(metric.key, metric)
    return list(out.values())


def read_runs(path: str | Path) -> list[dict]:
    """The per-run rows of a ``summary.json``: its ``runs``, or the plain list older versions wrote."""
    data = read_json(path)
    if isinstance(data, list):
        return check(data, EXPERIMENT_ROWS, str(path))
    if isinstance(data, dict) and isinstance(data.get("runs"), list):
        return check(data["runs"], EXPERIMENT_ROWS, f"{path} (its runs)")
    raise UserError(f"{path} is not a comparison's summary (no list of runs); run compare again")


def text_table(rows: list[dict], labels: list[str], lrs: list[float], key: str = "final_val_loss",
               differences: Sequence[dict] = ()) -> str:
    """``key`` per scheme (rows) and learning rate (columns): one seed's figure, ``div@N`` or ``dead@N``;
    over several seeds the mean +- half-width of its 95% interval, then ``k/n div``, ``k/n dead`` and
    ``k/n flat`` when some diverged, stalled or ended at the unigram plateau. Where some entry of
    ``differences`` (:func:`stats.paired_differences`) of ``key`` paired two seeds or more, a
    ``vs BASELINE`` column per learning rate follows, with the difference and its verdict."""
    groups = stats.cells(rows)
    texts = {label: [_cell_text(groups.get((label, lr), []), key) for lr in lrs] for label in labels}
    heads = [f"lr {lr:g}" for lr in lrs]
    widths = [max(12, *(len(ts[j]) for ts in texts.values())) for j in range(len(lrs))]
    diffs = {(d["scheme"], d["lr"]): d for d in differences if d["metric"] == key}
    if any(d["n"] >= 2 for d in diffs.values()):
        base = next(iter(diffs.values()))["baseline"]
        for label in labels:
            texts[label] += [stats.difference_text(diffs[label, lr]) if (label, lr) in diffs else ""
                             for lr in lrs]
        heads += [f"vs {base} at {lr:g}" for lr in lrs]
        widths += [max(len(heads[len(lrs) + j]), *(len(ts[len(lrs) + j]) for ts in texts.values()))
                   for j in range(len(lrs))]
    width = max(len("scheme"), *(len(label) for label in labels))
    lines = [f"{'scheme':<{width}}  " + "  ".join(f"{h:>{w}}" for h, w in zip(heads, widths))]
    lines += [(f"{label:<{width}}  " + "  ".join(f"{t:>{w}}" for t, w in zip(texts[label], widths))).rstrip()
              for label in labels]
    return "\n".join(lines)


def _cell_text(group: list[dict], key: str) -> str:
    if len(group) <= 1:
        if any(r["diverged"] for r in group):
            return f"div@{min(r['diverged_at'] for r in group if r['diverged'])}"
        if any(r.get("stalled_at") is not None for r in group):
            return f"dead@{min(r['stalled_at'] for r in group if r.get('stalled_at'))}"
        vals = [r[key] for r in group if r.get(key) is not None]
        flat = " flat" if _is_loss(key) and any(stats.at_plateau(r) for r in group) else ""
        return f"{sum(vals) / len(vals):.4f}{flat}" if vals else "-"
    [cell] = stats.aggregate(group, [key])
    est = stats.Estimate(**cell["metrics"][key])
    text = "-" if est.mean is None else f"{est.mean:.4f}" + \
        (f"+-{est.half_width:.4f}" if est.half_width is not None else f" (n={est.n})")
    for field, word in (("diverged", "div"), ("stalled", "dead"), ("plateau", "flat")):
        if cell[field] and (field != "plateau" or _is_loss(key)):
            text += f" {cell[field]}/{cell['runs']} {word}"
    return text


def plateau_legend(rows: list[dict]) -> str:
    """What ``flat`` means, with the unigram loss when the runs share one."""
    unigrams = {round(r["unigram_val_loss"], 4) for r in rows if r.get("unigram_val_loss") is not None}
    value = f"{unigrams.pop():.4f}, " if len(unigrams) == 1 else ""
    return (f"flat: the final loss is at or above {1 - stats.PLATEAU_MARGIN:.0%} of the unigram loss "
            f"({value}what knowing only the token frequencies gives): nothing learned beyond them; "
            "such runs stay in the means")


def printed_metrics(metrics: list[Metric], headline: str) -> list[Metric]:
    """The tables printed after the headline's: every other final figure (the best ones are in the report)."""
    return [m for m in metrics if m.key != headline and m.key.startswith("final_")]


def _is_loss(key: str) -> bool:
    return key.endswith("loss")


def _claim(out: Path, spec: dict) -> None:
    """Write ``experiment.json``, or check that the folder holds this same experiment."""
    marker = out / "experiment.json"
    if marker.exists():
        old = read_json(marker)
        if old != spec:
            raise UserError(f"{out} holds another experiment's runs (its experiment.json differs); "
                              "choose another --out")
        return
    if out.exists() and any(p.name != LOCK_NAME for p in out.iterdir()):
        raise UserError(f"{out} is not empty and holds no experiment.json; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    write_text(marker, json.dumps(spec, indent=2) + "\n")


def load_data(cells: list) -> tuple[list, dict]:
    """The cells fitted to their data, and the data of each :func:`data_key`, loaded once up front."""
    loaded: dict = {}
    fitted = []
    for cell in cells:
        cfg, task = cell.config, get_task(cell.config.task)
        key = data_key(cfg)
        if key not in loaded:
            loaded[key] = task.load_data(cfg, None, False)
        fitted.append(dataclasses.replace(cell, config=task.fit(cfg, loaded[key])))
    return fitted, loaded


def compare(preset: str | None, overrides: list[str], out: str | Path, *,
            schemes: list[str] | None = None, lrs: list[float] | None = None,
            seeds: list[int] | None = None, baseline: str | None = None, nproc: int | None = None,
            jobs: int | str | None = None, threads: int | None = None, log=print) -> list[dict]:
    """Train the grid into ``out`` (skipping finished runs) and write the table and the report.

    ``schemes``, ``lrs``, ``seeds``, ``baseline`` and ``jobs`` default to the preset's ``compare``
    section (:mod:`.grid`); ``threads``: each run's (``None``: :func:`~siamesenorm.devices.choose_threads`).
    A failed run does not stop the others; once all have ended the failures are raised in one line
    (:class:`RunsFailed`, or :class:`UserError` when all were a user's errors).
    """
    p = plan(preset, overrides, schemes=schemes, lrs=lrs, seeds=seeds, baseline=baseline)
    threads = check_threads(threads, "--threads")
    concurrency = choose(p.cells, p.jobs if jobs is None else check_jobs(jobs, "--jobs"), nproc=nproc,
                         world_size=launched_world_size(), threads=threads, ceiling=torch.get_num_threads())
    out = Path(out)
    check_out_dir(out)
    check_free(out, "compare")
    if concurrency.jobs > 1:       # the runs at once share this machine's memory
        for cell in p.cells:
            device = resolve_device(cell.config.train.device)
            check_fits(cell.config, device, 1, concurrency.jobs)
    for cell in p.cells:
        check_loggers(cell.config.train.loggers)
    cells, data = load_data(p.cells)
    with folder_lock(out, "compare"):
        return _compare(out, p.base, p.spec, cells, p.baseline, nproc, concurrency, data, log,
                        p.keep_checkpoints, threads)


def _compare(out: Path, base, spec: dict, grid: list, baseline: str, nproc: int | None,
             concurrency: Concurrency, data: dict, log, keep_checkpoints: str = "last",
             threads: int | None = None) -> list[dict]:
    _claim(out, {"base": config_to_dict(base), **spec})
    summaries: dict[str, dict] = {}
    todo = []
    for i, cell in enumerate(grid, 1):
        summary_path = RunDir(out / cell.name).summary
        summary = read_summary(summary_path) if summary_path.exists() else None
        if summary is not None and not summary.get("interrupted"):
            log(f"[{i}/{len(grid)}] {cell.name}: done before, skipped")
            summaries[cell.name] = summary
        else:
            todo.append(Todo(i, cell, out / cell.name, summary))
    if todo:
        trained, failures = train_runs(todo, len(grid), concurrency, nproc, data, log, keep_checkpoints,
                                       threads)
        summaries.update(trained)
        if failures:
            raise_failures(failures, len(grid))
    rows = []
    for cell in grid:
        name, summary, run_dir = cell.name, summaries[cell.name], out / cell.name
        peak = grad_norm_peak(run_dir)
        rows.append({"run": name, "scheme": cell.variant.label, "lr": cell.lr, "seed": cell.seed,
                     **{k: summary.get(k) for k in COLUMNS[4:-2]},
                     "max_grad_norm": peak[0], "max_grad_norm_step": peak[1],
                     **{k: summary[k] for k in (*SPEED_COLUMNS, *EXTRA_COLUMNS)
                        if summary.get(k) is not None},
                     **({"unigram_val_loss": summary["unigram_val_loss"],
                         "plateau": stats.at_plateau(summary)} if "unigram_val_loss" in summary else {}),
                     "data": summary.get("data")})
    extra = [k for k in (*SPEED_COLUMNS, *EXTRA_COLUMNS, "unigram_val_loss", "plateau")
             if any(k in r for r in rows)]
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=COLUMNS + tuple(extra), restval="", extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    write_text(out / "summary.csv", table.getvalue())
    metrics = stats.metrics_present(rows, grid_metrics(grid))
    aggregate = stats.aggregate(rows, [m.key for m in metrics])
    differences = stats.paired_differences(rows, metrics, baseline)
    write_text(out / "summary.json", json.dumps(
        {"runs": rows, "aggregate": aggregate, "differences": differences, "baseline": baseline},
        indent=2) + "\n")
    write_report(out, rows, spec["schemes"], spec["lrs"], aggregate=aggregate,
                 differences=differences, baseline=baseline, metrics=metrics)
    key, title = get_task(base.task).headline
    log(f"{title} (div@N: diverged at step N; dead@N: zero gradient from step N on, stopped)")
    if len(spec["seeds"]) > 1:
        log("mean +- half-width of its 95% interval, over the seeds that did not diverge or stall; "
            "k/n div, k/n dead: k of the n seeds diverged, stalled")
        log(f"vs {baseline}: scheme minus {baseline} seed by seed, mean +- half-width of its 95% "
            "interval; better or worse only when that interval excludes zero, else no difference")
    if any(r.get("plateau") for r in rows):
        log(plateau_legend(rows))
    log(text_table(rows, spec["schemes"], spec["lrs"], key, differences))
    for metric in printed_metrics(metrics, key):
        log(f"{metric.title}, {metric.better} is better")
        log(text_table(rows, spec["schemes"], spec["lrs"], metric.key, differences))
    if any("mfu" in r for r in rows):       # a GPU (or a peak the user gave): how well it was used
        log("MFU: model FLOPs utilisation, the fraction of the device's peak each run achieved")
        log(text_table(rows, spec["schemes"], spec["lrs"], "mfu"))
    log(f"report: {out / 'report.md'}")
    log(kept_line(out, [cell.name for cell in grid], keep_checkpoints))
    return rows

