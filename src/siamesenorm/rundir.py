"""The run directory: where each file of a run lives, and how its JSON-lines files are read.

Every layer names a run's files through :class:`RunDir` (so this module imports nothing of the
package but :mod:`.errors`, the version and the checkpoint's file names): ``config.yaml``,
``metrics.jsonl``, ``summary.json``, ``checkpoints/``, ``tokenizer/``, ``probes.jsonl``,
``analysis.json``, ``analysis/``, ``samples/``, ``tb/`` and the marker ``.siamesenorm-run.json``
(the table: docs/tasks.md, "A run's folder").
A folder *holds a run* once it has ``metrics.jsonl`` or ``checkpoints/``; a fresh run refuses it
(:meth:`RunDir.refuse_existing_run`) and any other non-empty folder, unless it is a run this tool
marked that stopped before its first checkpoint: that one's own files are deleted
(:meth:`RunDir.clear_run_files`; docs/security.md). Single files are written atomically through a
fresh temporary file a planted symbolic link cannot redirect (:func:`write_text`,
:func:`write_json`, :func:`replacing`). :func:`read_jsonl` reads ``metrics.jsonl`` and
``probes.jsonl``: missing is no rows, blank lines are ignored, an unterminated invalid last line
(a killed writer) is skipped, any other bad line is a :class:`~.errors.UserError` naming it.
"""

from __future__ import annotations

import errno
import json
import math
import os
import re
import stat
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from .errors import ENVIRONMENT_ERRNOS, UserError

__all__ = ["LATER_DATA_ENTRIES", "MARKER_NAME", "MAX_JSON_DEPTH", "RunDir", "as_created", "check_out_dir",
           "fill_unrecorded", "inner_folder", "library_os_error", "open_jsonl", "plain", "read_json",
           "read_jsonl", "replacing", "save_figure", "write_json", "write_text"]

