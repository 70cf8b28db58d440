"""The training loop of one run (docs/training.md). On CPU a resumed run repeats, bit for bit, the losses
of a run never stopped: evaluation never moves a generator training draws from."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from time import perf_counter
from typing import Any

import torch
from torch import Tensor, nn

from ..devices import run_threads
from ..errors import Terminated
from ..parallel import RankSource, World, all_max, autocast_for, current_world, parallel_mode, parallelize
from ..rundir import RunDir, plain, write_json
from .checkpoint import Checkpoints
from .evaluate import validation_loss
from .gradient import StepGradient
from .health import diverges, stalls
from .hooks import BatchSource, Evaluation
from .interrupt import DeferredInterrupt
from .metrics import MetricsLog
from .optim import build_optimizer, lr_at
from .probe_hook import StepProbe
from .progress import RunLog, log_interval
from .resume import fresh_state, resumed_state, save_run
from .rng import preserved_rng, rng_state, set_rng_state
from .speed import RunSpeed
from .state import Phase, RunState
from .summary import build_summary, perplexity


class Trainer:
    """One training session of a model in its run folder (claimed by the caller), and the state it carries."""

    def __init__(self, model: nn.Module, source: BatchSource, cfg: Any, run_dir: Path, *, seed: int | None,
                 eval_batches: Sequence, evaluation: Evaluation | None, device: torch.device,
                 probe: StepProbe | None, info: dict[str, Any] | None, world: World) -> None:
        self.cfg, self.run_dir, self.world, self.device, self.seed = cfg, run_dir, world, device, seed
        self.eval_batches, self.probe = list(eval_batches), probe
        self.evaluation = evaluation or Evaluation()
        self.info = dict(info or {})
        mode = parallel_mode(cfg.parallel, world)
        self.parallel = parallelize(model, mode, world, device, cfg.precision)
        self.model = model
        self.source = RankSource(source, world.rank, world.size) if world.distributed else source
        self.optimizer = build_optimizer(model, cfg.lr, cfg.weight_decay, cfg.betas)
        self.autocast = autocast_for(mode, cfg.precision, device)
        self.gradient = StepGradient(model, self.parallel, self.source, cfg, world, device, self.autocast)
        self.checkpoints = Checkpoints(RunDir(run_dir).last_checkpoint, cfg.keep_checkpoints, world)
        self.state = RunState()
        self.interrupted = False
        self.phase = Phase.IDLE
        self.step_snapshot: tuple[dict, dict] | None = None   # source and RNG before the step
        self.throughput = RunSpeed(device, cfg.precision, cfg.peak_tflops, world.size)
        self.started = perf_counter()

    def wall_time(self) -> float:
        return self.state.wall_time_s + perf_counter() - self.started

    # ---- start -------------------------------------------------------------------------------
    def start(self, resume: bool) -> int | None:
        """Load the newest good checkpoint or seed a fresh run; returns the step the log keeps."""
        if not resume:
            self.state = fresh_state(self.world, self.seed, self.cfg.grad_accum)
            return None
        self.state, self.gradient.micro_batches = resumed_state(
            self.checkpoints, self.parallel.module, self.optimizer, self.source, self.world, self.seed,
            self.cfg.grad_accum)
        return self.state.step

    # ---- one step ----------------------------------------------------------------------------
    def compute(self, probe_step: int | None) -> tuple[float, float, int]:
        """Accumulate one step's gradient, which the probe reads at ``probe_step``; returns the loss, the
        pre-clip gradient norm and the tokens."""
        total, tokens = self.gradient.backward(self.state)
        if probe_step is not None:
            with preserved_rng():
                self.probe.after_backward(self.model, probe_step)
        return self.gradient.reduce(total, tokens)

    def evaluate(self, step: int) -> dict[str, Any]:
        """Validation loss and the task's figures, without moving any generator training draws from."""
        with preserved_rng():
            with self.evaluation.validating(self.model):
                val = validation_loss(self.parallel.module, self.eval_batches, self.device,
                                      self.autocast, self.world) if self.eval_batches else None
            self.model.eval()
            try:
                with torch.no_grad():
                    figures = plain(dict(self.evaluation(self.model, step)))   # checkpointable
            finally:
                self.model.train()
        self.state.record_val(val, figures)
        return {**({} if val is None else {"val_loss": val, "val_ppl": perplexity(val)}), **figures}

    def save(self) -> None:
        save_run(self.checkpoints, self.parallel.module, self.optimizer, self.source, self.state,
                 self.wall_time())

    def is_due(self, every: int, step: int) -> bool:
        return step == self.cfg.steps or step % every == 0

    def loop(self, log: MetricsLog | None, display: RunLog, ctrl_c: DeferredInterrupt) -> None:
        cfg, state = self.cfg, self.state
        while state.step < cfg.steps and not state.ended:    # a resumed run that failed stays so
            if all_max(self.world, ctrl_c.requested, self.device):   # every rank stops together
                raise Terminated if all_max(self.world, ctrl_c.terminated, self.device) else KeyboardInterrupt
            self.step_snapshot = (self.source.state_dict(), rng_state())
            self.phase, step = Phase.COMPUTE, state.step + 1
            lr = lr_at(step, cfg.lr, cfg.warmup, cfg.steps, cfg.min_lr_ratio)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            probing = self.probe is not None and self.probe.wants(step)
            began = perf_counter()
            loss, norm, tokens = self.compute(step if probing else None)
            diverged = diverges(cfg, state, step, loss, norm)
            if not diverged:
                self.phase = Phase.UPDATE
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            seconds = perf_counter() - began
            self.phase = Phase.AFTER
            if probing:
                with preserved_rng():
                    self.probe.after_update(self.model, step, diverged)
            row: dict[str, Any] = {"step": step, "loss": loss, "lr": lr, "grad_norm": norm,
                                   **self.gradient.loss_parts,
                                   **self.throughput.step(self.model, state.seq_len, tokens, seconds)}
            if diverged:
                state.diverged_at = step
                _write(log, {**row, "diverged": True})
                return
            state.record_step(step, loss, tokens, seconds)
            stalled = stalls(cfg, state, step, norm)     # counted before a checkpoint takes it
            evaluated = self.evaluate(step) if self.is_due(cfg.eval_every, step) else None
            row.update(evaluated or {})
            _write(log, row, evaluated or ())
            display.step(step, loss=loss, lr=lr, tokens=tokens, seconds=seconds, elapsed=self.wall_time(),
                         session_s=perf_counter() - self.started, evaluated=evaluated)
            if self.is_due(cfg.checkpoint_every, step):
                self.save()
            self.phase = Phase.IDLE
            if stalled:
                _write(log, {"step": step, "stalled": True, "stalled_at": state.stalled_at})
                return

    # ---- end ---------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        figures = build_summary(self.model, self.state, self.cfg.steps, diverged_at=self.state.diverged_at,
                                stalled_at=self.state.stalled_at, interrupted=self.interrupted,
                                wall_time_s=self.wall_time())
        return {**self.throughput.of_run(figures), **self.info}

    def finish(self, display: RunLog) -> dict[str, Any]:
        """The summary, written to ``summary.json`` (by rank 0) and shown as the run's last line."""
        display.close()
        summary = self.summary()
        if self.world.main:
            write_json(RunDir(self.run_dir).summary, summary)
        display.finish(summary)
        return summary

    def on_interrupt(self) -> None:
        """Checkpoint the last completed step, unless an optimizer update was cut in half."""
        self.interrupted = True
        if (self.world.distributed and self.phase is not Phase.IDLE) or self.phase is Phase.UPDATE:
            where = f"rank {self.world.rank} interrupted inside a step" if self.world.distributed \
                else "interrupted inside an optimizer update"
            print(f"warning: {where}; the checkpoint on disk is from step {self.state.checkpoint_step}",
                  file=sys.stderr, flush=True)
            return
        if self.phase is Phase.COMPUTE and self.step_snapshot is not None:
            self.source.load_state_dict(self.step_snapshot[0])
            set_rng_state(self.step_snapshot[1])
            self.optimizer.zero_grad(set_to_none=True)
        self.save()


