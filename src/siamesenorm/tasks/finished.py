"""What the commands do with a finished run of any task: load it, analyse it, continue a prompt.

Each reads the run's ``config.yaml``, finds its task in the registry, and builds the task's model
with the weights of the last checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from ..analysis import analyze_model, write_analysis
from ..analysis.training_probes import to_device
from ..config import check_seed, dump_config
from ..devices import resolve_device
from ..errors import UserError
from ..rundir import RunDir, check_out_dir, replacing
from ..train import load_checkpoint
from ..train.checkpoint import unique_tensors
from ..train.state import RunState
from .registry import get_task, saved_config

# What each task's runs are, in words, for the errors of commands that take only some of them.


class Trained(NamedTuple):
    """A finished run's module (eval mode), its configuration and the step of its checkpoint."""

    model: nn.Module
    config: Any
    step: int


def open_trained(run_dir: str | Path, device: str = "cpu", cfg: Any = None) -> Trained:
    """The weights of ``run_dir``'s last checkpoint in its module, its configuration (``cfg``:
    already read from its ``config.yaml``) and the step, from one read of each file; ``device``
    as ``--device`` takes it."""
    run_dir = Path(run_dir)
    if cfg is None:
        cfg = saved_config(run_dir, f"{run_dir} is not a run directory: it holds no config.yaml")
    model = get_task(cfg.task).build_model(cfg, resolve_device(device, "--device"))
    extra = load_checkpoint(RunDir(run_dir).last_checkpoint, model, None)
    return Trained(model.eval(), cfg, RunState.from_dict(extra.get("run", {})).step)


def load_trained(run_dir: str | Path, device: str = "cpu") -> tuple[nn.Module, Any]:
    """The trained module of ``run_dir`` (the weights of its last checkpoint, eval mode) and its
    configuration; ``device`` as ``--device`` takes it."""
    model, cfg, _ = open_trained(run_dir, device)
    return model, cfg


def export_run(run_dir: str | Path, out: str | Path) -> dict[str, Any]:
    """``siamesenorm export``: the weights of ``run_dir``'s last checkpoint (single-process or
    sharded) as one safetensors file at ``out``; returns ``{"tensors": n, "parameters": n}``.

    A tensor shared by several names (tied weights) is stored once, under its first name, as the
    checkpoints do; the file's metadata holds the run's ``config.yaml`` (``siamesenorm_config``)
    and the step. An existing ``out`` is refused; the file appears whole or not at all."""
    from safetensors.torch import save_file

    out = Path(out)
    if out.suffix != ".safetensors":
        raise UserError(f"--out {out}: the export is a .safetensors file; name it so")
    if out.exists():
        raise UserError(f"--out {out} already exists; remove it or choose another name")
    check_out_dir(out.parent)
    model, cfg, step = open_trained(run_dir, "cpu")
    tensors = {k: v.detach().contiguous() for k, v in unique_tensors(model.state_dict()).items()}
    out.parent.mkdir(parents=True, exist_ok=True)
    with replacing(out) as tmp:     # a fresh file: a full disk leaves nothing, names --out
        save_file(tensors, str(tmp), metadata={"format": "pt", "siamesenorm_config": dump_config(cfg),
                                                "step": str(step)})
    return {"tensors": len(tensors), "parameters": sum(p.numel() for p in model.parameters()),
            "step": step}


def analyze_run(run_dir: str | Path, data: str | None = None, *, batches: int | None = None,
                device: str = "cpu", out: str | Path | None = None) -> dict[str, Any]:
    """``siamesenorm analyze``: every diagnostic on the last checkpoint of the run ``run_dir``.

    ``data``: a data set to analyse instead of the run's validation split (for a language model a
    text file, folder or token file; for an image run a folder or ``.npz``); ``batches``: how many
    batches of the run's batch size (default ``analysis.batches`` of its config): the first of the
    run's own evaluation batches, or batches spread evenly over ``data``; ``out``: where
    ``analysis.json`` and its plots go (default ``run_dir``). Errors a user can cause (no run, no
    checkpoint, unreadable or too little data) raise :class:`~siamesenorm.errors.UserError`.
    """
    if batches is not None and batches <= 0:
        raise UserError(f"--batches must be positive, got {batches}")
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise UserError(f"run directory {run_dir} does not exist")
    check_out_dir(out if out is not None else run_dir)
    model, cfg = load_trained(run_dir, device)
    task = get_task(cfg.task)
    chosen = task.analysis_batches(cfg, run_dir, data, batches or cfg.analysis.batches)
    dev = next(model.parameters()).device
    with torch.random.fork_rng(devices=[]):
        result = analyze_model(model, [to_device(b, dev) for b in chosen], loss_fn=task.loss_fn,
                               head_fn=task.head_fn)
    write_analysis(out if out is not None else run_dir, result,
                   source=str(data) if data is not None else "validation", run_dir=run_dir)
    return result


def check_finite_weights(model: nn.Module, source: Path) -> None:
    """Refuse, in one line, a model whose weights (``source``: the checkpoint they came from) hold
    NaN or infinity: nothing computed from them means anything."""
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise UserError(f"{source} holds non-finite weights (NaN or infinity in {name}): the run "
                              "diverged before this checkpoint; train it again (a lower train.lr, "
                              "more train.warmup)")


def generate_text(run_dir: str | Path, prompt: str | bytes, max_new_tokens: int = 200, *,
                  temperature: float = 0.8, top_k: int | None = None, greedy: bool = False,
                  seed: int = 0, device: str = "cpu", note: Callable[[str], None] | None = None) -> str:
    """Continue ``prompt`` with the model of ``run_dir`` (a task that generates: the language
    model); returns the prompt and its continuation. ``temperature`` is a finite number from 0
    (0 takes the most likely token, as ``greedy``); ``seed`` an integer from 0 to 2**63-1.
    ``note`` receives a one-line notice before a long generation (the task's)."""
    if max_new_tokens < 0:
        raise UserError(f"max_new_tokens must not be negative, got {max_new_tokens}")
    if not math.isfinite(temperature):
        raise UserError(f"--temperature must be a finite number, got {temperature}")
    if temperature < 0:
        raise UserError(f"--temperature must not be negative, got {temperature}")
    if top_k is not None and top_k <= 0:
        raise UserError(f"--top-k must be positive, got {top_k}")
    check_seed(seed, "--seed")
    resolve_device(device, "--device")
    run_dir = Path(run_dir)
    cfg = saved_config(run_dir, f"{run_dir} is not a run directory: it holds no config.yaml")
    task = get_task(cfg.task)
    if task.generate is None:
        raise UserError(f"{run_dir} is a {task.kind} run (task: {cfg.task}); "
                          "generate continues text prompts and is for language-model runs (task: lm)")
    model, _ = load_trained(run_dir, device)
    check_finite_weights(model, RunDir(run_dir).last_checkpoint)
    return task.generate(run_dir, model, prompt, max_new_tokens, temperature=temperature, top_k=top_k,
                         greedy=greedy, seed=seed, note=note)
