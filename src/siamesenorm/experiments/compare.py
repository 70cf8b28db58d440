"""``compare``: every (scheme, learning rate, seed) as its own run, then one table and one report.

Every run of an experiment shares the base configuration; only the variant (a scheme with its options
and overrides, see :mod:`.grid`), ``train.lr`` and ``seed`` vary, so all schemes of one seed see the
same data in the same order and start from the same generator state. ``experiment.json`` records
the grid; repeating the command skips the runs that finished, resumes those with a checkpoint and
starts afresh those with neither (a run killed before its first checkpoint), and a folder that holds
another experiment's runs is refused. Every run's data is checked before the folder is claimed, so
a refused command writes nothing. ``summary.json`` carries each run's ``data`` (corpus name and
fingerprint) from its own summary.
"""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

from ..config import config_to_dict
from ..errors import ConfigError
from ..locks import LOCK_NAME, check_free, folder_lock
from ..rundir import RunDir, check_out_dir, read_json, read_jsonl, write_text
from ..tasks import TASKS, check_data, get_task, launch_task, run_task
from ..train import has_checkpoint
from ..train.checkpoint import older_checkpoints
from .grid import build_grid
from .report import write_report

COLUMNS = ("run", "scheme", "lr", "seed", "final_val_loss", "best_val_loss", "diverged",
           "diverged_at", "stalled_at", "steps", "tokens_per_s", "num_parameters", "max_grad_norm",
           "max_grad_norm_step")


def grad_norm_peak(run_dir: Path, after: int = 0) -> tuple[float | None, int | None]:
    """The largest logged gradient norm (before clipping) after step ``after``, and its step."""
    best: tuple[float | None, int | None] = (None, None)
    for row in read_jsonl(RunDir(run_dir).metrics):
        g = row.get("grad_norm")
        if row.get("step", 0) > after and isinstance(g, (int, float)) and \
                (best[0] is None or g > best[0]):
            best = (float(g), int(row["step"]))
    return best


def _one_line(summary: dict, peak: tuple) -> str:
    val = summary.get("final_val_loss")
    state = f"diverged at step {summary['diverged_at']}" if summary.get("diverged") else \
        f"stalled (zero gradient) from step {summary['stalled_at']}" if summary.get("stalled") else \
        f"final val loss {'-' if val is None else f'{val:.4f}'}"
    grad = "" if peak[0] is None else f", max grad norm {peak[0]:.3g} (step {peak[1]})"
    return f"{state}{grad}, {summary.get('wall_time_s', 0):.0f} s"


# Task-specific figures a run's summary may hold (``final_<name>`` from its evaluations): every
# task's ``columns``, in the registry's order.
EXTRA_COLUMNS = tuple(dict.fromkeys(c for task in TASKS.values() for c in task.columns))


def text_table(rows: list[dict], labels: list[str], lrs: list[float], key: str = "final_val_loss") -> str:
    """``key`` (a row's figure) per scheme (rows) and learning rate (columns), mean over seeds."""
    cells = {}
    for r in rows:
        cells.setdefault((r["scheme"], r["lr"]), []).append(r)
    width = max(len("scheme"), *(len(label) for label in labels))
    lines = [f"{'scheme':<{width}}  " + "  ".join(f"{'lr ' + format(lr, 'g'):>12}" for lr in lrs)]
    for label in labels:
        texts = []
        for lr in lrs:
            group = cells.get((label, lr), [])
            if any(r["diverged"] for r in group):
                texts.append(f"div@{min(r['diverged_at'] for r in group if r['diverged'])}")
            elif any(r.get("stalled_at") is not None for r in group):
                texts.append(f"dead@{min(r['stalled_at'] for r in group if r.get('stalled_at'))}")
            else:
                vals = [r[key] for r in group if r.get(key) is not None]
                texts.append(f"{sum(vals) / len(vals):.4f}" if vals else "-")
        lines.append(f"{label:<{width}}  " + "  ".join(f"{t:>12}" for t in texts))
    return "\n".join(lines)


