"""Run configuration: a YAML preset plus ``key=value`` overrides with dotted keys.

A run's configuration is a tree of frozen dataclasses, each task's top class declaring its sections
(``train`` and ``analysis`` are shared, here). :func:`build_config` starts from the defaults,
applies the preset, then each override, checking each key and value where it enters, then builds
each section once, running its own checks; an error is a one-line :class:`UserError` naming the key.
"""

from __future__ import annotations

import copy as _copy
import dataclasses
import difflib
import functools
import math
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import yaml

from .devices import check_device_name, check_threads
from .errors import UserError
from .schemes import check_scheme_options

PRESET_DIR = Path(__file__).parent / "configs"


# Seeds are what torch.manual_seed and numpy's generators take alike: 0 .. 2**63 - 1.
SEED_MAX = 2**63 - 1

PARALLEL_MODES = ("auto", "none", "ddp", "fsdp")
PRECISIONS = ("auto", "fp32", "bf16")
CHECKPOINTING_MODES = ("none", "sublayer", "selective")
LOGGERS = ("tensorboard", "wandb")     # where train.loggers sends the metrics


@dataclass(frozen=True)
class TrainConfig:
    """How to train: AdamW, linear warm-up then cosine decay, clipping, accumulation (the global
    batch is world size x ``data.batch_size`` x ``grad_accum``). ``parallel``: ``auto`` is FSDP2
    above one process; ``precision``: ``auto`` is bf16 autocast on CUDA; ``stall_steps``: steps of
    an exactly zero gradient that stop a run; ``log_every``: ``null`` for at most a hundred plain
    lines, 0 for the last only; ``peak_tflops``: for MFU (``null``: the GPU's known peak);
    ``loggers``: besides ``metrics.jsonl`` (docs/tasks.md); ``threads``: per process (null or
    ``auto``: the free cores, docs/training.md#threads)."""

    steps: int = 200
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup: int = 20
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    grad_accum: int = 1
    eval_every: int = 50
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    stall_steps: int = 20
    divergence_factor: float = 3.0
    compile: bool = False
    device: str = "auto"
    parallel: str = "auto"
    precision: str = "auto"
    activation_checkpointing: str = "none"
    deterministic: bool = False
    log_every: int | None = None
    peak_tflops: float | None = None
    loggers: tuple[str, ...] = ("tensorboard",)
    threads: int | str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "threads", check_threads(self.threads))
        for name, allowed in (("parallel", PARALLEL_MODES), ("precision", PRECISIONS),
                              ("activation_checkpointing", CHECKPOINTING_MODES)):
            if getattr(self, name) not in allowed:
                raise UserError(f"train.{name} must be one of {', '.join(allowed)}, "
                                  f"got {getattr(self, name)!r}")
        for name in ("steps", "grad_accum", "eval_every", "checkpoint_every", "keep_checkpoints",
                     "stall_steps"):
            if getattr(self, name) <= 0:
                raise UserError(f"train.{name} must be positive, got {getattr(self, name)}")
        for name in ("warmup", "weight_decay", "grad_clip"):     # NaN is neither: refused too
            if not 0 <= getattr(self, name) < math.inf:
                raise UserError(f"train.{name} must not be negative, and be finite, got "
                                f"{getattr(self, name)}")
        if not 0 < self.lr < math.inf:
            raise UserError(f"train.lr must be a positive finite number, got {self.lr}")
        for i, beta in enumerate(self.betas):
            if not 0 <= beta < 1:
                raise UserError(f"train.betas[{i}] must be in [0, 1), got {beta} (AdamW's decay "
                                  "rates, e.g. train.betas=[0.9,0.95])")
        if not 0 <= self.min_lr_ratio <= 1:
            raise UserError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not 1 < self.divergence_factor < math.inf:
            raise UserError(f"train.divergence_factor must be a finite number above 1, got "
                            f"{self.divergence_factor}")
        if self.log_every is not None and self.log_every < 0:
            raise UserError(f"train.log_every must not be negative (0: only the final line; null: "
                              f"at most 100 lines per run), got {self.log_every}")
        if self.peak_tflops is not None and not 0 < self.peak_tflops < math.inf:
            raise UserError(f"train.peak_tflops must be a positive number (the device's peak "
                              f"TFLOP/s), got {self.peak_tflops}")
        for name in self.loggers:
            if name not in LOGGERS:
                raise UserError(f"train.loggers: unknown logger {name!r}; choose from {', '.join(LOGGERS)} "
                                "(a list, [] for none)")
        if len(set(self.loggers)) != len(self.loggers):
            raise UserError(f"train.loggers names a logger twice: {list(self.loggers)}")
        check_device_name(self.device)      # its presence is checked where the run starts


