"""Which torch device a run or a command uses, refused in one line when it cannot be had."""

from __future__ import annotations

import contextlib
import math
import os
import platform
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import UserError

__all__ = ["Threads", "available_cores", "busy_cores", "check_device_name", "check_threads", "choose_threads",
           "deterministic", "environment", "machine_memory", "resolve_device", "run_threads", "use_threads"]

# The kinds of device a run or a command can use. ``meta`` (shapes without data) builds models for
# ``--dry-run`` but cannot train or generate; other backends (xpu, hpu, ...) are not supported.
DEVICE_KINDS = ("auto", "cpu", "cuda", "mps")


def _setting(option: str, value: str) -> str:
    return f"{option} {value}" if option.startswith("-") else f"{option}={value}"


def check_device_name(name: Any, option: str = "train.device") -> None:
    """Refuse a device name no run can use, whatever this machine has (not a kind in
    :data:`DEVICE_KINDS`, or ``meta``)."""
    if not isinstance(name, str) or not name:
        raise UserError(f"{_setting(option, repr(name))}: give auto, cpu, cuda, cuda:N or mps")
    if name == "auto":
        return
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"{_setting(option, repr(name))}: unknown device; use auto, cpu or cuda") from None
    if device.type == "meta":
        raise UserError(f"{_setting(option, name)}: the meta device holds shapes, not numbers, and "
                          "cannot train or generate; use cpu or cuda (train --dry-run sizes a model "
                          "without memory)")
    if device.type not in DEVICE_KINDS:
        raise UserError(f"{_setting(option, repr(name))}: unknown device; use auto, cpu or cuda")


def resolve_device(name: str, option: str = "train.device") -> torch.device:
    """``auto`` (CUDA when available, else CPU), ``cpu``, ``cuda[:N]`` or ``mps``, present on this
    machine; errors name ``option`` as the user set it."""
    check_device_name(name, option)
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"{_setting(option, name)} but no CUDA device is available; use "
                              f"{_setting(option, 'cpu')}")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"{_setting(option, name)} but this machine has "
                              f"{torch.cuda.device_count()} CUDA device(s), cuda:0 to "
                              f"cuda:{torch.cuda.device_count() - 1}")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"{_setting(option, name)} but no MPS device (Apple GPU) is available; use "
                          f"{_setting(option, 'cpu')}")
    return device


def machine_memory(device: torch.device) -> int | None:
    """The bytes of memory ``device`` has: a CUDA device's own; for the CPU, the machine's RAM or
    this process's cgroup limit (a container's), whichever is smaller; ``None`` when unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    if device.type != "cpu":
        return None
    sizes = []
    try:
        sizes.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, ValueError, OSError):
        pass
    for limit in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(limit).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 60:       # "max", or the v1 "unlimited" number
            sizes.append(int(text))
    return min(sizes) if sizes else None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def environment(device: torch.device, world_size: int = 1) -> dict[str, Any]:
    """What a run's numbers depend on besides its configuration and seed: versions, device, threads."""
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
    return {"torch": torch.__version__, "python": platform.python_version(),
            "platform": platform.platform(), "device": str(device), "device_name": name,
            "threads": torch.get_num_threads(), "world_size": world_size,
            "deterministic": torch.are_deterministic_algorithms_enabled()}


@contextlib.contextmanager
def deterministic(enabled: bool) -> Iterator[None]:
    """PyTorch's deterministic algorithms on for the duration (``enabled``), then as before; sets
    ``CUBLAS_WORKSPACE_CONFIG`` when absent."""
    if not enabled:
        yield
        return
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    cudnn = torch.backends.cudnn.benchmark
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.benchmark = False
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cudnn.benchmark = cudnn


# ---- intra-op threads: as many as the cores other processes leave free (docs/training.md#threads) ----
PROC = Path("/proc")
SAMPLE_S = 0.2      # how long the cores are watched: the load average lags a minute behind