def _claim(out: Path, spec: dict) -> None:
    """Write ``experiment.json``, or check that the folder holds this same experiment."""
    marker = out / "experiment.json"
    if marker.exists():
        old = read_json(marker)
        if old != spec:
            raise ConfigError(f"{out} holds another experiment's runs (its experiment.json differs); "
                              "choose another --out")
        return
    if out.exists() and any(p.name != LOCK_NAME for p in out.iterdir()):
        raise ConfigError(f"{out} is not empty and holds no experiment.json; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    write_text(marker, json.dumps(spec, indent=2) + "\n")


def _check_data(grid: list) -> None:
    """Check the data of every cell before the folder is claimed (each distinct data setting once)."""
    seen: set = set()
    for cell in grid:
        cfg = cell.config
        key = (cfg.task, get_task(cfg.task).data_signature(cfg))
        if key not in seen:
            seen.add(key)
            check_data(cfg)


def _start_run(run_dir: Path) -> bool:
    """Whether the cell's run resumes (it has a checkpoint). A run directory with neither a finished
    summary nor a checkpoint (a run killed before its first checkpoint) is emptied, to start afresh."""
    last = RunDir(run_dir).last_checkpoint
    if has_checkpoint(last) or older_checkpoints(last):
        return True
    if run_dir.is_dir():
        for child in run_dir.iterdir():
            if child.name == LOCK_NAME:      # ours: compare holds the run's lock
                continue
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    return False


def compare(preset: str | None, overrides: list[str], out: str | Path, *,
            schemes: list[str] | None = None, lrs: list[float] | None = None,
            seeds: list[int] | None = None, nproc: int | None = None, log=print) -> list[dict]:
    """Train the grid into ``out`` (skipping finished runs) and write the table and the report.

    ``schemes``, ``lrs`` and ``seeds`` default to the preset's ``compare`` section, then to
    pre/post/siamese, ``train.lr`` and ``seed`` (see :mod:`siamesenorm.experiments.grid`).
    ``nproc`` above 1 trains each run across that many processes of this machine, one run after
    the other (:func:`~siamesenorm.tasks.launch_task`).
    """
    base, spec, grid = build_grid(preset, overrides, schemes=schemes, lrs=lrs, seeds=seeds)
    out = Path(out)
    check_out_dir(out)
    check_free(out, "compare")
    _check_data(grid)
    with folder_lock(out, "compare"):
        return _compare(out, base, spec, grid, nproc, log)


def _compare(out: Path, base, spec: dict, grid: list, nproc: int | None, log) -> list[dict]:
    """:func:`compare` once it holds the experiment folder."""
    _claim(out, {"base": config_to_dict(base), **spec})
    rows = []
    for i, cell in enumerate(grid, 1):
        name, cfg = cell.name, cell.config
        run_dir = out / name
        summary_path = RunDir(run_dir).summary
        summary = read_json(summary_path) if summary_path.exists() else None
        if summary is not None and not summary.get("interrupted"):
            log(f"[{i}/{len(grid)}] {name}: done before, skipped")
        else:
            log(f"[{i}/{len(grid)}] {name}: training")
            with folder_lock(run_dir, "compare"):   # nobody else writes it while it is emptied
                resume = _start_run(run_dir)
                summary = launch_task(cfg, run_dir, nproc=nproc, resume=resume) \
                    if nproc and nproc > 1 else run_task(cfg, run_dir, resume=resume)
            log(f"  {name}: {_one_line(summary, grad_norm_peak(run_dir))}")
        peak = grad_norm_peak(run_dir)
        rows.append({"run": name, "scheme": cell.variant.label, "lr": cell.lr, "seed": cell.seed,
                     **{k: summary.get(k) for k in COLUMNS[4:-2]},
                     "max_grad_norm": peak[0], "max_grad_norm_step": peak[1],
                     **{k: summary[k] for k in EXTRA_COLUMNS if k in summary},
                     "data": summary.get("data")})
    extra = [k for k in EXTRA_COLUMNS if any(k in r for r in rows)]
    table = io.StringIO(newline="")
    writer = csv.DictWriter(table, fieldnames=COLUMNS + tuple(extra), restval="", extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    write_text(out / "summary.csv", table.getvalue())
    write_text(out / "summary.json", json.dumps(rows, indent=2) + "\n")
    write_report(out, rows, spec["schemes"], spec["lrs"])
    key, title = get_task(base.task).headline
    log(f"{title} (div@N: diverged at step N; dead@N: zero gradient from step N on, stopped)")
    log(text_table(rows, spec["schemes"], spec["lrs"], key))
    log(f"report: {out / 'report.md'}")
    return rows