MARKER_NAME = ".siamesenorm-run.json"
_LOCK_NAME = ".siamesenorm.lock"        # siamesenorm.locks.LOCK_NAME (which imports this module's peers)


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

    def read_config(self) -> dict:
        """``config.yaml`` as a dict, ``{}`` when missing or unreadable (for reports: a run's own
        loading says what is wrong with it)."""
        import yaml

        try:
            data = yaml.safe_load(self.config.read_text(encoding="utf-8"))
        except (OSError, ValueError, yaml.YAMLError, RecursionError):      # ValueError: not UTF-8
            return {}
        return data if isinstance(data, dict) else {}

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

    @property
    def marker(self) -> Path:
        return self.path / MARKER_NAME

    def sample_grid(self, step: int) -> Path:
        """Where the sample grid of evaluation step ``step`` goes."""
        return self.samples / f"step_{step}.png"

    def sample_grids(self) -> list[Path]:
        """The sample grids the run wrote, by step (``[]`` when none)."""
        grids = [p for p in self.samples.glob("step_*.png") if p.stem[5:].isdigit()]
        return sorted(grids, key=lambda p: int(p.stem[5:]))

    # ---- whether it holds a run ------------------------------------------------------------------
    def holds_run(self) -> bool:
        """Whether a run was started here: it has ``metrics.jsonl`` or a ``checkpoints/`` that is
        not empty (an empty one, or a link to an empty folder, waits for a run's checkpoints)."""
        return self.metrics.exists() or (self.checkpoints.exists() and not self._empty_checkpoints())

    def has_checkpoints(self) -> bool:
        """Whether a checkpoint was ever completed here: ``checkpoints/last``, a kept
        ``checkpoints/step_<N>``, or a last one whose swap a crash cut short."""
        # here, not at the top: importing it runs train/__init__, which imports this module
        from .train.checkpoint.names import KEPT_PREFIX, OLD_MARK, STATE_FILE

        folder, last = self.checkpoints, self.last_checkpoint.name
        if not folder.is_dir():
            return False
        return any((p / STATE_FILE).is_file() for p in folder.iterdir() if p.is_dir() and (
            p.name == last or p.name.startswith(f".{last}{OLD_MARK}")
            or (p.name.startswith(KEPT_PREFIX) and p.name[len(KEPT_PREFIX):].isdigit())))

    def marked(self) -> bool:
        """Whether this tool created a run here (:meth:`mark`): its marker is a regular file."""
        try:
            return stat.S_ISREG(os.lstat(self.marker).st_mode)
        except OSError:
            return False

    def mark(self) -> None:
        """Mark the folder as a run this tool created (the first file a fresh run writes)."""
        from .version import __version__

        write_json(self.marker, {"created_by": f"siamesenorm {__version__}",
                                 "created": time.strftime("%Y-%m-%d %H:%M:%S")})

    def stopped_before_first_checkpoint(self) -> bool:
        """A run this tool started here (marked) that stopped (killed) before its first checkpoint:
        neither a checkpoint nor a summary. Nothing of it can be resumed."""
        return self.marked() and not self.has_checkpoints() and not self.summary.exists()

    def _foreign(self) -> list[str]:
        """The names in the folder besides its lock and an empty ``checkpoints/`` (``[]``: missing
        or empty). An empty ``checkpoints/``, or a link there to an empty folder on another disk
        (docs/security.md), is where a new run's checkpoints are to go, not a run."""
        try:
            names = sorted(p.name for p in self.path.iterdir() if p.name != _LOCK_NAME)
        except (FileNotFoundError, NotADirectoryError):
            return []
        if self.checkpoints.name in names and self._empty_checkpoints():
            names.remove(self.checkpoints.name)
        return names

    def _empty_checkpoints(self) -> bool:
        """Whether ``checkpoints/`` is a folder, or a link to one, that holds nothing."""
        try:
            return self.checkpoints.is_dir() and not any(self.checkpoints.iterdir())
        except OSError:
            return False

    def refuse_existing_run(self, restart: bool = False) -> None:
        """The check of a fresh run (:class:`UserError`, one line): the folder must be missing,
        empty, or a run this tool marked that stopped before its first checkpoint (``restart``: any
        run this tool marked: compare's own, started again). Anything else is not ours to replace:
        a run, a compare experiment, the root folder, a repository, a folder of a user's files."""
        names = self._foreign()
        if not names:
            return
        if self.marked() and (restart or self.stopped_before_first_checkpoint()):
            return
        where = str(self)
        if self.holds_run() and (self.marked() or self.has_checkpoints() or self.summary.exists()):
            raise UserError(f"{where} already holds a run; resume it with --resume or choose "
                              "another --out")
        if self.holds_run():
            raise UserError(f"{where} already holds a run without a checkpoint that siamesenorm "
                              "did not mark as its own (an older version's?); delete it or choose "
                              "another --out")
        if (self.path / "experiment.json").exists():
            raise UserError(f"{where} is a compare experiment folder (its runs are inside it); "
                              "choose another --out")
        shown = ", ".join(names[:4]) + (", ..." if len(names) > 4 else "")
        full = self.path.resolve()
        what = "the root folder" if full == Path(full.anchor) else "a folder"
        raise UserError(f"{where} is {what} that holds other files ({shown}) and no run of "
                          "siamesenorm; train into a new or empty folder (choose another --out)")

    def clear_run_files(self) -> None:
        """Delete what a run of this tool writes here, by name: its files (and their temporary
        versions), its checkpoints, and the known files of its tokenizer, TensorBoard, sample and
        plot folders, which go once empty; a user's files among them stay. The marker goes last.
        Only for a marked folder (a :class:`UserError` otherwise)."""
        import shutil

        if not self.marked():
            raise UserError(f"{self} was not created by siamesenorm as a run; nothing is deleted")
        for file in (self.metrics, self.config, self.summary, self.probes, self.analysis):
            file.unlink(missing_ok=True)
            for tmp in self.path.glob(f".{file.name}.tmp-*"):
                tmp.unlink(missing_ok=True)
        owned = {
            self.checkpoints: r"last|step_\d+|\.last\.(tmp|old)-.*|damaged-.*",
            self.tokenizer: r"tokenizer_kind\.json|bpe\.json|\.(tokenizer_kind|bpe)\.json\.tmp-.*",
            self.tensorboard: r"events\.out\.tfevents\..*",
            self.samples: r"step_\d+\.png|\.step_\d+\.png\..*\.tmp",
            self.plots: r"(hidden_rms|grad_norm|gains|pruning|logit_lens|angular)\.png|\..*\.png\..*tmp.*",
        }
        for folder, pattern in owned.items():
            if folder.is_symlink() or not folder.is_dir():
                continue
            for entry in folder.iterdir():
                if re.fullmatch(pattern, entry.name):
                    if entry.is_dir() and not entry.is_symlink():
                        shutil.rmtree(entry)
                    else:
                        entry.unlink(missing_ok=True)
            try:
                folder.rmdir()
            except OSError:         # a user's file left in it
                pass
        self.marker.unlink(missing_ok=True)

    # ---- the data a run trained on -------------------------------------------------------------
    def recorded_data(self) -> dict | None:
        """The data record of the run (its ``data`` entry, e.g. corpus name and fingerprint):
        from the marker, else from ``summary.json`` (runs of older versions); ``None``: none."""
        for file in (self.marker, self.summary):
            try:
                found = json.loads(file.read_bytes()).get("data") if file.is_file() else None
            except (OSError, ValueError, AttributeError):
                continue
            if found is not None:
                return found
        return None

    def data_history(self) -> list:
        """The data records a resumed run replaced (``--allow-data-change``), oldest first."""
        try:
            found = json.loads(self.marker.read_bytes()).get("data_history")
        except (OSError, ValueError, AttributeError):
            return []
        return found if isinstance(found, list) else []

    def record_data(self, data: Any, replaced: Any = None) -> list:
        """Record ``data`` in the marker (of a marked run) as what the run trains on; ``replaced``:
        the record it replaces, kept in ``data_history``. Returns the history."""
        try:
            record = json.loads(self.marker.read_bytes())
            record = record if isinstance(record, dict) else {}
        except (OSError, ValueError):
            record = {}
        history = self.data_history()
        if replaced is not None:
            history = [*history, {"data": replaced, "until": time.strftime("%Y-%m-%d %H:%M:%S")}]
        write_json(self.marker, {**record, "data": data, **({"data_history": history} if history else {})})
        return history


    def record_extension(self, entry: dict) -> None:
        """Append ``entry`` (what ``train --resume`` with overrides changed, and when) to the
        marker's ``extensions``, the run's own record of its settings' history."""
        try:
            record = json.loads(self.marker.read_bytes())
            record = record if isinstance(record, dict) else {}
        except (OSError, ValueError):
            record = {}
        done = record.get("extensions") if isinstance(record.get("extensions"), list) else []
        write_json(self.marker, {**record, "extensions": [*done, entry]})