def available_cores() -> int:
    """The CPUs this process may run on (its affinity mask, a container's cpuset), else the machine's."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def machine_load() -> float | None:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def _ticks(exclude: Sequence[int]) -> tuple[int, int, int]:
    """Busy and all CPU ticks of this process's CPUs (``/proc/stat``), and the ticks of ``exclude``."""
    try:
        mine = {f"cpu{i}" for i in os.sched_getaffinity(0)}
    except AttributeError:
        mine = None
    busy = total = 0
    for line in (PROC / "stat").read_text().splitlines():
        name, *fields = line.split()
        if name.startswith("cpu") and name != "cpu" and (mine is None or name in mine):
            ticks = [int(x) for x in fields[:8]]     # user nice system idle iowait irq softirq steal
            busy, total = busy + sum(ticks) - ticks[3] - ticks[4], total + sum(ticks)
    theirs = 0
    for pid in exclude:
        try:
            fields = (PROC / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
            theirs += int(fields[11]) + int(fields[12])      # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return busy, total, theirs


def busy_cores(exclude: Sequence[int] = (), window: float = SAMPLE_S) -> float | None:
    """How many of this process's CPUs other processes (not it, not ``exclude``) keep busy now:
    ``/proc/stat`` over ``window`` seconds; ``None`` where there is no ``/proc``."""
    try:
        busy, total, theirs = _ticks(exclude)
        time.sleep(window)
        busy2, total2, theirs2 = _ticks(exclude)
    except (OSError, ValueError):
        return None
    if total2 <= total:
        return None
    cpus = available_cores()
    return max(0.0, cpus * ((busy2 - busy) - (theirs2 - theirs)) / (total2 - total))


def machine_now(exclude: Sequence[int] = (), *, ceiling: int | None = None,
                processes: int = 1) -> tuple[int, float | None, float | None]:
    """This process's cores, how many of them others keep busy (watched only where more than one
    thread a process could come of it: ``ceiling`` threads shared by ``processes``) and the load
    average."""
    cores = available_cores()
    watch = min(cores, ceiling or cores) // processes > 1
    return cores, busy_cores(exclude) if watch else None, machine_load()


def check_threads(value: Any, source: str = "train.threads") -> int | None:
    """``value`` as a thread count from 1, or ``None`` for auto (``auto``, null); else a UserError."""
    if value is None:
        return None
    if isinstance(value, str):
        if value.strip().lower() == "auto":
            return None
        try:
            value = int(value.strip())
        except ValueError:
            raise UserError(f"{source} must be a whole number of threads (1 or more) or auto, "
                            f"got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int):
        raise UserError(f"{source} must be a whole number of threads (1 or more) or auto, got {value!r}")
    if value < 1:
        raise UserError(f"{source} must be at least 1 (threads per process) or auto, got {value}")
    return value


def env_threads(env: dict | None = None) -> int | None:
    """``OMP_NUM_THREADS`` when it is a whole number from 1 (what OpenMP reads), else ``None``."""
    text = (os.environ if env is None else env).get("OMP_NUM_THREADS", "").strip()
    return int(text) if text.isdigit() and int(text) >= 1 else None


@dataclass(frozen=True)
class Threads:
    """Intra-op threads per process and why; ``auto``: from the machine's free cores, ``seen``
    being what was seen of it and what bounded it (``, 1.9 busy, load 6.8``)."""

    count: int
    why: str
    auto: bool = False
    processes: int = 1
    seen: str = ""

    def line(self) -> str:
        each = " per process" if self.processes > 1 else ""
        return f"threads: {self.count}{each} ({self.why})"


def set_threads(flag: int | None = None, config: int | None = None, *, flag_name: str = "--threads",
                processes: int = 1, env: dict | None = None) -> Threads | None:
    """The threads the user set: ``flag``, else ``OMP_NUM_THREADS``, else ``train.threads``."""
    for value, name in ((flag, flag_name), (env_threads(env), "OMP_NUM_THREADS"), (config, "train.threads")):
        if value is not None:
            sep = " " if name.startswith("-") else "="
            return Threads(value, f"{name}{sep}{value}", processes=processes)
    return None


def choose_threads(flag: int | None = None, config: int | None = None, *, flag_name: str = "--threads",
                   processes: int = 1, ceiling: int | None = None, exclude: Sequence[int] = (),
                   cores: int | None = None, busy: float | None = None, load: float | None = None,
                   env: dict | None = None) -> Threads:
    """The threads of each of ``processes`` processes: ``flag``, else ``OMP_NUM_THREADS``, else
    ``train.threads`` (``config``), else the cores other processes (not ``exclude``) leave free now
    (:func:`busy_cores`; the 1-minute load average where it cannot be seen), shared out, at most
    ``ceiling`` in all. ``cores``, ``busy`` and ``load`` fake the machine (tests)."""
    given = set_threads(flag, config, flag_name=flag_name, processes=processes, env=env)
    if given is not None:
        return given
    if cores is None:
        cores, busy, load = machine_now(exclude, ceiling=ceiling, processes=processes)
    taken = busy if busy is not None else load or 0.0
    free = max(1, min(cores, math.floor(cores - taken + 0.5)))
    count = max(1, min(free, ceiling or free) // processes)
    seen = f", {busy:.1f} busy" if busy is not None else ""
    if load is not None:
        seen += f", load {load:.1f}"
    if ceiling is not None and ceiling < free:
        seen += f"; the process had {ceiling}"
    why = f"{cores} core{'s' if cores != 1 else ''}{seen}"
    if processes > 1:
        why = f"{processes} processes on {why}"
    return Threads(count, why, auto=True, processes=processes, seen=seen)


_chosen: list = [None, False]       # the threads a command chose for its runs, and whether to say so


@contextlib.contextmanager
def use_threads(choice: Threads, announce: bool = False) -> Iterator[None]:
    """``choice.count`` intra-op threads in the block, then as before; a run trained in it keeps them
    (:func:`run_threads`), and with ``announce`` the first says so."""
    before, outer = torch.get_num_threads(), list(_chosen)
    torch.set_num_threads(choice.count)
    _chosen[:] = [choice, announce]
    try:
        yield
    finally:
        _chosen[:] = outer
        torch.set_num_threads(before)


def chosen_threads() -> tuple[Threads | None, str | None]:
    """What :func:`use_threads` chose for this block, and its line the first time it is to be said."""
    choice, announce = _chosen
    _chosen[1] = False
    return choice, choice.line() if choice is not None and announce else None


@contextlib.contextmanager
def run_threads(config: int | None) -> Iterator[str | None]:
    """The threads of one run: those of :func:`use_threads` (yields its line when it is to be
    said), else ``train.threads`` unless ``OMP_NUM_THREADS`` is set, else the process's."""
    choice, line = chosen_threads()
    if choice is not None or config is None or env_threads() is not None:
        yield line
        return
    with use_threads(Threads(config, f"train.threads={config}")):
        yield None
