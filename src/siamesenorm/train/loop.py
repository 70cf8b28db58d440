"""The training loop of one run.

Each step draws ``grad_accum`` micro-batches from a :class:`BatchSource`, accumulates the gradient
of ``loss / grad_accum``, clips the total norm, sets the learning rate from :func:`lr_at` and takes
one AdamW step. The run directory receives ``metrics.jsonl``, ``summary.json`` and
``checkpoints/last/``. On CPU a resumed run repeats, bit for bit, the losses of a run that was
never stopped: the checkpoint holds the model, the optimizer, every global RNG, the batch source's
state and the run's counters, and evaluation never moves a generator the training draws from.
"""

from __future__ import annotations

import inspect
import math
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from ..errors import ConfigError, Terminated
from ..models.host import SchemeHost
from ..parallel import (
    SINGLE,
    Parallel,
    RankSource,
    World,
    all_max,
    all_mean,
    autocast_for,
    barrier,
    current_world,
    parallel_mode,
    parallelize,
)
from ..rundir import RunDir, plain, write_json
from .checkpoint import (
    kept_name,
    load_checkpoint,
    older_checkpoints,
    prune_checkpoints,
    save_checkpoint,
)
from .evaluate import validation_loss
from .forward import ForwardBackward
from .interrupt import DeferredInterrupt
from .metrics import MetricsLog
from .optim import build_optimizer, lr_at
from .probe_hook import StepProbe
from .progress import ProgressLine
from .rng import preserved_rng, rng_state, set_rng_state
from .sharded import gather_objects, load_sharded, save_sharded
from .state import RunState
from .summary import build_summary, perplexity


@runtime_checkable
class BatchSource(Protocol):
    """Where training batches come from.

    ``next_batch`` returns ``(x, y)``, int64 tensors of shape ``(B, T)`` (``y`` may hold ``-100``
    for ignored targets). ``state_dict`` returns a snapshot (later ``next_batch`` calls must not
    change it) of plain containers, numbers, strings and tensors; after ``load_state_dict`` of it,
    ``next_batch`` returns the same batches as it did after the snapshot was taken.
    """

    def next_batch(self) -> tuple[Tensor, Tensor]: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


@dataclass
class TrainSettings:
    """How one run trains.

    ``eval_every`` / ``checkpoint_every`` of 0 mean only at the last step (both also happen there
    otherwise). ``eval_batches`` are fixed ``(x, y)`` validation batches. The run stops as diverged
    at the first step whose loss or gradient norm is not finite, or, after step
    ``divergence_min_step`` (default: ``warmup``), whose loss exceeds ``divergence_factor`` times
    the lowest training loss so far. It stops as stalled (a failed run, not a diverged one) after
    ``stall_steps`` consecutive steps whose gradient is exactly zero: a model that no longer learns
    anything (dead units, a corrupted state). ``seed`` (None: leave the generators alone) seeds Python's and
    torch's global generators at the start of a fresh run; the model is built by the caller.

    The values are not checked again here: a run's configuration checks them where it is loaded
    (:class:`siamesenorm.config.TrainConfig`), and :meth:`from_config` copies them over.
    """

    steps: int
    lr: float
    warmup: int = 0
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    adam_eps: float = 1e-8
    grad_clip: float = 1.0          # 0 disables clipping (the norm is still logged)
    grad_accum: int = 1
    eval_every: int = 0
    eval_batches: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    log_every: int = 1
    checkpoint_every: int = 0
    keep_checkpoints: int = 2
    stall_steps: int = 20
    divergence_factor: float = 3.0
    divergence_min_step: int | None = None
    compile: bool = False
    seed: int | None = 0
    parallel: str = "auto"          # across processes: auto (FSDP2 above one), none, ddp, fsdp
    precision: str = "auto"         # auto (bf16 autocast on CUDA), fp32, bf16

    @classmethod
    def from_config(cls, train: Any, eval_batches: list, seed: int | None) -> TrainSettings:
        """The settings of a run configuration's ``train`` section (a checked
        :class:`~siamesenorm.config.TrainConfig`), with its validation batches and seed."""
        names = ("steps", "lr", "warmup", "min_lr_ratio", "weight_decay", "betas", "grad_clip",
                 "grad_accum", "eval_every", "checkpoint_every", "keep_checkpoints", "stall_steps",
                 "divergence_factor", "compile",
                 "parallel", "precision")
        return cls(**{n: getattr(train, n) for n in names}, eval_batches=eval_batches, seed=seed)

    @property
    def divergence_start(self) -> int:
        return self.warmup if self.divergence_min_step is None else self.divergence_min_step

    def is_eval_step(self, step: int) -> bool:
        return step == self.steps or (self.eval_every > 0 and step % self.eval_every == 0)

    def is_checkpoint_step(self, step: int) -> bool:
        return step == self.steps or (self.checkpoint_every > 0 and step % self.checkpoint_every == 0)


