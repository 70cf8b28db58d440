"""``siamesenorm export RUN_DIR --format hf --out DIR``: a language-model run as a Hugging Face model
folder (:mod:`siamesenorm.hf.export` writes it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import UserError
from ..hf.export import model_card, write_export
from ..hf.folder import check_model_folder
from ..rundir import RunDir, check_out_dir
from ..shapes import read_summary
from ..tasks.finished import open_trained
from ..tasks.registry import TASKS, get_task, saved_config


def export_hf(run_dir: str | Path, out: str | Path, *, force: bool = False) -> dict[str, Any]:
    """Write the run ``run_dir`` as the model folder ``out``, everything checked first; the
    tokenizer is ``None`` for a run on token files."""
    run_dir, out = Path(run_dir), Path(out)
    cfg = saved_config(run_dir, f"{run_dir} is not a run directory: it holds no config.yaml")
    task = get_task(cfg.task)
    if not task.exports_hf:
        kinds = ", ".join(f"{t.kind} runs (task: {t.name})" for t in TASKS.values() if t.exports_hf)
        raise UserError(f"{run_dir} is a {task.kind} run (task: {cfg.task}); --format hf exports {kinds}")
    _check_out(out, run_dir, force)
    model, cfg, step = open_trained(run_dir, "cpu", cfg)
    tokenizer = _run_tokenizer(run_dir)
    layout = RunDir(run_dir)
    summary = read_summary(layout.summary) if layout.summary.is_file() else None
    info = {"folder": str(out), "parameters": sum(p.numel() for p in model.parameters()),
            "step": step, "tokenizer": tokenizer.kind if tokenizer is not None else None}
    write_export(out, model, cfg, tokenizer, model_card(cfg, info, summary, out.name), force=force)
    return info


def _check_out(out: Path, run_dir: Path, force: bool) -> None:
    """Refuse an ``--out`` inside the run or holding it, then what ``check_model_folder`` refuses."""
    check_out_dir(out)
    target, run = out.resolve(), run_dir.resolve()
    if run in target.parents:
        raise UserError(f"--out {out} lies inside the run {run_dir} (its files would be replaced); "
                        "write the model folder outside the run")
    if target == run or target in run.parents:
        raise UserError(f"--out {out} holds the run {run_dir}; choose another folder")
    check_model_folder(out, force=force)


def _run_tokenizer(run_dir: Path):
    """The run's saved tokenizer, or ``None`` for a run on token files (it saved none)."""
    from ..data import load_tokenizer

    folder = RunDir(run_dir).tokenizer
    return load_tokenizer(folder) if folder.is_dir() else None
