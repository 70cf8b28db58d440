"""What a run shows on stderr while it trains (docs/training.md): a bar on a terminal, otherwise lines
starting with :data:`LOG_PREFIX`; either way one final line."""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO

LOG_PREFIX = "[train]"      # every line a run writes to stderr (an error line never starts so)
LINES_PER_RUN = 100         # what the default interval aims at


def log_interval(every: int | None, steps: int) -> int:
    """Steps between log lines: ``every``, or by default ``ceil(steps / LINES_PER_RUN)``."""
    return max(1, -(-steps // LINES_PER_RUN)) if every is None else every


def rate(tokens_per_s: float) -> str:
    for unit, scale in (("M", 1e6), ("k", 1e3)):
        if tokens_per_s >= scale:
            return f"{tokens_per_s / scale:.1f}{unit} tok/s"
    return f"{tokens_per_s:.0f} tok/s"


def duration(seconds: float) -> str:
    """``4.2s``, ``42s``, ``3m05s``, ``2h07m``."""
    if seconds < 9.95:
        return f"{max(0.0, seconds):.1f}s"
    s = round(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _speed(tokens_per_s: float | None, tflops: float | None, mfu: float | None) -> list[str]:
    parts = [] if tokens_per_s is None else [rate(tokens_per_s)]
    if tflops is not None:
        parts.append(f"{tflops:.3g} TFLOP/s")
    if mfu is not None:
        parts.append(f"MFU {100 * mfu:.3g}%")
    return parts


def _evaluated(figures: dict[str, Any]) -> list[str]:
    """A validation's figures: the loss, then the task's (accuracy, ...); perplexity left out."""
    parts = [] if figures.get("val_loss") is None else [f"val loss {figures['val_loss']:.4f}"]
    for key, value in figures.items():
        if key not in ("val_loss", "val_ppl") and isinstance(value, (int, float)) \
                and not isinstance(value, bool):
            parts.append(f"{key} {value:.4g}")
    return parts


def _has_width(stream: TextIO) -> bool:
    """Whether the terminal ``stream`` writes to reports its width (a pseudo-terminal may say 0)."""
    try:
        return os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, OSError, ValueError):
        return False


class RunLog:
    """The display of one run, ``mode`` ``bar``, ``lines``, ``final`` (the final line only) or ``off``;
    ``start`` is the step it resumes from, ``note`` goes on the final line."""

    def __init__(self, total: int, start: int, every: int, mode: str, throughput: Any = None,
                 note: str | None = None, stream: TextIO | None = None) -> None:
        self.total, self.start, self.every, self.mode = total, start, every, mode
        self.throughput, self.note = throughput, note
        self.stream = sys.stderr if stream is None else stream
        self.tokens, self.seconds = 0, 0.0           # since the last line
        self.last_eval: list[str] = []
        self.bar = None
        if mode == "bar":
            from tqdm import tqdm

            # a fixed bar, so that a narrow terminal cuts the figures at the end, not the bar
            sized = _has_width(self.stream)
            self.bar = tqdm(total=total, initial=start, file=self.stream, unit="step", leave=True,
                            dynamic_ncols=sized, ncols=None if sized else 120, nrows=None if sized else 24,
                            bar_format="{percentage:3.0f}%|{bar:20}| {n_fmt}/{total_fmt} "
                                       "[{elapsed}, ETA {remaining}{postfix}]")

    @staticmethod
    def choose(progress: bool | None, every: int, stream: TextIO | None = None) -> str:
        """The mode for ``progress`` (``None``: a bar on a terminal, else lines) and ``every``."""
        if progress is False:
            return "off"
        if every == 0:
            return "final"
        if progress:
            return "bar"
        isatty = getattr(sys.stderr if stream is None else stream, "isatty", None)
        return "bar" if isatty is not None and isatty() else "lines"

    def _figures(self, tokens_per_s: float | None) -> list[str]:
        if self.throughput is None:
            return _speed(tokens_per_s, None, None)
        return _speed(tokens_per_s, self.throughput.tflops(tokens_per_s), self.throughput.mfu(tokens_per_s))

    def step(self, step: int, *, loss: float, lr: float, tokens: int, seconds: float,
             elapsed: float, session_s: float, evaluated: dict[str, Any] | None = None) -> None:
        """Record a completed step: ``tokens`` trained in ``seconds``; ``elapsed`` is the run's
        wall time so far, ``session_s`` this session's; ``evaluated``: a validation's figures."""
        if self.mode in ("off", "final"):
            return
        self.tokens, self.seconds = self.tokens + tokens, self.seconds + seconds
        if evaluated:
            self.last_eval = _evaluated(evaluated)
        if self.bar is not None:
            parts = [f"loss {loss:.4f}", *self.last_eval, f"lr {lr:.2e}",
                     *self._figures(tokens / seconds if seconds > 0 else None)]
            self.bar.set_postfix_str(", ".join(parts), refresh=False)
            self.bar.update(step - self.bar.n)
            return
        if not (step % self.every == 0 or evaluated):
            return
        done = step - self.start
        eta = session_s / done * (self.total - step) if done > 0 else None
        parts = [f"step {step}/{self.total}", f"loss {loss:.4f}", *_evaluated(evaluated or {}),
                 f"lr {lr:.2e}", *self._figures(self.tokens / self.seconds if self.seconds > 0 else None),
                 f"elapsed {duration(elapsed)}", f"ETA {'?' if eta is None else duration(eta)}"]
        self.tokens, self.seconds = 0, 0.0
        self._write(" | ".join(parts))

    def finish(self, summary: dict[str, Any]) -> None:
        """The final line, from the run's ``summary.json`` figures."""
        self.close()
        if self.mode == "off":
            return
        steps, took = summary["steps"], duration(summary.get("wall_time_s") or 0.0)
        if summary.get("diverged"):
            head = f"diverged at step {summary['diverged_at']}/{self.total} after {took}"
        elif summary.get("stalled"):
            head = (f"stalled at step {steps}/{self.total} after {took} (zero gradient from step "
                    f"{summary['stalled_at']})")
        elif summary.get("interrupted"):
            head = (f"interrupted at step {steps}/{self.total} after {took} (checkpoint at step "
                    f"{summary.get('checkpoint_step')})")
        else:
            head = f"done: {steps}/{self.total} steps in {took}"
        parts = [head]
        if summary.get("final_loss") is not None:
            parts.append(f"loss {summary['final_loss']:.4f}")
        if summary.get("final_val_loss") is not None:
            best = summary.get("best_val_loss")
            parts.append(f"val loss {summary['final_val_loss']:.4f}" + (
                "" if best is None else f" (best {best:.4f} at step {summary['best_val_step']})"))
        parts += _speed(summary.get("tokens_per_s"), summary.get("tflops"), summary.get("mfu"))
        if self.note:
            parts.append(self.note)
        self._write(" | ".join(parts))

    def _write(self, text: str) -> None:
        self.stream.write(f"{LOG_PREFIX} {text}\n")
        self.stream.flush()

    def close(self) -> None:
        """End the bar, so that what is printed next starts on a line of its own."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