@dataclass(frozen=True)
class AnalysisConfig:
    """The paper's diagnostics (docs/analysis.md): probes every ``every`` steps (0: off) on
    ``batch_size`` validation sequences; ``batches`` for ``siamesenorm analyze``; ``at_end``: the
    final model analysed when probes are on."""

    every: int = 0
    batch_size: int = 4
    batches: int = 2
    at_end: bool = True

    def __post_init__(self) -> None:
        if self.every < 0:
            raise UserError(f"analysis.every must not be negative (0 turns probes off), got {self.every}")
        for name in ("batch_size", "batches"):
            if getattr(self, name) <= 0:
                raise UserError(f"analysis.{name} must be positive, got {getattr(self, name)}")


def check_seed(value: Any, key: str = "seed") -> None:
    """Refuse a seed that is not an integer in ``0 .. SEED_MAX`` (what every generator takes)."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= SEED_MAX:
        raise UserError(f"{key} must be an integer from 0 to 2**63-1 ({SEED_MAX}), got {value!r}")


# ---- loading ----------------------------------------------------------------------------------
def _type_name(tp: Any) -> str:
    names = {int: "an integer", float: "a number", bool: "true or false", str: "a string",
             dict: "a mapping"}
    if tp in names:
        return names[tp]
    return getattr(tp, "__name__", str(tp))


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check ``value`` against the annotation ``tp``; return it converted (int -> float, list -> tuple)."""
    origin, args = get_origin(tp), get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _coerce(key, value, inner[0])
        for option in inner:                  # the first type that takes it (float before str)
            try:
                return _coerce(key, value, option)
            except UserError:
                pass
        raise UserError(f"{key} must be {' or '.join(_type_name(a) for a in inner)}, got {value!r}")
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:     # tuple[X, ...]: any length
        if not isinstance(value, (list, tuple)):
            raise UserError(f"{key} must be a list, got {value!r}")
        return tuple(_coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value))
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise UserError(f"{key} must be a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise UserError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads "2e-3" (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            raise UserError(f"{key} must be a number, got {value!r}") from None
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise UserError(f"{key} must be finite, got {value!r}")
        return float(value)
    if tp in (int, float, bool, str):
        if isinstance(value, bool) != (tp is bool) or not isinstance(value, tp):
            raise UserError(f"{key} must be {_type_name(tp)}, got {value!r}")
        return value
    raise UserError(f"{key}: unsupported field type {tp!r}")  # a programming error, kept loud


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return get_type_hints(cls)


def _unknown_key(cls: type, name: str, full_key: str, rest: list[str]) -> UserError:
    fields = sorted(f.name for f in dataclasses.fields(cls))
    prefix = full_key[: len(full_key) - len(".".join([name, *rest]))]
    close = difflib.get_close_matches(name, fields, n=1)
    hint = f"; did you mean {prefix}{close[0]}?" if close else f"; known keys here: {', '.join(fields)}"
    return UserError(f"unknown key {full_key!r}{hint}")


def _assign(cls: type, raw: dict, path: list[str], value: Any, full_key: str) -> None:
    """Record ``value`` for ``<path>`` of a ``cls`` section in ``raw`` (its given values, nested by
    section): the key is checked against the fields and the value against its annotation here, where
    it enters; a mapping given to a section sets its keys one by one."""
    name, rest, tp = path[0], path[1:], _hints(cls).get(path[0])
    if name not in {f.name for f in dataclasses.fields(cls)}:
        raise _unknown_key(cls, name, full_key, rest)
    if isinstance(value, Override) and not (dataclasses.is_dataclass(tp) and rest):
        value = value.text if tp is str and not rest else value.value
    if dataclasses.is_dataclass(tp):
        section = raw.setdefault(name, {})
        if rest:
            _assign(tp, section, rest, value, full_key)
        elif isinstance(value, dict):
            for k, v in value.items():
                _assign(tp, section, [str(k)], v, f"{full_key}.{k}")
        else:
            raise UserError(f"{full_key} is a section; set its keys, e.g. {full_key}.KEY=VALUE")
        return
    if rest:
        if not _is_mapping(tp):
            raise UserError(f"unknown key {full_key!r}: {name} has no sub-keys")
        current = raw[name] if name in raw else _default(cls, name)
        raw[name] = {**current, ".".join(rest): value}
        return
    raw[name] = _coerce(full_key, value, tp)


def _default(cls: type, name: str) -> Any:
    """The default of field ``name`` of ``cls``. A section made by a function rather than by its
    class (the ViT's digits size) is made once per process and shared: sections are frozen."""
    f = next(f for f in dataclasses.fields(cls) if f.name == name)
    if f.default is not dataclasses.MISSING:
        return f.default
    if _section_factory(cls, f) is not None:
        return _made(f.default_factory)
    return f.default_factory()


def _section_factory(cls: type, f: dataclasses.Field) -> Callable | None:
    """The function that makes the default of section ``f``, when it is not the section's class."""
    tp = _hints(cls)[f.name]
    return f.default_factory if dataclasses.is_dataclass(tp) and f.default_factory is not tp else None


@functools.cache
def _made(factory: Callable[[], Any]) -> Any:
    return factory()


def _build(cls: type, raw: dict, base: Any = None, trusted: bool = False) -> Any:
    """A ``cls`` section from the values given for it (``raw``), the others from ``base`` (a
    default instance) or the class's defaults. Each section is constructed once, from its final
    values, so its own checks (``__post_init__``) run once; ``trusted``: not at all."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            kwargs[f.name] = getattr(base, f.name) if base is not None else _default(cls, f.name)
            continue
        tp = _hints(cls)[f.name]
        if not dataclasses.is_dataclass(tp):
            kwargs[f.name] = raw[f.name]
            continue
        inner = getattr(base, f.name) if base is not None else \
            _made(f.default_factory) if _section_factory(cls, f) is not None else None
        kwargs[f.name] = _build(tp, raw[f.name], inner, trusted)
    if not trusted:
        return cls(**kwargs)
    section = object.__new__(cls)
    for name, value in kwargs.items():
        object.__setattr__(section, name, value)
    return section


# How deeply a preset or an override may nest mappings and lists. Real presets nest four or five
# levels (compare.variants.NAME.overrides.KEY); PyYAML builds its tree recursively and fails with
# a RecursionError near a thousand.
MAX_YAML_DEPTH = 64

# How much YAML's aliases (*name) may add to a text, counted as nodes plus the characters of its
# scalars: a preset that repeats a base variant a few times adds hundreds. Aliases of aliases
# multiply (ten of ten of ten ...: the "billion laughs"), and PyYAML shares what they name, so an
# 800-byte preset holds a value whose text is gigabytes: refused before it is built.
MAX_ALIAS_EXPANSION = 100_000


def _refuse_deep_or_cyclic(text: str, where: str) -> None:
    """Walk the events of ``text`` (PyYAML's parser is a state machine, not recursive) and refuse
    nesting deeper than :data:`MAX_YAML_DEPTH`, an alias inside the node its anchor names (a
    structure that contains itself, which no configuration value can be), and aliases that expand
    to more than :data:`MAX_ALIAS_EXPANSION` (each counts the size of the node it names)."""
    depth, open_nodes = 0, []           # open collections: [anchor, size so far]
    sizes: dict[str, int] = {}          # anchor -> the size of the node it names, aliases expanded
    expanded = 0
    for event in yaml.parse(text, Loader=yaml.SafeLoader):
        if isinstance(event, yaml.CollectionStartEvent):
            depth += 1
            open_nodes.append([event.anchor, 1])
            if depth > MAX_YAML_DEPTH:
                line = event.start_mark.line + 1
                raise UserError(f"{where} nests mappings or lists more than {MAX_YAML_DEPTH} levels "
                                  f"deep (line {line}); no configuration needs that many")
            continue
        if isinstance(event, yaml.CollectionEndEvent):
            depth -= 1
            anchor, size = open_nodes.pop()
        elif isinstance(event, yaml.ScalarEvent):
            anchor, size = event.anchor, 1 + len(event.value)
        elif isinstance(event, yaml.AliasEvent):
            if any(event.anchor == a for a, _ in open_nodes):
                raise UserError(f"{where}: the alias *{event.anchor} (line {event.start_mark.line + 1}) "
                                  f"is inside the node &{event.anchor} names; a value cannot contain itself")
            anchor, size = None, sizes.get(event.anchor, 1)
            expanded += size
            if expanded > MAX_ALIAS_EXPANSION:
                raise UserError(f"{where}: its aliases expand to more than {MAX_ALIAS_EXPANSION:,} "
                                f"nodes and characters (*{event.anchor}, line {event.start_mark.line + 1}:"
                                " aliases of aliases multiply); write the values out, or use fewer aliases")
        else:
            continue
        if anchor is not None:
            sizes[anchor] = size
        if open_nodes:
            open_nodes[-1][1] += size


def load_yaml(text: str, where: str, path: str = "") -> Any:
    """``text`` read as YAML (safe tags only), refusing a mapping that gives a key twice, at any
    depth (PyYAML would keep the last silently), nesting deeper than :data:`MAX_YAML_DEPTH`, and
    a value that contains itself; ``where`` names the text in the error, ``path`` is the dotted
    key the text is the value of."""
    _refuse_deep_or_cyclic(text, where)
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _refuse_repeated_keys(node, where, path)
        return loader.construct_document(node)
    finally:
        loader.dispose()


def _refuse_repeated_keys(root: yaml.Node, where: str, path: str) -> None:
    """Walk the composed YAML tree of :func:`load_yaml` (each node once: aliases may share or
    nest nodes) and raise on the first key a mapping gives twice, naming it by its dotted path."""
    stack, seen = [(root, path)], set()
    while stack:
        node, at = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            stack += [(item, f"{at}[{i}]") for i, item in enumerate(node.value)]
        elif isinstance(node, yaml.MappingNode):
            lines: dict[tuple[str, str], int] = {}     # (tag, text) of each key -> its line
            for key, value in node.value:
                if not isinstance(key, yaml.ScalarNode) or key.tag == "tag:yaml.org,2002:merge":
                    stack.append((value, at))      # a complex key, or a merge (<<: *base)
                    continue
                name, line = f"{at}.{key.value}" if at else key.value, key.start_mark.line + 1
                if (key.tag, key.value) in lines:
                    first = lines[key.tag, key.value]
                    where_lines = f"lines {first} and {line}" if first != line else f"line {line}"
                    raise UserError(f"{where} gives the key {name} twice ({where_lines}); keep one")
                lines[key.tag, key.value] = line
                stack.append((value, name))


@dataclass(frozen=True)
class Override:
    """A ``key=value`` override's value: ``value`` as YAML reads it, ``text`` as the user typed it.
    A field typed ``str`` (a path, a name) takes the text, so that ``data.corpus=data/a #b`` is
    that path and not ``data/a`` (YAML would read `` #b`` as a comment, and ``yes`` as true);
    every other field takes the YAML value."""

    value: Any
    text: str


def parse_override(text: str) -> tuple[str, Any]:
    """``"model.n_layers=24"`` -> ``("model.n_layers", 24)``; the value is read as YAML (a mapping
    that gives a key twice is refused), or kept as the text when it is not YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise UserError(f"override {text!r} is not KEY=VALUE (e.g. train.lr=2e-3)")
    key = key.strip()
    try:
        shown = text if len(text) <= 80 else f"{text[:60]}...({len(text)} characters)"
        value = load_yaml(raw, f"override {shown!r}", key) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key, value


def _leaves(key: str, value: Any, cls: type) -> list[str]:
    """The settings an override sets: ``key``, or for a mapping given to a section or to a mapping
    field (``model={dim: 64}``, ``model.scheme_options={form: post_pre}``) each key inside it."""
    if not isinstance(value, dict) or not value:
        return [key]
    nested: Any = value
    for part in reversed(key.split(".")):
        nested = {part: nested}
    out = []
    for leaf, inner in _flatten(nested, cls):
        out += [f"{leaf}.{k}" for k in inner] if isinstance(inner, dict) and inner else [leaf]
    return out


def _refuse_repeated_overrides(overrides: list[str] | tuple[str, ...],
                               parsed: list[tuple[str, Any]], cls: type) -> None:
    """Refuse two ``key=value`` overrides that set one setting, directly or through a mapping
    (``model={dim: 64} model.dim=32``): which would win is easy to misread."""
    first: dict[str, tuple[str, str]] = {}     # a setting -> (its key, the override that set it)
    for text, (key, value) in zip(overrides, parsed):
        raw = value.value if isinstance(value, Override) else value
        for leaf in _leaves(key, raw, cls):
            clash = next((k for k in first if k == leaf or leaf.startswith(k + ".")
                          or k.startswith(leaf + ".")), None)
            if clash is not None:
                name = key if leaf == key == first[clash][0] else leaf
                raise UserError(f"{name} is given twice on the command line ({first[clash][1]}, "
                                f"{text}); give it once")
            first[leaf] = (key, text)


def _packaged_presets() -> str:
    return ", ".join(sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))) or "(none packaged)"


def preset_path(preset: str) -> Path:
    """The file a preset names: a packaged preset for a bare name (no suffix, no folder: ``tiny``
    is ``configs/tiny.yaml``), else the YAML file at that path, whatever its suffix. A folder, or
    a path that is not a regular file (a FIFO, a device), is refused in one line."""
    path = Path(preset).expanduser()
    bare = not path.suffix and "/" not in preset and os.sep not in preset
    if bare and (PRESET_DIR / f"{preset}.yaml").is_file():
        return PRESET_DIR / f"{preset}.yaml"
    if path.is_dir():
        raise UserError(f"preset {preset} is a folder, not a preset file; give a YAML file or one "
                          f"of {_packaged_presets()}")
    if path.exists() and not path.is_file():
        raise UserError(f"preset {preset} is not a regular file; give a YAML file or one of "
                          f"{_packaged_presets()}")
    if not path.is_file():
        raise UserError(f"preset {preset!r} not found: give a YAML file or one of {_packaged_presets()}")
    return path


# The largest preset read: the packaged ones are a few KB; parsing megabytes of YAML takes minutes
# and gigabytes (a file named by mistake, or on purpose).
MAX_PRESET_BYTES = 1 << 20


def read_preset(preset: str) -> dict:
    """A preset name from the packaged ``configs/`` folder, or a path to a YAML file
    (:func:`preset_path`): UTF-8 text holding a mapping that gives no key twice."""
    path = preset_path(preset)
    try:
        size = path.stat().st_size
        if size > MAX_PRESET_BYTES:
            raise UserError(f"preset {path} is {size / 2**20:.1f} MiB; a preset is a few KB of YAML "
                            f"(at most {MAX_PRESET_BYTES // 2**20} MiB is read): is this the right file?")
        raw = path.read_bytes()
        data = load_yaml(raw.decode("utf-8-sig"), f"preset {path}") or {}
    except UnicodeDecodeError as err:     # err.object: the bytes after a byte-order mark
        offset = len(raw) - len(err.object) + err.start
        raise UserError(f"cannot read {path}: it is not UTF-8 text (byte 0x{raw[offset]:02x} at "
                          f"offset {offset}); save it as UTF-8") from None
    except (OSError, yaml.YAMLError) as err:
        raise UserError(f"cannot read preset {path}: {str(err).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise UserError(f"preset {path} must be a mapping of sections, got {type(data).__name__}")
    return data


def _is_mapping(tp: Any) -> bool:
    return tp is dict or get_origin(tp) is dict


def _flatten(data: dict, cls: type | None, prefix: str = "") -> list[tuple[str, Any]]:
    """``{"model": {"dim": 8}}`` -> ``[("model.dim", 8)]``, following the sections of ``cls``; a field
    typed as a mapping (``model.scheme_options``) keeps its value whole. Keys ``cls`` does not know
    are flattened too, so the error names the whole key."""
    hints = get_type_hints(cls) if cls is not None else {}
    out = []
    for k, v in data.items():
        key, tp = f"{prefix}{k}", hints.get(str(k))
        if isinstance(v, dict) and not _is_mapping(tp):
            out += _flatten(v, tp if dataclasses.is_dataclass(tp) else None, key + ".")
        else:
            out.append((key, v))
    return out


# Preset sections that are not part of a run's configuration (``compare`` holds an experiment's grid).
NON_RUN_SECTIONS = ("compare",)


def check_scheme(model: Any) -> None:
    """The scheme of a model section: a known name and the options it declares, each value checked
    by the scheme's own declared check (:func:`~siamesenorm.schemes.check_scheme_options`); nothing
    is built."""
    check_scheme_options(model.scheme, model.scheme_options, getattr(model, "dim", None))


def build_config(classes: Mapping[str, type], preset: str | None = None,
                 overrides: list[str] | tuple[str, ...] = (),
                 extra: list[tuple[str, Any]] | tuple[tuple[str, Any], ...] = (),
                 default: str = "lm", preset_data: dict | None = None, trusted: bool = False) -> Any:
    """The resolved, frozen configuration: defaults, the preset (``preset_data``: already read),
    the overrides, then ``extra`` (parsed ``(key, value)`` pairs). ``classes`` maps each task to its
    configuration class; the ``task`` key (``default`` when unset) picks one. ``trusted``: a
    configuration this tool checked and wrote (a run's ``config.yaml``): typed, not checked again.
    """
    data = preset_data if preset_data is not None else read_preset(preset) if preset else {}
    data = {k: v for k, v in data.items() if k not in NON_RUN_SECTIONS}
    parsed = [(key, Override(value, text.partition("=")[2]))
              for text, (key, value) in zip(overrides, map(parse_override, overrides))]
    later = parsed + list(extra)
    task = next((v.text if isinstance(v, Override) else v for k, v in reversed(later) if k == "task"),
                data.get("task", default))
    if task not in classes:
        _refuse_repeated_overrides(overrides, parsed, object)
        raise UserError(f"task: unknown value {task!r}; choose one of {', '.join(classes)}")
    cls, raw = classes[task], {}
    _refuse_repeated_overrides(overrides, parsed, cls)
    for key, value in _flatten(data, cls) + later:
        _assign(cls, raw, key.split("."), value, key)
    cfg = _build(cls, raw, trusted=trusted)
    if not trusted and not hasattr(type(cfg.model), "resolved_scheme"):  # else checked by the model
        check_scheme(cfg.model)
    return cfg


def derive(cfg: Any, values: Mapping[str, Any]) -> Any:
    """A copy of the frozen configuration ``cfg`` with the dotted keys of ``values`` set, checked by
    nobody here: the caller has checked them already (compare's learning rates and seeds, up front;
    the sizes a task fits to its data). The sections on the way are copied, the others shared."""
    out = cfg
    for key, value in values.items():
        out = _replaced(out, key.split("."), value)
    return out


def _replaced(obj: Any, path: list[str], value: Any) -> Any:
    copy = _copy.copy(obj)
    inner = value if len(path) == 1 else _replaced(getattr(obj, path[0]), path[1:], value)
    object.__setattr__(copy, path[0], inner)
    return copy


def config_to_dict(cfg: Any) -> dict:
    """The fully resolved configuration as plain data (for ``config.yaml``)."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        out[f.name] = config_to_dict(v) if dataclasses.is_dataclass(v) else \
            (list(v) if isinstance(v, tuple) else v)
    return out


def dump_config(cfg: Any) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