def _write(log: MetricsLog | None, row: dict[str, Any], evaluated: Any = ()) -> None:
    if log is not None:     # rank 0 writes the run's files
        log.write(row, evaluated)


def train(model: nn.Module, source: BatchSource, cfg: Any, run_dir: str | Path, *,
          seed: int | None = 0, eval_batches: Sequence[tuple[Tensor, Tensor]] = (),
          evaluation: Evaluation | None = None, resume: bool = False,
          device: str | torch.device = "cpu", progress: bool | None = None,
          probe: StepProbe | None = None, info: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train ``model`` (``model(x, y).loss``) on ``source``'s batches as ``cfg`` (a
    :class:`~siamesenorm.config.TrainConfig`) says, into ``run_dir``; returns the summary.

    ``seed`` (None: leave the generators alone) seeds a fresh run; ``resume`` continues from the newest
    good checkpoint. Ctrl-C or SIGTERM checkpoints the step, writes ``summary.json`` (``interrupted``)
    and re-raises. ``progress``: ``None`` a bar on a terminal, lines elsewhere; ``False`` nothing.
    """
    with run_threads(getattr(cfg, "threads", None)) as line:
        if info and "environment" in info:      # recorded before the run's own threads were set
            info = {**info, "environment": {**info["environment"], "threads": torch.get_num_threads()}}
        return _train(model, source, cfg, Path(run_dir), seed=seed, eval_batches=eval_batches,
                      evaluation=evaluation, resume=resume, device=device, progress=progress, probe=probe,
                      info=info, threads_line=line)


def _train(model: nn.Module, source: BatchSource, cfg: Any, run_dir: Path, *, seed: int | None,
           eval_batches: Sequence, evaluation: Evaluation | None, resume: bool, device: str | torch.device,
           progress: bool | None, probe: StepProbe | None, info: dict[str, Any] | None,
           threads_line: str | None) -> dict[str, Any]:
    world = current_world()
    if world.main:
        run_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device(device)
    model.to(device)
    model.train()
    trainer = Trainer(model, source, cfg, run_dir, seed=seed, eval_batches=eval_batches,
                      evaluation=evaluation, device=device, probe=probe, info=info, world=world)
    keep_until = trainer.start(resume)
    log = MetricsLog(run_dir, keep_until, cfg.loggers) if world.main else None
    if probe is not None:
        probe.start(run_dir, keep_until)
    if threads_line and world.main and progress is not False and cfg.log_every != 0:
        print(f"[train] {threads_line}", file=sys.stderr, flush=True)     # once nothing can be refused
    every = log_interval(cfg.log_every, cfg.steps)
    display = RunLog(cfg.steps, trainer.state.step, every,
                     RunLog.choose(progress if world.main else False, every),
                     trainer.throughput, trainer.throughput.mfu_note())
    try:
        try:
            with DeferredInterrupt() as ctrl_c:
                trainer.loop(log, display, ctrl_c)
                if trainer.state.diverged_at is None and trainer.state.checkpoint_step != trainer.state.step:
                    trainer.save()
        except KeyboardInterrupt:
            display.close()
            trainer.on_interrupt()
            trainer.finish(display)
            raise
        return trainer.finish(display)
    finally:
        display.close()
        if log is not None:
            log.close()
        if probe is not None:
            probe.close()
