"""The shapes of the JSON documents the commands read back (a run folder may come back edited),
checked where they are read."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from .errors import UserError
from .rundir import read_json, read_jsonl

__all__ = ["ANALYSIS", "ANY", "BOOL", "EXPERIMENT_ROWS", "INT", "METRICS_ROW", "NUMBER", "OPT_INT",
           "OPT_NUMBER", "OPT_STR", "PROBE_ROW", "RUN_SUMMARY", "STR", "ListOf", "Obj", "check",
           "mismatch", "read_rows", "read_summary"]

ANY = object()
NUMBER = (int, float)
OPT_NUMBER = (int, float, type(None))
INT = int
OPT_INT = (int, type(None))
BOOL = bool
STR = str
OPT_STR = (str, type(None))


@dataclass(frozen=True)
class Obj:
    """A JSON object: ``keys`` maps a key to its shape (checked where present); ``required`` keys must be
    present; ``rest``, when given, is the shape of every key not listed."""

    keys: dict[str, Any] = field(default_factory=dict)
    required: tuple[str, ...] = ()
    rest: Any = ANY


@dataclass(frozen=True)
class ListOf:
    """A JSON array whose every item has the shape ``item``."""

    item: Any


_NAMES = {dict: "an object", list: "a list", str: "a string", int: "an integer", float: "a number",
          bool: "true or false", type(None): "null"}


def _name(shape: Any) -> str:
    if isinstance(shape, Obj):
        return "an object"
    if isinstance(shape, ListOf):
        return "a list"
    if isinstance(shape, tuple):
        names = list(dict.fromkeys(_name(t) if not isinstance(t, type) else
                                   "a number" if t in (int, float) and float in shape else _NAMES[t]
                                   for t in shape))
        return " or ".join(names)
    return _NAMES.get(shape, getattr(shape, "__name__", str(shape)))


def _is(value: Any, types: type | tuple[type, ...]) -> bool:
    types = types if isinstance(types, tuple) else (types,)
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, types)


def mismatch(value: Any, shape: Any, at: str = "") -> str | None:
    """Where and how ``value`` differs from ``shape`` (``"at runs[2].steps: expected an integer, got a
    string"``), or ``None``."""
    stack = [(value, shape, at)]
    while stack:
        value, shape, at = stack.pop()
        if shape is ANY:
            continue
        where = f"at {at}: " if at else ""
        if isinstance(shape, tuple) and not all(isinstance(s, type) for s in shape):
            problems = [mismatch(value, option, at) for option in shape]
            if all(problems):       # none fits: say why the one of the value's kind does not
                kind = [p for p, o in zip(problems, shape) if (isinstance(o, Obj) and isinstance(value, dict))
                        or (isinstance(o, ListOf) and isinstance(value, list))]
                return kind[0] if len(kind) == 1 else \
                    f"{where}expected {_name(shape)}, got {_NAMES.get(type(value), type(value).__name__)}"
            continue
        if isinstance(shape, Obj):
            if not isinstance(value, dict):
                return f"{where}expected an object, got {_NAMES.get(type(value), type(value).__name__)}"
            missing = [k for k in shape.required if k not in value]
            if missing:
                return f"{where}the key {missing[0]!r} is missing"
            for key, item in value.items():
                sub = shape.keys.get(key, shape.rest)
                stack.append((item, sub, f"{at}.{key}" if at else str(key)))
        elif isinstance(shape, ListOf):
            if not isinstance(value, list):
                return f"{where}expected a list, got {_NAMES.get(type(value), type(value).__name__)}"
            stack += [(item, shape.item, f"{at}[{i}]") for i, item in enumerate(value)]
        elif not _is(value, shape):
            return f"{where}expected {_name(shape)}, got {_NAMES.get(type(value), type(value).__name__)}"
    return None


def check(value: Any, shape: Any, where: str) -> Any:
    """``value``, read from ``where``, when it has ``shape`` (a type, ``int`` admitting no bool; a tuple
    of shapes, any one; :class:`Obj`, :class:`ListOf`, :data:`ANY`); else a one-line :class:`UserError`."""
    problem = mismatch(value, shape)
    if problem is not None:
        raise UserError(f"{where} is damaged (not what siamesenorm wrote: {problem}); delete it or "
                          "restore it from a copy")
    return value


# ---- the documents of a run folder and an experiment folder ---------------------------------------
# Their writers: siamesenorm.train (summary.json, metrics.jsonl), siamesenorm.analysis
# (probes.jsonl, analysis.json), siamesenorm.experiments (an experiment's summary.json). Keys not
# listed (a task's own ``final_<name>`` figures, for one) may hold anything.
# ``tokens_seen`` is null where it is not known (an imported OLMo-core run that saved no data loader).
_FLOATS = ListOf(OPT_NUMBER)
RUN_SUMMARY = Obj({
    "steps": INT, "steps_planned": INT, "diverged": BOOL, "diverged_at": OPT_INT, "stalled": BOOL,
    "stalled_at": OPT_INT, "failed": BOOL, "interrupted": BOOL, "checkpoint_step": OPT_INT,
    "final_loss": OPT_NUMBER, "best_loss": OPT_NUMBER, "final_val_loss": OPT_NUMBER,
    "final_val_ppl": OPT_NUMBER, "best_val_loss": OPT_NUMBER, "best_val_ppl": OPT_NUMBER,
    "best_val_step": OPT_INT, "wall_time_s": NUMBER, "train_time_s": NUMBER, "tokens_seen": OPT_INT,
    "tokens_per_s": OPT_NUMBER, "num_parameters": INT, "flops_per_token": OPT_NUMBER,
    "unigram_val_loss": OPT_NUMBER, "data": Obj({"name": STR}), "environment": Obj(),
}, required=("steps", "diverged"))
METRICS_ROW = Obj({
    "step": INT, "loss": OPT_NUMBER, "lr": OPT_NUMBER, "grad_norm": OPT_NUMBER,
    "tokens_per_s": OPT_NUMBER, "tflops": OPT_NUMBER, "val_loss": OPT_NUMBER, "val_ppl": OPT_NUMBER,
    "expert_load": ListOf(_FLOATS), "expert_load_max": OPT_NUMBER, "router_entropy": OPT_NUMBER,
    "val_acc": OPT_NUMBER, "arith_acc": OPT_NUMBER, "fd_proxy": OPT_NUMBER, "sample_acc": OPT_NUMBER,
    "stalled": BOOL, "stalled_at": OPT_INT,
}, required=("step",))
_STREAMS = Obj(rest=_FLOATS)               # stream name -> one figure per sublayer (or depth)
_GAINS = Obj(rest=(int, float, list, type(None)))
PROBE_ROW = Obj({"step": INT, "grad_norm": OPT_NUMBER, "grad_norm_blocks": _FLOATS,
                 "grad_norm_scheme": OPT_NUMBER, "rms": _STREAMS, "gains": _GAINS}, required=("step",))
ANALYSIS = Obj({
    "scheme": STR, "n_layers": INT, "sublayers_per_block": INT, "batches": INT, "loss": OPT_NUMBER,
    "pruning": Obj({"base_loss": OPT_NUMBER, "per_block": _FLOATS, "depth_curve": _FLOATS,
                    "effective_depth": OPT_NUMBER}),
    "lens": (Obj({"positions": INT, "agreement": Obj(rest=OPT_NUMBER), "by_depth": _STREAMS}),
             type(None)),
    "angular": _STREAMS,
    "probes": Obj({"rms": _STREAMS, "gains": _GAINS, "grad_norm": Obj({"blocks": _FLOATS})}),
})
EXPERIMENT_ROWS = ListOf(Obj({"run": STR, "scheme": STR, "lr": NUMBER, "seed": INT,
                              "final_val_loss": OPT_NUMBER, "best_val_loss": OPT_NUMBER,
                              "diverged": (bool, type(None)), "diverged_at": OPT_INT,
                              "stalled_at": OPT_INT, "steps": OPT_INT},
                             required=("run", "scheme", "lr", "seed")))


def read_summary(path: str | os.PathLike) -> dict[str, Any]:
    """A run's ``summary.json``, checked against :data:`RUN_SUMMARY`."""
    return check(read_json(path), RUN_SUMMARY, str(path))


def read_rows(path: str | os.PathLike, row: Obj) -> list[dict[str, Any]]:
    """The rows of the JSON-lines file ``path`` (none when it is missing), each checked against ``row``."""
    return [check(r, row, f"{path} (row {i})") for i, r in enumerate(read_jsonl(path), 1)]