# Entries of a data record (RunDir.recorded_data) that older versions did not write: the content
# hash of a token-file corpus. Missing from a run's record they are unknown, not a change of data.
LATER_DATA_ENTRIES = (("fingerprint", "sha256"), ("fingerprint", "val_sha256"))


def fill_unrecorded(before: Any, now: Any) -> tuple[Any, list[str]]:
    """``before`` (the data record a run started with) with each of :data:`LATER_DATA_ENTRIES` it
    lacks and ``now`` has taken from ``now``, and their dotted names (``data.fingerprint.sha256``):
    a resumed run compares what both records hold, and says which entries were unknown. Every
    other entry, and a record that is not a mapping, is left as it is."""
    filled, unknown = before, []
    for path in LATER_DATA_ENTRIES:
        theirs, mine = now, filled
        for key in path[:-1]:
            theirs = theirs.get(key) if isinstance(theirs, dict) else None
            mine = mine.get(key) if isinstance(mine, dict) else None
        if isinstance(theirs, dict) and isinstance(mine, dict) and path[-1] in theirs \
                and path[-1] not in mine:
            filled = json.loads(json.dumps(filled))         # a copy: the caller's record untouched
            target = filled
            for key in path[:-1]:
                target = target[key]
            target[path[-1]] = theirs[path[-1]]
            unknown.append(".".join(("data", *path)))
    return filled, unknown