def _clip_gradients(params: list[nn.Parameter], max_norm: float) -> Tensor:
    """Scale the gradients to a total 2-norm of at most ``max_norm``; returns the norm before.

    :func:`torch.nn.utils.clip_grad_norm_`'s two halves, with the norm of sharded (FSDP2)
    gradients made whole in between so that every rank clips by the same number."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm(grads, 2.0)
    if hasattr(norm, "full_tensor"):    # a DTensor: the norm of this rank's shards, to reduce
        norm = norm.full_tensor()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm


class _Run:
    """One call of :func:`train`: the objects it drives and the state it carries."""

    def __init__(self, par: Parallel, source: BatchSource, settings: TrainSettings, run_dir: Path,
                 device: torch.device, extra_eval: Callable[[nn.Module], dict] | None,
                 probe: StepProbe | None = None, info: dict[str, Any] | None = None,
                 world: World = SINGLE) -> None:
        self.par, self.model, self.s, self.run_dir = par, par.model, settings, run_dir
        self.world = world
        self.source = RankSource(source, world.rank, world.size) if world.distributed else source
        self.device, self.extra_eval, self.probe = device, extra_eval, probe
        self.info = dict(info or {})
        self.ckpt_dir = RunDir(run_dir).last_checkpoint
        self.optimizer = build_optimizer(self.model, settings.lr, settings.weight_decay, settings.betas,
                                         settings.adam_eps)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.forward = ForwardBackward(par.module, settings.compile)
        self.autocast = autocast_for(par.mode, settings.precision, device)
        self.accum = settings.grad_accum      # micro-batches per rank and step
        self.state = RunState()
        self.diverged_at: int | None = None
        self.stalled_at: int | None = None      # first step of the zero-gradient stretch that ended it
        self.loss_parts: dict[str, float] = {}   # the last step's loss by part (MoE models)
        self.zero_steps = 0                     # consecutive steps with a zero gradient, up to now
        self.interrupted = False
        self.phase = "idle"         # "compute": gradients of a step; "update": inside optimizer.step
        self.snapshot: tuple[dict, dict] | None = None
        self.started = time.perf_counter()
        self.interval = [0, 0.0]    # tokens and seconds since the last logged row

    def wall_time(self) -> float:
        return self.state.wall_time_s + time.perf_counter() - self.started

    # ---- start -------------------------------------------------------------------------------
    def start(self, resume: bool) -> int | None:
        """Load the checkpoint or seed a fresh run; returns the step the metric log keeps."""
        world = self.world
        if resume:
            extra = self.load_newest_good()
            try:
                self.state = RunState.from_dict(extra["run"])
                self.source.load_state_dict(extra["source"])
                self.restore_rng(extra["rng"], extra.get("rng_ranks"))
            except KeyError as error:
                raise ConfigError(f"checkpoint {self.ckpt_dir} lacks the training state "
                                  f"{error}; it was not written by siamesenorm.train") from None
            self.accum = self.split_batch(self.state.micro_batches or self.s.grad_accum)
            return self.state.step
        if world.main:
            RunDir(self.run_dir).refuse_existing_run()
        barrier(world)      # no rank looks at the folder after rank 0 starts writing into it
        self.state.micro_batches = world.size * self.s.grad_accum
        if self.s.seed is not None:
            # every rank draws its own dropout and noise; rank 0 draws what a single process would
            seed = self.s.seed + 1_000_003 * world.rank
            torch.manual_seed(seed)
            random.seed(seed)
        return None

    def load_newest_good(self) -> dict:
        """Load the newest checkpoint that loads (the last, else the kept ones, newest first);
        returns its ``extra``. A fallback says so on stderr and moves the last one aside (to
        ``checkpoints/damaged-<time>``), so the run goes on from the one it loaded."""
        world, first = self.world, None
        for path in [self.ckpt_dir, *older_checkpoints(self.ckpt_dir)]:
            try:
                if world.distributed:
                    extra = load_sharded(path, self.par, self.optimizer, world)
                else:
                    extra = load_checkpoint(path, self.model, self.optimizer)
            except ConfigError as error:
                first = first or error
                continue
            if first is not None and world.main:
                aside = ""
                if self.ckpt_dir.exists():
                    stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
                    damaged = self.ckpt_dir.with_name(f"damaged-{stamp}")
                    os.replace(self.ckpt_dir, damaged)
                    aside = f" ({self.ckpt_dir.name} moved to {damaged.name})"
                print(f"warning: {first}; resuming from {path} instead{aside}", file=sys.stderr,
                      flush=True)
            barrier(world)
            return extra
        assert first is not None
        raise first

    def split_batch(self, micro_batches: int) -> int:
        """Micro-batches per rank that keep a resumed run's global batch of ``micro_batches``."""
        if micro_batches % self.world.size:
            raise ConfigError(f"the checkpoint's global batch is {micro_batches} micro-batches, which "
                              f"{self.world.size} processes cannot split evenly; resume with a "
                              "number of processes that divides it")
        return micro_batches // self.world.size

    def restore_rng(self, rng: dict, per_rank: list | None) -> None:
        """Every rank's generators as saved; at another world size rank 0 takes the saved rank 0's
        and the others start from a seed of the step (exact resumption needs the same ranks only
        where the forward pass itself draws random numbers: dropout, diffusion noise)."""
        world = self.world
        if per_rank is not None and len(per_rank) == world.size:
            set_rng_state(per_rank[world.rank])
        elif world.main or per_rank is None:
            set_rng_state(rng)
        else:
            seed = (self.s.seed or 0) + 1_000_003 * world.rank + 7919 * self.state.step
            torch.manual_seed(seed)
            random.seed(seed)

    # ---- one step ----------------------------------------------------------------------------
    def compute(self, probe_step: int | None = None) -> tuple[float, float, int]:
        """Accumulate the gradient of one step; returns ``(loss, pre-clip grad norm, tokens)``.

        With ``probe_step``, the probe reads the accumulated gradients before they are clipped."""
        n, total, tokens = self.accum, None, 0
        parts: dict[str, Tensor] = {}
        for i in range(n):
            x, y = self.source.next_batch()
            if self.state.seq_len is None:
                self.state.seq_len = int(x.shape[-1])
            x = x.to(self.device, non_blocking=True)
            y = y.to(self.device, non_blocking=True)
            with self.par.sync_gradients(i == n - 1):
                loss = self.forward(x, y, n, self.autocast)
            total = loss if total is None else total + loss
            tokens += self.count_tokens(x)
            for key, value in getattr(self.model, "loss_parts", {}).items():
                parts[key] = value.float() if key not in parts else parts[key] + value.float()
        # the parts of a loss made of several (an MoE's cross-entropy, balance and z-losses),
        # averaged over micro-batches and ranks, for the log
        if parts:
            means = all_mean(self.world, torch.stack(list(parts.values())) / n)
            self.loss_parts = dict(zip(parts, means.tolist()))
        if probe_step is not None:
            with preserved_rng():
                self.probe.after_backward(self.model, probe_step)
        clip = self.s.grad_clip if self.s.grad_clip > 0 else math.inf
        norm = _clip_gradients(self.params, clip)
        pair = all_mean(self.world, torch.stack([total.float() / n, norm.float()]))
        loss_value, norm_value = pair.tolist()
        if self.world.distributed:
            norm_value = float(norm.float())     # the same on every rank: of the reduced gradient
            tokens *= self.world.size
        return loss_value, norm_value, tokens

    def diverges(self, step: int, loss: float, norm: float) -> bool:
        if not (math.isfinite(loss) and math.isfinite(norm)):
            return True
        return step > self.s.divergence_start and loss > self.s.divergence_factor * self.state.best_loss

    def evaluate(self) -> dict[str, Any]:
        """Validation loss and ``extra_eval``, without moving any generator training draws from."""
        row: dict[str, Any] = {}
        with preserved_rng():
            with _RouterStats(self.model) as routers:
                val = validation_loss(self.par.module, self.s.eval_batches, self.device,
                                      self.autocast, self.world) if self.s.eval_batches else None
            row.update(routers.figures(self.world, self.device))
            extra: dict[str, Any] = {}
            if self.extra_eval is not None:
                self.model.eval()
                try:
                    with torch.no_grad():
                        extra = plain(dict(self.call_extra_eval()))  # checkpointable
                finally:
                    self.model.train()
        if val is not None:
            row.update(val_loss=val, val_ppl=perplexity(val))
        self.state.record_val(val, extra)
        return {**row, **extra}

    def count_tokens(self, x: Tensor) -> int:
        """Tokens in the input ``x``: a scheme host's ``tokens_in(x)`` (a ViT counts
        patches, not pixels), else ``x.numel()`` (token ids)."""
        return int(self.model.tokens_in(x)) if isinstance(self.model, SchemeHost) else x.numel()

    def call_extra_eval(self) -> dict:
        """``extra_eval(model)``, or ``extra_eval(model, step=...)`` when it takes the step."""
        assert self.extra_eval is not None
        if "step" in inspect.signature(self.extra_eval).parameters:
            return self.extra_eval(self.model, step=self.state.step)
        return self.extra_eval(self.model)

    def save(self) -> None:
        run = self.state.to_dict()
        run.update(wall_time_s=self.wall_time(), checkpoint_step=self.state.step)
        extra = {"run": run, "source": self.source.state_dict(), "rng": rng_state()}
        previous = self.state.checkpoint_step
        keep_as = kept_name(self.ckpt_dir, previous) \
            if self.s.keep_checkpoints > 1 and previous and previous != self.state.step else None
        if self.world.distributed:
            extra["rng_ranks"] = gather_objects(self.world, extra["rng"])
            save_sharded(self.ckpt_dir, self.par, self.optimizer, extra, self.world, keep_as)
        else:
            save_checkpoint(self.ckpt_dir, self.model, self.optimizer, extra, keep_as)
        if self.world.main:
            prune_checkpoints(self.ckpt_dir, self.s.keep_checkpoints)
        self.state.checkpoint_step = self.state.step

    def loop(self, log: MetricsLog, bar: ProgressLine, ctrl_c: DeferredInterrupt) -> None:
        s, state = self.s, self.state
        while state.step < s.steps:
            if all_max(self.world, ctrl_c.requested, self.device):   # every rank stops together
                if all_max(self.world, ctrl_c.terminated, self.device):
                    raise Terminated
                raise KeyboardInterrupt
            self.snapshot = (self.source.state_dict(), rng_state())
            self.phase = "compute"
            step = state.step + 1
            lr = lr_at(step, s.lr, s.warmup, s.steps, s.min_lr_ratio)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            probing = self.probe is not None and self.probe.wants(step)
            began = time.perf_counter()
            loss, norm, tokens = self.compute(step if probing else None)
            diverged = self.diverges(step, loss, norm)
            if not diverged:
                self.phase = "update"
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            seconds = time.perf_counter() - began
            self.phase = "after"
            if probing:
                with preserved_rng():
                    self.probe.after_update(self.model, step, diverged)
            row: dict[str, Any] = {"step": step, "loss": loss, "lr": lr, "grad_norm": norm,
                                   **self.loss_parts}
            if diverged:
                self.diverged_at = step
                log.write({**row, "tokens_per_s": tokens / max(seconds, 1e-9), "diverged": True})
                return
            state.step, state.last_loss = step, loss
            state.best_loss = min(state.best_loss, loss)
            state.tokens_seen += tokens
            state.train_time_s += seconds
            self.interval[0] += tokens
            self.interval[1] += seconds
            row["tokens_per_s"] = self.interval[0] / max(self.interval[1], 1e-9)
            bar.update(step, loss, lr, row["tokens_per_s"])
            if s.is_eval_step(step):
                row.update(self.evaluate())
            if step % s.log_every == 0 or s.is_eval_step(step) or step == s.steps:
                log.write(row)
                self.interval = [0, 0.0]
            if s.is_checkpoint_step(step):
                self.save()
            self.phase = "idle"
            self.zero_steps = self.zero_steps + 1 if norm == 0.0 else 0
            if self.zero_steps >= s.stall_steps:
                self.stalled_at = step - self.zero_steps + 1
                log.write({"step": step, "stalled": True, "stalled_at": self.stalled_at})
                return

    # ---- end ---------------------------------------------------------------------------------
    def summary(self) -> dict[str, Any]:
        figures = build_summary(self.model, self.state, self.s.steps, diverged_at=self.diverged_at,
                                stalled_at=self.stalled_at,
                                interrupted=self.interrupted, wall_time_s=self.wall_time())
        return {**figures, **self.info}

    def on_interrupt(self) -> None:
        """Checkpoint the last completed step, unless an optimizer update was cut in half."""
        self.interrupted = True
        if self.world.distributed and self.phase != "idle":
            print(f"warning: rank {self.world.rank} interrupted inside a step; the checkpoint on disk "
                  f"is from step {self.state.checkpoint_step}", file=sys.stderr, flush=True)
            return
        if self.phase == "update":
            print("warning: interrupted inside an optimizer update; the checkpoint on disk is from "
                  f"step {self.state.checkpoint_step}", file=sys.stderr, flush=True)
            return
        if self.phase == "compute" and self.snapshot is not None:
            self.source.load_state_dict(self.snapshot[0])
            set_rng_state(self.snapshot[1])
            self.optimizer.zero_grad(set_to_none=True)
        self.save()


