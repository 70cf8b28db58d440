"""How many runs of a comparison train at once (``--jobs``, ``compare.jobs``), with how many threads:
``auto`` is one run per core (per device on CUDA) as memory allows (docs/performance.md), each with
its share of the cores other processes leave free (:func:`~siamesenorm.devices.choose_threads`)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ..devices import Threads, choose_threads, machine_now
from ..devices import available_cores as available_cores  # where it lived before
from ..errors import UserError

AUTO = "auto"
# a run's FLOPs (steps x micro-batches x work of one) below which starting a process for it
# (importing torch and the package, ~2 s on this project's machine) costs more than it saves
WORK_PER_PROCESS = 50e9
# auto runs no more at once than this fraction of the machine's memory holds (their floor)
MEMORY_SHARE = 0.5


def check_jobs(value: Any, source: str = "compare.jobs") -> int | str:
    """``value`` as ``auto`` or a whole number from 1, else a UserError naming ``source``."""
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == AUTO:
            return AUTO
        try:
            value = int(text)
        except ValueError:
            raise UserError(f"{source} must be a whole number of runs at once (1 or more) or auto, "
                              f"got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{source} must be a whole number of runs at once (1 or more) or auto, "
                          f"got {value!r}")
    if value < 1:
        raise UserError(f"{source} must be at least 1 (runs at once) or auto, got {value}")
    return value


@dataclass(frozen=True)
class Concurrency:
    """What a comparison runs at once: ``jobs`` runs of ``threads`` threads; ``devices``: each slot's
    ``CUDA_VISIBLE_DEVICES`` (``None``: as they are); ``why``: what chose it."""

    jobs: int
    threads: int
    devices: tuple[str, ...] | None = None
    why: str = ""

    def line(self) -> str:
        """``compare: 2 runs at once, 1 thread each (auto: width 64 on 2 cores)``."""
        threads = f"{self.threads} thread{'s' if self.threads != 1 else ''}"
        if self.jobs == 1:
            head = f"1 run at a time, {threads}"
        else:
            head = f"{self.jobs} runs at once, {threads} each"
        if self.devices:
            head += ", CUDA device " + ", ".join(sorted(set(self.devices), key=self.devices.index))
        return f"compare: {head} ({self.why})"


def work_per_step(cfg: Any) -> float:
    """FLOPs of one micro-batch of ``cfg``, forward and backward: ``6 x parameters x tokens``."""
    from ..tasks.registry import get_task

    tokens = cfg.data.batch_size * get_task(cfg.task).tokens_per_sample(cfg)
    return 6.0 * cfg.model.estimated_parameters() * tokens


def work_per_run(cfg: Any) -> float:
    return cfg.train.steps * cfg.train.grad_accum * work_per_step(cfg)


def cuda_kind(device_name: str) -> str | None:
    """How ``train.device`` uses CUDA: ``any`` (``auto`` with CUDA present, or ``cuda``: the slot
    picks the device), ``named`` (``cuda:K``), or ``None`` (no CUDA)."""
    if device_name.startswith("cuda:"):
        return "named"
    if device_name == "cuda":
        return "any"
    if device_name == AUTO:
        import torch

        return "any" if torch.cuda.is_available() else None
    return None


def visible_devices(count: int, env: dict | None = None) -> list[str]:
    """The ``CUDA_VISIBLE_DEVICES`` entries a child may get: this process's own list, else ``0..count-1``."""
    env = os.environ if env is None else env
    given = [d.strip() for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return given[:count] if given else [str(i) for i in range(count)]


def slot_devices(jobs: int, visible: Sequence[str]) -> tuple[str, ...]:
    return tuple(visible[i % len(visible)] for i in range(jobs))


def choose(cells: Sequence[Any], jobs: int | str, *, threads: int | None = None,
           **machine: Any) -> Concurrency:
    """How to run the whole grid ``cells`` (finished or not, so a run's thread count never depends on how
    far an earlier attempt got) with ``jobs``; ``threads``: ``--threads``; ``machine`` overrides what
    this machine has (tests), ``ceiling`` bounds the threads of a run trained in this process."""
    grid = max(1, len(cells))
    if jobs == AUTO or jobs <= grid:
        return _choose(cells, jobs, threads, **machine)
    chosen = _choose(cells, grid, threads, **machine)
    return dataclasses.replace(chosen, why=f"{chosen.why}; --jobs {jobs} is more than the grid's "
                                           f"{grid} run{'s' if grid != 1 else ''}")


def _load_note(pick: Threads, usual: int) -> str:
    """What made ``pick`` differ from ``usual`` threads (the cores' share), if it does."""
    if pick.count == usual:
        return ""
    return pick.seen if pick.auto else f"; {pick.why}"


def _choose(cells: Sequence[Any], jobs: int | str, flag: int | None = None, *, nproc: int | None = None,
            world_size: int = 1, cores: int | None = None, cuda_count: int | None = None,
            memory: int | None = None, busy: float | None = None, load: float | None = None,
            env: dict | None = None, ceiling: int | None = None) -> Concurrency:
    if cores is None:
        cores, busy, load = machine_now()
    configs = [cell.config for cell in cells]
    config = max((cfg.train.threads for cfg in configs if cfg.train.threads), default=None)

    def pick(processes: int) -> Threads:
        return choose_threads(flag, config, processes=processes, cores=cores, busy=busy, load=load, env=env,
                              ceiling=ceiling if processes == 1 else None)     # the threads this process has

    def note(processes: int) -> str:
        return _load_note(pick(processes), max(1, cores // processes))

    spread = (nproc or 1) > 1 or world_size > 1
    if spread:
        if jobs != AUTO and jobs > 1:
            what = f"--nproc {nproc}" if (nproc or 1) > 1 else f"a launcher's world of {world_size}"
            raise UserError(f"--jobs {jobs} with {what}: each run already spans several processes "
                              "on this machine; give --jobs 1 (or leave it to auto), or leave out --nproc")
        return Concurrency(1, cores, None, "--nproc trains one run at a time" if (nproc or 1) > 1
                           else "one run at a time under a launcher")
    kinds = {cuda_kind(cfg.train.device) for cfg in configs} or {None}
    if kinds == {"any"}:
        if cuda_count is None:
            import torch

            cuda_count = torch.cuda.device_count()
        visible = visible_devices(max(1, cuda_count))
        n = min(len(visible), len(configs)) if jobs == AUTO else jobs
        why = (f"auto: one run per CUDA device, {len(visible)} device{'s' if len(visible) != 1 else ''}"
               if jobs == AUTO else f"--jobs {jobs} over {len(visible)} CUDA device"
               f"{'s' if len(visible) != 1 else ''}")
        return Concurrency(n, pick(n).count, slot_devices(n, visible), why + note(n))
    if kinds & {"any", "named"}:        # a named device (or a mix): the runs share what they name
        n = 1 if jobs == AUTO else jobs
        why = "auto: the runs name their CUDA device" if jobs == AUTO else f"--jobs {jobs}"
        return Concurrency(n, pick(n).count, None, why + note(n))
    on = f"on {cores} core{'s' if cores != 1 else ''}"
    if jobs != AUTO:
        return Concurrency(jobs, pick(jobs).count, None, f"--jobs {jobs} {on}{note(jobs)}")
    work = max(work_per_step(cfg) for cfg in configs)
    width = max(getattr(cfg.model, "dim", 0) for cfg in configs)
    run_work = max(work_per_run(cfg) for cfg in configs)
    if run_work < WORK_PER_PROCESS:
        return Concurrency(1, pick(1).count, None, f"auto: width {width}, {run_work / 1e9:.3g} GFLOP a "
                           f"run, too little to pay for a process each, {on}{note(1)}")
    fixed = pick(1)         # threads the user set: as many runs as leave each of them a core
    per_run = 1 if fixed.auto else fixed.count
    n = max(1, min(cores // per_run, len(configs), _memory_room(configs, memory)))
    return Concurrency(n, pick(n).count, None,
                       f"auto: width {width}, {work / 1e9:.3g} GFLOP a step, {on}{note(n)}")


def _memory_room(configs: Sequence[Any], memory: int | None) -> int:
    """How many of the largest run's memory floors fit in :data:`MEMORY_SHARE` of this machine's memory."""
    from ..tasks.dryrun import memory_floor

    if memory is None:
        import torch

        from ..devices import machine_memory

        memory = machine_memory(torch.device("cpu"))
    if memory is None:
        return len(configs)
    floor = max(memory_floor(cfg)["total"] for cfg in configs)
    return max(1, int(MEMORY_SHARE * memory // max(1, floor)))


def threads_of(summary: dict | None, default: int) -> int:
    """The thread count a run resumes with: the one its ``summary.json`` recorded, else ``default``."""
    threads = ((summary or {}).get("environment") or {}).get("threads")
    return threads if isinstance(threads, int) and not isinstance(threads, bool) and threads >= 1 \
        else default