def inner_folder(path: str | os.PathLike) -> Path:
    """``path``, a folder a run (or an analysis) writes inside itself (``tb/``, ``analysis/``,
    ``samples/``, ``tokenizer/``, ``wandb/``), created if missing. A link under its name, or a file,
    is refused (:class:`UserError`, one line): files written there would land outside the run
    (only ``checkpoints/``, or the run folder itself, may lead to another disk)."""
    path = Path(path)
    if path.is_symlink():
        raise UserError(f"{path} is a link (to {os.readlink(path)}); a run writes its {path.name}/ "
                        "inside itself: remove the link (only checkpoints/ may lead elsewhere)")
    if path.exists() and not path.is_dir():
        raise UserError(f"{path} is a file where the run writes its {path.name}/ folder; move it away")
    path.mkdir(parents=True, exist_ok=True)
    return path


def check_out_dir(path: str | os.PathLike, flag: str = "--out") -> None:
    """Refuse an output folder that is, or lies inside, an existing file (nothing is written)."""
    path = Path(path)
    for candidate in (path, *path.parents):
        if candidate.exists():
            if not candidate.is_dir():
                where = "is" if candidate == path else f"lies inside {candidate}, which is"
                raise UserError(f"{flag} {path} {where} a file, not a folder; remove it or choose "
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
        raise UserError(f"cannot read {path}: {error.strerror or error}") from None
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
            raise UserError(f"{path}, line {i + 1}: not valid JSON ({why}); the file is damaged: "
                              "delete or repair that line") from None
        if not isinstance(row, dict):
            raise UserError(f"{path}, line {i + 1}: a JSON {type(row).__name__}, not an object; the "
                              "file is damaged: delete or repair that line")
        rows.append((i + 1, text, row))
    return rows


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The rows (JSON objects) of the JSON-lines file ``path``.

    A missing file is no rows; blank lines are ignored; a last line that lacks its newline and is
    not valid JSON (a write cut short by a killed writer) is skipped. Any other line that is not a
    JSON object raises :class:`UserError`, one line naming the file and the line number.
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
    write_text(path, "".join(line + "\n" for line in kept))
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0))
    return os.fdopen(fd, "a", encoding="utf-8")


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


