"""The grid of a comparison: which variants, learning rates and seeds, from a preset's ``compare``
section and the command line (docs/compare.md)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from ..config import check_seed, derive, read_preset
from ..errors import UserError
from ..schemes import list_schemes
from ..tasks import load_config
from .jobs import AUTO, check_jobs

DEFAULT_SCHEMES = ("pre", "post", "siamese")
_SECTION_KEYS = ("schemes", "lrs", "seeds", "baseline", "jobs", "keep_checkpoints", "variants")
KEEP_CHECKPOINTS = ("last", "all")      # what compare.keep_checkpoints may say
DEFAULT_BASELINE = "pre"
_VARIANT_KEYS = ("scheme", "options", "overrides")


@dataclass(frozen=True)
class Variant:
    """One row of the grid: a label, its scheme, and the settings that make it differ."""

    label: str
    scheme: str
    options: dict | None = None          # None: the scheme's defaults (or the preset's, same scheme)
    overrides: dict = field(default_factory=dict)

    def extra(self) -> list[tuple[str, Any]]:
        items = [(str(k), v) for k, v in self.overrides.items()] + [("model.scheme", self.scheme)]
        if self.options is not None:
            items.append(("model.scheme_options", dict(self.options)))
        return items


@dataclass(frozen=True)
class Cell:
    name: str
    variant: Variant
    lr: float
    seed: int
    config: Any                          # the task's run configuration


def run_name(label: str, lr: float, seed: int) -> str:
    return f"{label}-lr{lr:g}-s{seed}"


def _check_list(key: str, value: Any, kind: type) -> list:
    if not isinstance(value, list) or not value:
        raise UserError(f"compare.{key} must be a non-empty list, got {value!r}")
    out = []
    for v in value:
        if kind is float and isinstance(v, str):
            try:
                v = float(v)
            except ValueError:
                pass
        if isinstance(v, bool) or not isinstance(v, (int, float) if kind is float else kind):
            raise UserError(f"compare.{key}: {v!r} is not {'a number' if kind is float else kind.__name__}")
        out.append(kind(v))
    return out


def check_section(data: dict, preset: str | None) -> dict:
    """The ``compare`` section of the preset ``data`` (read from ``preset``), checked."""
    section = data.get("compare") or {}
    if not isinstance(section, dict):
        raise UserError(f"compare section of preset {preset!r} must be a mapping")
    for key in section:
        if key not in _SECTION_KEYS:
            raise UserError(f"unknown key 'compare.{key}'; known keys: {', '.join(_SECTION_KEYS)}")
    out: dict = {}
    if "schemes" in section:
        out["schemes"] = _check_list("schemes", section["schemes"], str)
    if "lrs" in section:
        out["lrs"] = _check_list("lrs", section["lrs"], float)
    if "seeds" in section:
        out["seeds"] = _check_list("seeds", section["seeds"], int)
    if "baseline" in section:
        if not isinstance(section["baseline"], str) or not section["baseline"]:
            raise UserError(f"compare.baseline must be a scheme or variant label, got "
                              f"{section['baseline']!r}")
        out["baseline"] = section["baseline"]
    if "jobs" in section:
        out["jobs"] = check_jobs(section["jobs"], "compare.jobs")
    if "keep_checkpoints" in section:
        keep = section["keep_checkpoints"]
        if keep not in KEEP_CHECKPOINTS:
            raise UserError(f"compare.keep_checkpoints must be last (a finished run keeps only "
                              f"checkpoints/last) or all (every checkpoint it kept), got {keep!r}")
        out["keep_checkpoints"] = keep
    variants = section.get("variants") or {}
    if not isinstance(variants, dict):
        raise UserError("compare.variants must map a label to {scheme, options, overrides}")
    out["variants"] = {check_label(label): _variant(str(label), spec) for label, spec in variants.items()}
    return out


def check_label(label: Any) -> str:
    """A variant's label, which names its runs' folders: refused when empty, ``.`` or ``..``, or when it
    holds a path separator or a control character."""
    text = str(label)
    bad = next((c for c in text if c in "/\\" or not c.isprintable() or c.isspace() and c != " "),
               None)
    if not text.strip() or text in (".", "..") or bad is not None:
        why = "is empty" if not text.strip() else f"holds {bad!r}" if bad is not None else "is a path"
        raise UserError(f"compare.variants: the label {text!r} {why}; a label names its runs' folders, "
                          "so it is a name without path separators or control characters")
    return text


def _variant(label: str, spec: Any) -> Variant:
    if not isinstance(spec, dict) or "scheme" not in spec:
        raise UserError(f"compare.variants.{label} must be a mapping with a 'scheme' key")
    for key in spec:
        if key not in _VARIANT_KEYS:
            raise UserError(f"unknown key 'compare.variants.{label}.{key}'; known keys: "
                              f"{', '.join(_VARIANT_KEYS)}")
    options, overrides = spec.get("options"), spec.get("overrides") or {}
    if options is not None and not isinstance(options, dict):
        raise UserError(f"compare.variants.{label}.options must be a mapping")
    if not isinstance(overrides, dict):
        raise UserError(f"compare.variants.{label}.overrides must be a mapping of dotted keys")
    return Variant(label, str(spec["scheme"]), options, overrides)


def _refuse_repeats(source: str, what: str, names: list[str]) -> None:
    if len(set(names)) != len(names):
        raise UserError(f"{source} names {what} twice: {', '.join(names)}")


def _check_lrs(lrs: list[float], source: str) -> list[float]:
    for lr in lrs:
        if not 0 < lr < math.inf:
            raise UserError(f"{source}: each learning rate must be a positive finite number (as "
                              f"train.lr), got {lr}")
    _refuse_repeats(source, "a learning rate", [format(lr, "g") for lr in lrs])
    return lrs


def _check_seeds(seeds: list[int], source: str) -> list[int]:
    for seed in seeds:
        check_seed(seed, source)
    _refuse_repeats(source, "a seed", [str(seed) for seed in seeds])
    return seeds


def resolve_variants(names: list[str], variants: dict[str, Variant],
                     source: str = "--schemes") -> list[Variant]:
    """The variant (or plain scheme) each of ``names`` means; ``source`` names the list in errors."""
    out = []
    for name in names:
        if name in variants:
            out.append(variants[name])
        elif name in list_schemes():
            out.append(Variant(name, name))
        else:
            known = ", ".join(list(variants) + list_schemes())
            raise UserError(f"unknown scheme {name!r}; choose one of {known}")
    _refuse_repeats(source, "a scheme", [v.label for v in out])
    return out


@dataclass(frozen=True)
class Plan:
    """A comparison resolved once from its preset: the base configuration, the grid's spec (for
    experiment.json), every cell, the baseline, ``compare.jobs`` and ``compare.keep_checkpoints``."""

    base: Any
    spec: dict
    cells: list[Cell]
    baseline: str
    jobs: int | str = AUTO
    keep_checkpoints: str = "last"


def plan(preset: str | None, overrides: list[str], *, schemes: list[str] | None = None,
         lrs: list[float] | None = None, seeds: list[int] | None = None,
         baseline: str | None = None) -> Plan:
    """The comparison of ``preset`` (read once) with ``overrides`` and the command line's lists, checked."""
    data = read_preset(preset) if preset else {}
    section = check_section(data, preset)
    base = load_config(preset, overrides, preset_data=data)
    variants = resolve_variants(schemes or section.get("schemes") or list(DEFAULT_SCHEMES),
                                section.get("variants", {}),
                                "--schemes" if schemes else "compare.schemes")
    lrs = _check_lrs(lrs or section.get("lrs") or [base.train.lr], "--lrs" if lrs else "compare.lrs")
    seeds = _check_seeds(seeds or section.get("seeds") or [base.seed],
                         "--seeds" if seeds else "compare.seeds")
    configs = {}
    for v in variants:  # each variant's settings are checked before any run starts
        keep = v.options is None and v.scheme == base.model.scheme
        options = [] if keep or v.options is not None else [("model.scheme_options", {})]
        configs[v.label] = load_config(preset, overrides, v.extra() + options, preset_data=data)
    cells = [Cell(run_name(v.label, lr, seed), v, lr, seed,
                  derive(configs[v.label], {"train.lr": lr, "seed": seed}))
             for seed in seeds for lr in lrs for v in variants]
    spec = {"schemes": [v.label for v in variants], "lrs": lrs, "seeds": seeds,
            "variants": {v.label: dataclasses.asdict(v) for v in variants}}
    return Plan(base, spec, cells, choose_baseline(spec["schemes"], baseline, section),
                section.get("jobs", AUTO), section.get("keep_checkpoints", "last"))


def build_grid(preset: str | None, overrides: list[str], *, schemes: list[str] | None = None,
               lrs: list[float] | None = None, seeds: list[int] | None = None,
               ) -> tuple[Any, dict, list[Cell]]:
    """The base configuration, the grid's spec (for experiment.json) and every cell, all checked."""
    p = plan(preset, overrides, schemes=schemes, lrs=lrs, seeds=seeds)
    return p.base, p.spec, p.cells


def choose_baseline(labels: list[str], baseline: str | None = None, section: dict | None = None) -> str:
    """``baseline`` (``--baseline``), else the section's, each refused unless among ``labels``; else
    ``pre`` when compared, else the first label."""
    for source, name in (("--baseline", baseline), ("compare.baseline", (section or {}).get("baseline"))):
        if name is not None:
            if name not in labels:
                raise UserError(f"{source} {name!r} is not among the compared schemes "
                                  f"({', '.join(labels)}); name one of them")
            return name
    return DEFAULT_BASELINE if DEFAULT_BASELINE in labels else labels[0]