def train(model: nn.Module, source: BatchSource, settings: TrainSettings, run_dir: str | Path, *,
          resume: bool = False, device: str | torch.device = "cpu",
          extra_eval: Callable[[nn.Module], dict] | None = None,
          progress: bool | None = None, probe: StepProbe | None = None,
          info: dict[str, Any] | None = None) -> dict[str, Any]:
    """Train ``model`` on batches from ``source`` into ``run_dir``; returns the summary.

    ``model(x, y)`` must return an object with a scalar ``.loss``; the model is moved to
    ``device`` and trained in float32, under bf16 autocast on CUDA. ``extra_eval(model)`` runs at
    every evaluation (eval mode, no grad; with a ``step`` keyword it also gets the step) and returns
    more numbers for the row (e.g. accuracy); the last ones also go to the summary as
    ``final_<name>``. ``progress=None`` shows a progress
    line only when stderr is a terminal. ``probe`` (a :class:`~.probe_hook.StepProbe`) records
    diagnostics on the steps it wants, without changing what the run computes. ``info`` (plain
    JSON data, e.g. ``{"data": {"name": ..., "fingerprint": ...}}``) is added to the summary as is.

    A fresh run refuses a ``run_dir`` that already holds ``metrics.jsonl`` or ``checkpoints/``
    (ConfigError, :meth:`~siamesenorm.rundir.RunDir.refuse_existing_run`); ``resume=True``
    continues from ``run_dir/checkpoints/last`` and truncates ``metrics.jsonl`` to the
    checkpoint's step. A divergence ends the run normally (the summary
    says ``diverged``; the checkpoint on disk stays the last good one). Ctrl-C finishes the step in
    flight (a second Ctrl-C stops at once), saves a checkpoint of the last completed step, writes
    ``summary.json`` with ``"interrupted": true`` and then re-raises :class:`KeyboardInterrupt`.
    Any other exception propagates without a summary; the last checkpoint stays usable.
    """
    run_dir = Path(run_dir)
    summary_path = RunDir(run_dir).summary
    world = current_world()
    mode = parallel_mode(settings.parallel, world)
    if world.distributed and probe is not None:
        raise ConfigError("the training probes (analysis.every) run in one process only; set "
                          "analysis.every=0 and run `siamesenorm analyze` on the finished run")
    if world.main:
        run_dir.mkdir(parents=True, exist_ok=True)
    device = torch.device(device)
    model.to(device)
    model.train()
    par = parallelize(model, mode, world, device, settings.precision)
    run = _Run(par, source, settings, run_dir, device, extra_eval, probe, info, world)
    keep_until = run.start(resume)
    log = MetricsLog(run_dir, keep_until) if world.main else _NoLog()
    if probe is not None:
        probe.start(run_dir, keep_until)
    bar = ProgressLine(settings.steps, progress if world.main else False)
    try:
        try:
            with DeferredInterrupt() as ctrl_c:
                run.loop(log, bar, ctrl_c)
                if run.diverged_at is None and run.state.checkpoint_step != run.state.step:
                    run.save()
        except KeyboardInterrupt:
            bar.close()
            run.on_interrupt()
            if world.main:
                write_json(summary_path, run.summary())
            raise
        bar.close()
        summary = run.summary()
        if world.main:
            write_json(summary_path, summary)
        return summary
    finally:
        bar.close()
        log.close()
        if probe is not None:
            probe.close()


