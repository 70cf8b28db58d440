"""The run directory: where each file of a run lives, and how its JSON-lines files are read.

Every layer names a run's files through :class:`RunDir` (so this module imports nothing of the
package but :mod:`.errors`)::

    config.yaml        the fully resolved configuration          RunDir.config
    metrics.jsonl      one JSON object per logged step            RunDir.metrics
    summary.json       final and best figures of the run          RunDir.summary
    checkpoints/last/  the last checkpoint (checkpoints/)         RunDir.last_checkpoint
    checkpoints/step_<N>/  older ones kept (train.keep_checkpoints)
    .siamesenorm.lock  held while a process writes the run       siamesenorm.locks
    tokenizer/         a text run's tokenizer                     RunDir.tokenizer
    probes.jsonl       the training probes (analysis.every > 0)   RunDir.probes
    analysis.json      the analysis of the final model            RunDir.analysis
    analysis/          its plots                                  RunDir.plots
    samples/           a DiT's sample grids, step_<N>.png         RunDir.samples
    tb/                TensorBoard scalars (when installed)       RunDir.tensorboard

A folder *holds a run* once it has ``metrics.jsonl`` or ``checkpoints/``; a fresh run refuses such
a folder (:meth:`RunDir.refuse_existing_run`) and ``--resume`` continues it, except a run stopped
before its first checkpoint (nothing to resume), which a fresh run starts again. Single files are
written atomically (:func:`write_text`, :func:`write_json`).

JSON-lines files (``metrics.jsonl``, ``probes.jsonl``) are read by :func:`read_jsonl` alone, with
one policy: a missing file reads as no rows; blank lines are ignored; a last line without its
newline that is not valid JSON is a write cut short by a killed writer and is skipped; any other
line that is not a JSON object is a damaged file, a :class:`~.errors.ConfigError` naming the file
and the line. :func:`open_jsonl` reopens such a file for a (resumed) writer.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from .errors import ConfigError

__all__ = ["RunDir", "check_out_dir", "open_jsonl", "plain", "read_json", "read_jsonl", "write_json",
           "write_text"]


@dataclass(frozen=True)
class RunDir:
    """The layout of one run directory, around its folder ``path`` (a ``str`` is accepted).

    ``str(run_dir)`` is the folder as given, so messages name it as the user wrote it."""

    path: Path

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))

    def __str__(self) -> str:
        return str(self.path)

    def __fspath__(self) -> str:
        return os.fspath(self.path)

    # ---- the layout ------------------------------------------------------------------------------
    @property
    def config(self) -> Path:
        return self.path / "config.yaml"

    @property
    def metrics(self) -> Path:
        return self.path / "metrics.jsonl"

    @property
    def summary(self) -> Path:
        return self.path / "summary.json"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def last_checkpoint(self) -> Path:
        return self.checkpoints / "last"

    @property
    def tokenizer(self) -> Path:
        return self.path / "tokenizer"

    @property
    def probes(self) -> Path:
        return self.path / "probes.jsonl"

    @property
    def analysis(self) -> Path:
        return self.path / "analysis.json"

    @property
    def plots(self) -> Path:
        return self.path / "analysis"

    @property
    def samples(self) -> Path:
        return self.path / "samples"

    @property
    def tensorboard(self) -> Path:
        return self.path / "tb"

    def sample_grid(self, step: int) -> Path:
        """Where the sample grid of evaluation step ``step`` goes."""
        return self.samples / f"step_{step}.png"

    def sample_grids(self) -> list[Path]:
        """The sample grids the run wrote, by step (``[]`` when none)."""
        grids = [p for p in self.samples.glob("step_*.png") if p.stem[5:].isdigit()]
        return sorted(grids, key=lambda p: int(p.stem[5:]))

    # ---- whether it holds a run ------------------------------------------------------------------
    def holds_run(self) -> bool:
        """Whether a run was started here: it has ``metrics.jsonl`` or ``checkpoints/``."""
        return self.metrics.exists() or self.checkpoints.exists()

    def has_checkpoints(self) -> bool:
        """Whether a checkpoint was ever completed here: ``checkpoints/last``, a kept
        ``checkpoints/step_<N>``, or a last one whose swap a crash cut short."""
        folder = self.checkpoints
        if not folder.is_dir():
            return False
        return any((p / "state.pt").is_file() for p in folder.iterdir() if p.is_dir() and (
            p.name == "last" or p.name.startswith(".last.old-")
            or (p.name.startswith("step_") and p.name[5:].isdigit())))

    def stopped_before_first_checkpoint(self) -> bool:
        """A run that was started here and stopped (killed) before its first checkpoint: it has a
        log or a config but neither a checkpoint nor a summary. Nothing of it can be resumed."""
        return (self.holds_run() or self.config.exists()) and not self.has_checkpoints() \
            and not self.summary.exists()

    def refuse_existing_run(self) -> None:
        """The check of a fresh run: a :class:`ConfigError` when the folder already holds a run
        (one stopped before its first checkpoint does not count: it is started again)."""
        if self.holds_run() and not self.stopped_before_first_checkpoint():
            raise ConfigError(f"{self} already holds a run; resume it with --resume or choose "
                              "another --out")

    def clear_stopped_run(self) -> None:
        """Delete the files of a run stopped before its first checkpoint (and only the run's own
        files, by name), so that it starts again from nothing."""
        import shutil

        if not self.stopped_before_first_checkpoint():
            return
        for file in (self.metrics, self.config, self.probes, self.analysis):
            file.unlink(missing_ok=True)
        for folder in (self.tokenizer, self.tensorboard, self.samples, self.plots, self.checkpoints):
            shutil.rmtree(folder, ignore_errors=True)


def check_out_dir(path: str | os.PathLike, flag: str = "--out") -> None:
    """Refuse an output folder that is, or lies inside, an existing file (nothing is written)."""
    path = Path(path)
    for candidate in (path, *path.parents):
        if candidate.exists():
            if not candidate.is_dir():
                where = "is" if candidate == path else f"lies inside {candidate}, which is"
                raise ConfigError(f"{flag} {path} {where} a file, not a folder; remove it or choose "
                                  f"another {flag}")
            return


# ---- JSON-lines files ------------------------------------------------------------------------------
def _lines(path: Path) -> list[tuple[int, str, dict[str, Any]]]:
    """``(line number, text, row)`` of every row of ``path``, under :func:`read_jsonl`'s policy."""
    try:
        data = Path(path).read_bytes()
    except FileNotFoundError:
        return []
    except OSError as error:
        raise ConfigError(f"cannot read {path}: {error.strerror or error}") from None
    raw = data.split(b"\n")
    last = len(raw) - 1     # an unterminated last line (b"" when the file ends with a newline)
    rows = []
    for i, chunk in enumerate(raw):
        try:
            text = chunk.decode("utf-8")
            if not text.strip():
                continue
            row = json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            if i == last:   # cut short by a killed writer
                break
            why = error.msg if isinstance(error, json.JSONDecodeError) else "not UTF-8 text"
            raise ConfigError(f"{path}, line {i + 1}: not valid JSON ({why}); the file is damaged: "
                              "delete or repair that line") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{path}, line {i + 1}: a JSON {type(row).__name__}, not an object; the "
                              "file is damaged: delete or repair that line")
        rows.append((i + 1, text, row))
    return rows


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows (JSON objects) of the JSON-lines file ``path``.

    A missing file is no rows; blank lines are ignored; a last line that lacks its newline and is
    not valid JSON (a write cut short by a killed writer) is skipped. Any other line that is not a
    JSON object raises :class:`ConfigError`, one line naming the file and the line number.
    """
    return [row for _, _, row in _lines(Path(path))]


def open_jsonl(path: str | os.PathLike, keep_until: int | None = None) -> TextIO:
    """``path`` opened to append rows (UTF-8), after keeping only its rows whose integer ``step`` is
    at most ``keep_until`` (``None``: none, a fresh log). The kept lines stay byte for byte; they are
    rewritten through a temporary file and a rename. A damaged file raises as :func:`read_jsonl`."""
    path = Path(path)
    kept = [] if keep_until is None else \
        [text for _, text, row in _lines(path)
         if isinstance(row.get("step"), int) and not isinstance(row["step"], bool)
         and row["step"] <= keep_until]
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, path)
    return open(path, "a", encoding="utf-8")


def plain(value: Any) -> Any:
    """``value`` as strict JSON: a non-finite float becomes ``None`` (``null``), containers recurse,
    and a number-like object (a 0-D tensor, a numpy scalar) becomes its Python number."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, (str, bool, int)) or value is None:
        return value
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    return value


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically: a temporary file beside it, flushed to disk,
    then renamed over it. A reader sees the old file or the new one, never half of one; a failed
    write (a full disk) leaves no partial or empty file behind."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented strict JSON to ``path`` atomically (:func:`write_text`)."""
    write_text(path, json.dumps(plain(obj), indent=2, allow_nan=False) + "\n")


def read_json(path: str | os.PathLike) -> Any:
    """The JSON document in ``path``; a file that is not valid UTF-8 JSON (cut short, overwritten)
    is a :class:`ConfigError` naming it, one line."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ConfigError(f"cannot read {path}: {error.strerror or error}") from None
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        why = error.msg if isinstance(error, json.JSONDecodeError) else "not UTF-8 text"
        raise ConfigError(f"{path} is damaged (not valid JSON: {why}); delete it or restore it "
                          "from a copy") from None
