"""What the diagnostics callbacks of other trainers share (``siamesenorm.hf`` and
``siamesenorm.olmo_core``): a model seen as a scheme host, :class:`TrainingProbes` every N steps with
spikes flagged, the probe record as flat metrics for the trainer's loggers, and :func:`analyze_model`
at the end (docs/analysis.md, "In your own trainer")."""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..errors import UserError
from ..models.host import rng_devices
from ..schemes.base import SUBLAYERS_PER_BLOCK, ResidualScheme
from .adapters import HeadFn, LossFn
from .report_section import SPIKE_FACTOR
from .run_analysis import analyze_model, write_analysis
from .training_probes import TrainingProbes, to_device

__all__ = ["MIN_HISTORY", "PREFIX", "Diagnostics", "SchemeView", "check_every", "eager",
           "probe_metrics"]

PREFIX = "diagnostics/"
MIN_HISTORY = 3     # earlier probes a spike is judged against


class SchemeView(nn.Module):
    """``module`` (registered: its parameters, train and eval) as a scheme host with ``scheme`` and
    ``sublayers`` (attention, MLP, ... alternating), for the diagnostics."""

    def __init__(self, module: nn.Module, scheme: ResidualScheme, sublayers: Sequence[nn.Module]) -> None:
        super().__init__()
        self.module = module
        self.__dict__["_host"] = (scheme, list(sublayers))     # not registered twice

    @property
    def scheme(self) -> ResidualScheme:
        return self.__dict__["_host"][0]

    @property
    def sublayers(self) -> list[nn.Module]:
        return self.__dict__["_host"][1]


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Compiled code runs eagerly inside (no recompilation for the tapped scheme)."""
    with torch.compiler.set_stance("force_eager"):
        yield


def check_every(every: Any) -> int:
    if every is None:
        return 0
    if isinstance(every, bool) or not isinstance(every, int) or every < 0:
        raise UserError(f"every must be a number of steps (0 or None: off), got {every!r}")
    return every


def _indexed(n: int) -> str:
    return "{:0" + str(len(str(max(n - 1, 0)))) + "d}"


def probe_metrics(row: dict[str, Any], per: int = SUBLAYERS_PER_BLOCK) -> dict[str, float]:
    """A probe record as scalars: totals, per block (zero-padded, so they sort), each stream's RMS at
    the block boundaries (``block0``: the entry state) and every norm gain."""
    out: dict[str, Any] = {"grad_norm": row.get("grad_norm"),
                           "grad_norm_scheme": row.get("grad_norm_scheme"),
                           "spike": float(row["spike"]) if "spike" in row else None}
    blocks = row.get("grad_norm_blocks") or []
    fmt = _indexed(len(blocks))
    out |= {f"grad_norm_block/{fmt.format(b)}": v for b, v in enumerate(blocks)}
    for stream, values in row["rms"].items():
        at = values[::per]
        fmt = _indexed(len(at))
        out |= {f"rms_{stream}/block{fmt.format(b)}": v for b, v in enumerate(at)}
    for name, gain in row["gains"].items():
        if isinstance(gain, list):
            fmt = _indexed(len(gain))
            out |= {f"gain_{name}/{fmt.format(i)}": v for i, v in enumerate(gain)}
        else:
            out[f"gain_{name}"] = gain
    return {PREFIX + k: float(v) for k, v in out.items() if v is not None}


class Diagnostics:
    """The probes of one training run, driven by a trainer's callback: :meth:`gradients` once a probed
    step's gradients are complete (before clipping), :meth:`record` after its update, :meth:`analyze`
    at the end. ``writer``: the process that writes (rank 0); every rank computes."""

    def __init__(self, every: int | None, loss_fn: LossFn, head_fn: HeadFn | None,
                 batch: Any = None) -> None:
        self.every = check_every(every)
        self.loss_fn, self.head_fn = loss_fn, head_fn
        self.probes = TrainingProbes(self.every, batch, loss_fn) if self.every else None
        self.totals: list[float] = []
        self.writer, self.folder = True, None

    @property
    def batch(self) -> Any:
        return self.probes.batch if self.probes is not None else None

    @batch.setter
    def batch(self, value: Any) -> None:
        if self.probes is not None:
            self.probes.batch = value

    def start(self, folder: str | Path, step: int, writer: bool = True) -> None:
        """Append to ``folder/probes.jsonl``, its rows after ``step`` (a resumed run's) dropped."""
        self.writer, self.folder = writer, Path(folder)
        if self.probes is not None and writer:
            Path(folder).mkdir(parents=True, exist_ok=True)
            self.probes.start(Path(folder), step)

    def wants(self, step: int) -> bool:
        return self.probes is not None and step > 0 and self.probes.wants(step)

    def gradients(self, host: nn.Module, step: int) -> None:
        self.probes.after_backward(host, step)

    def record(self, host: nn.Module, step: int) -> dict[str, Any]:
        """The row of ``step``: its gradient norms, then stream RMS and gains of the updated model."""
        device = next(host.parameters()).device
        with torch.random.fork_rng(**rng_devices(device)), eager():
            return self.probes.make_row(host, step)

    def finish(self, row: dict[str, Any]) -> dict[str, float]:
        """Flag a spike (a total above ``SPIKE_FACTOR`` x the median of the earlier probes'), write the
        row; returns its metrics."""
        total = row.get("grad_norm")
        if total is not None:
            row["spike"] = len(self.totals) >= MIN_HISTORY and \
                total > SPIKE_FACTOR * statistics.median(self.totals)
            self.totals.append(total)
        if self.writer:
            self.probes.write(row)
        return probe_metrics(row)

    def analyze(self, host: nn.Module, batches: Sequence[Any], out: str | Path, *,
                source: str) -> dict[str, Any]:
        """:func:`analyze_model` on ``batches`` (random state kept), written to ``out`` as
        ``siamesenorm analyze`` writes it, the training curve from this run's ``probes.jsonl``."""
        if not batches:
            raise UserError("the analysis needs at least one batch: give batches, or a probe batch")
        device = next(host.parameters()).device
        with torch.random.fork_rng(**rng_devices(device)), eager(), torch.enable_grad():
            result = analyze_model(host, [to_device(b, device) for b in batches], self.loss_fn,
                                   self.head_fn)
        if self.writer:
            write_analysis(out, result, source=source, run_dir=self.folder or out)
        return result

    def close(self) -> None:
        if self.probes is not None:
            self.probes.close()