class _RouterStats:
    """Within the ``with`` block, the expert load and router entropy of every forward of a model's
    mixture-of-experts layers (``model.moe_layers()``, :class:`~siamesenorm.nn.moe.MoE`); nothing
    for a dense model. :meth:`figures` averages them over the forwards and the ranks."""

    def __init__(self, model: nn.Module) -> None:
        layers = getattr(model, "moe_layers", None)
        self.layers = list(layers()) if callable(layers) else []
        self.seen: list[list[tuple[Tensor, Tensor]]] = [[] for _ in self.layers]
        self.hooks: list = []

    def __enter__(self) -> _RouterStats:
        for i, layer in enumerate(self.layers):
            self.hooks.append(layer.register_forward_hook(
                lambda module, args, out, i=i: self.seen[i].append((module.load, module.entropy))))
        return self

    def __exit__(self, *exc) -> None:
        for hook in self.hooks:
            hook.remove()

    def figures(self, world: World, device: torch.device) -> dict[str, Any]:
        """``expert_load`` (per layer, each expert's share of the token-expert assignments),
        ``expert_load_max`` (the largest share; 1 / n_experts when balanced) and
        ``router_entropy`` (nats, mean over layers)."""
        if not self.layers or not all(self.seen):
            return {}
        loads = [torch.stack([load for load, _ in seen]).float().mean(0) for seen in self.seen]
        entropy = torch.stack([torch.stack([e for _, e in seen]).float().mean()
                               for seen in self.seen]).mean()
        flat = all_mean(world, torch.cat([*loads, entropy.reshape(1)]).to(device)).tolist()
        out, start = [], 0
        for load in loads:
            out.append(flat[start:start + load.numel()])
            start += load.numel()
        return {"expert_load": out, "expert_load_max": max(max(layer) for layer in out),
                "router_entropy": flat[-1]}


class _NoLog:
    """The metric log of a rank other than 0: the run's files are rank 0's to write."""

    def write(self, row: dict[str, Any]) -> None:
        pass

    def close(self) -> None:
        pass