def _create_new(path: Path) -> int:
    """A file descriptor of ``path`` created afresh for writing (exclusively: a file or symbolic
    link already there under that name, a leftover of a killed writer, is removed first, never
    followed)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        return os.open(path, flags, 0o644)
    except FileExistsError:
        path.unlink()
        return os.open(path, flags, 0o644)


def write_text(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` (UTF-8) to ``path`` atomically: a temporary file beside it, created afresh
    (a symbolic link under its name is not followed), flushed to disk, then renamed over ``path``
    (which replaces a link there rather than writing through it). A reader sees the old file or
    the new one, never half of one; a failed write (a full disk) leaves no partial or empty file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with os.fdopen(_create_new(tmp), "w", encoding="utf-8", newline="") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        tmp.unlink(missing_ok=True)
        if isinstance(error, OSError) and error.filename is None and error.errno is not None:
            raise OSError(error.errno, error.strerror, str(path)) from None    # name the file
        raise


def as_created(path: str | os.PathLike) -> None:
    """Give ``path``, made by ``mkstemp`` or ``mkdtemp`` (owner only: 0600, 0700), the mode a file
    or folder created plainly gets under the process's umask (0644, 0755 as a rule), so that a
    results folder shared with colleagues is readable like the rest of its files."""
    mask = os.umask(0)
    os.umask(mask)
    os.chmod(path, (0o777 if os.path.isdir(path) else 0o666) & ~mask)


@contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """For a writer that takes a path (a library's ``save(path)``): yields a fresh temporary file
    beside ``path`` (created exclusively, so nothing planted under its name is followed) for it to
    write, then renames it over ``path``; on failure the temporary file goes and ``path`` is as it
    was. A library's failure on a full or read-only disk is raised as its OSError, naming ``path``
    (see :func:`library_os_error`)."""
    path = Path(path)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        as_created(tmp)
        os.replace(tmp, path)
    except BaseException as error:
        tmp.unlink(missing_ok=True)
        found = library_os_error(error, path)
        if found is not None and found is not error:
            raise found from None
        raise


def save_figure(fig: Any, path: str | os.PathLike, **options: Any) -> None:
    """``fig.savefig`` (matplotlib) to ``path`` through :func:`replacing`; the format is the
    suffix's (``.png``)."""
    path = Path(path)
    with replacing(path) as tmp:
        fig.savefig(tmp, format=path.suffix.lstrip(".") or "png", **options)


_OS_ERROR_TEXT = re.compile(r"os error (\d+)|\[Errno (\d+)\]")


def library_os_error(error: BaseException, path: str | os.PathLike) -> OSError | None:
    """The operating system's refusal (a full disk, a read-only one, a quota: one of
    :data:`~.errors.ENVIRONMENT_ERRNOS`) behind ``error``, a library writer's failure, as an
    :class:`OSError` naming ``path``; ``None`` when there is none (a bug stays loud).

    Libraries wrap it: torch's writers in a ``RuntimeError`` whose chain holds it,
    ``torch.distributed.checkpoint`` in a ``CheckpointException`` (per rank), safetensors and
    tokenizers in their own error whose text says ``(os error 28)``."""
    seen: set[int] = set()
    todo: list[BaseException | None] = [error]
    while todo:
        exc = todo.pop(0)
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        if not isinstance(exc, Exception) and not hasattr(exc, "failures"):
            continue        # KeyboardInterrupt, SystemExit: not a write failure
        code = exc.errno if isinstance(exc, OSError) else None
        if code is None and not isinstance(exc, OSError):
            found = _OS_ERROR_TEXT.search(str(exc).split("\n", 1)[0])
            code = int(found.group(1) or found.group(2)) if found else None
        if code in ENVIRONMENT_ERRNOS and code != errno.ENOENT:
            return OSError(code, os.strerror(code), str(path))
        failures = getattr(exc, "failures", None)
        if isinstance(failures, dict):
            todo += [f[0] if isinstance(f, tuple) else f for _, f in sorted(failures.items())]
        todo += [exc.__cause__, exc.__context__]
    return None


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Write ``obj`` as indented strict JSON to ``path`` atomically (:func:`write_text`)."""
    write_text(path, json.dumps(plain(obj), indent=2, allow_nan=False) + "\n")


# How deeply a JSON document that siamesenorm reads may nest objects and arrays: the files it reads
# (summaries, markers, OLMo-core's config.json) nest fewer than ten levels; the readers after
# json.loads (OLMo-core's from_dict, the allow-list walk) recurse, and fail near a thousand.
# The bound of a YAML preset (config.MAX_YAML_DEPTH), which this module cannot import.
MAX_JSON_DEPTH = 64


def _json_depth(obj: Any) -> int:
    """How deeply ``obj`` nests dicts and lists (0 for a scalar), walked without recursion."""
    deepest, todo = 0, [(obj, 1)]
    while todo:
        node, depth = todo.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_JSON_DEPTH:
                todo += [(v, depth + 1) for v in (node.values() if isinstance(node, dict) else node)]
    return deepest


def read_json(path: str | os.PathLike, *, max_bytes: int | None = None) -> Any:
    """The JSON document in ``path``; a file that is not valid UTF-8 JSON (cut short, overwritten),
    nests objects and arrays more than :data:`MAX_JSON_DEPTH` levels, or (``max_bytes``) is larger
    than that is a :class:`UserError` naming it, one line."""
    path = Path(path)
    try:
        if max_bytes is not None and (size := path.stat().st_size) > max_bytes:
            raise UserError(f"{path} is {size:,} bytes, more than the {max_bytes:,} this file can "
                            "hold (at most that is read): is this the right file?")
        data = path.read_bytes()
    except OSError as error:
        raise UserError(f"cannot read {path}: {error.strerror or error}") from None
    try:
        obj = json.loads(data.decode("utf-8"))
    except RecursionError:
        obj = None
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        why = error.msg if isinstance(error, json.JSONDecodeError) else "not UTF-8 text"
        raise UserError(f"{path} is damaged (not valid JSON: {why}); delete it or restore it "
                          "from a copy") from None
    else:
        if _json_depth(obj) <= MAX_JSON_DEPTH:
            return obj
    raise UserError(f"{path} nests objects or arrays more than {MAX_JSON_DEPTH} levels deep; no file "
                    "siamesenorm reads needs that many: is this the right file?")
