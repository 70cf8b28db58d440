"""``compare``: every (scheme, learning rate, seed) as its own run, then one table and one report.

Every run of an experiment shares the base configuration; only ``model.scheme``, ``train.lr`` and
``seed`` vary, so all schemes of one seed see the same data in the same order and start from the
same generator state. ``experiment.json`` records the grid; repeating the command skips the runs
that finished, and a folder that holds another experiment's runs is refused.
"""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

from ..config import RunConfig, config_to_dict, load_config
from ..errors import ConfigError
from ..run import run_training
from .report import write_report

COLUMNS = ("run", "scheme", "lr", "seed", "final_val_loss", "best_val_loss", "diverged",
           "diverged_at", "steps", "tokens_per_s", "num_parameters")


def run_name(scheme: str, lr: float, seed: int) -> str:
    return f"{scheme}-lr{lr:g}-s{seed}"


def _grid(base: RunConfig, schemes: list[str], lrs: list[float], seeds: list[int]) -> list[tuple]:
    runs = []
    for seed in seeds:
        for lr in lrs:
            for scheme in schemes:
                model = dataclasses.replace(base.model, scheme=scheme, scheme_options={}
                                            if scheme != base.model.scheme else base.model.scheme_options)
                cfg = dataclasses.replace(base, model=model, seed=seed,
                                          train=dataclasses.replace(base.train, lr=lr))
                runs.append((run_name(scheme, lr, seed), scheme, lr, seed, cfg))
    return runs


def _claim(out: Path, spec: dict) -> None:
    """Write ``experiment.json``, or check that the folder holds this same experiment."""
    marker = out / "experiment.json"
    if marker.exists():
        old = json.loads(marker.read_text())
        if old != spec:
            raise ConfigError(f"{out} holds another experiment's runs (its experiment.json differs); "
                              "choose another --out")
        return
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} is not empty and holds no experiment.json; choose another --out")
    out.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(spec, indent=2))


def compare(preset: str | None, overrides: list[str], out: str | Path, *, schemes: list[str],
            lrs: list[float] | None = None, seeds: list[int] | None = None,
            log=print) -> list[dict]:
    """Train the grid into ``out`` (skipping finished runs) and write the table and the report."""
    base = load_config(preset, overrides)
    lrs = lrs or [base.train.lr]
    seeds = seeds or [base.seed]
    for name in schemes:  # each scheme's options checked before any run starts
        load_config(preset, [o for o in overrides if not o.startswith("model.scheme")] +
                    [f"model.scheme={name}"])
    if any(not lr > 0 for lr in lrs):
        raise ConfigError(f"learning rates must be positive, got {lrs}")
    out = Path(out)
    grid = _grid(base, schemes, lrs, seeds)
    _claim(out, {"base": config_to_dict(base), "schemes": schemes, "lrs": lrs, "seeds": seeds})
    rows = []
    for i, (name, scheme, lr, seed, cfg) in enumerate(grid, 1):
        run_dir = out / name
        summary_path = run_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else None
        if summary is not None and not summary.get("interrupted"):
            log(f"[{i}/{len(grid)}] {name}: done before, skipped")
        else:
            log(f"[{i}/{len(grid)}] {name}: training")
            summary = run_training(cfg, run_dir, resume=(run_dir / "config.yaml").exists())
        rows.append({"run": name, "scheme": scheme, "lr": lr, "seed": seed,
                     **{k: summary.get(k) for k in COLUMNS[4:]}})
    with open(out / "summary.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    (out / "summary.json").write_text(json.dumps(rows, indent=2))
    write_report(out, rows, schemes, lrs)
    log(f"report: {out / 'report.md'}")
    return rows
