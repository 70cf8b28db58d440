"""Run configuration: a YAML preset plus ``key=value`` overrides with dotted keys.

A configuration is a tree of dataclasses: ``RunConfig`` (``task: lm``) with ``model``, ``data``,
``train`` and ``analysis`` sections; ``ViTRunConfig`` (``task: vit``) and ``DiTRunConfig``
(``task: dit``, with a ``diffusion`` section) for images. :func:`load_config` starts from the
defaults, applies the preset, then each override
(``model.n_layers=24 train.lr=2e-3 model.scheme_options.depth_scale=false``), and checks every
value against its field's type before any work starts. An unknown key, a wrong type or a bad
value is a :class:`~siamesenorm.errors.ConfigError` that names the key.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin, get_type_hints

import yaml

from .data.corpora import check_corpus_options
from .data.image_augment import ImageAugment
from .data.images import check_image_options
from .diffusion.schedule import linear_betas
from .errors import ConfigError
from .models.dit_config import DiTConfig
from .models.lm_config import LMConfig
from .models.vit_config import ViTConfig
from .schemes import build_scheme, get_scheme_class, scheme_options

PRESET_DIR = Path(__file__).parent / "configs"


@dataclass
class DataConfig:
    """What to train on: ``corpus`` is ``pystdlib``, ``arithmetic``, ``hf:NAME`` or a path."""

    corpus: str = "pystdlib"
    corpus_options: dict[str, Any] = field(default_factory=dict)  # keyword options of its loader
    tokenizer: str = "bytes"           # "bytes" or "bpe"
    vocab_size: int = 1024             # BPE only
    max_bytes: int = 8_000_000         # pystdlib only
    val_fraction: float = 0.1
    batch_size: int = 16
    seq_len: int = 128
    val_batches: int = 8
    eval_problems: int = 200           # arithmetic only: held-out problems answered at each evaluation

    def __post_init__(self) -> None:
        if self.tokenizer not in ("bytes", "bpe"):
            raise ConfigError(f"data.tokenizer: unknown value {self.tokenizer!r}; choose bytes or bpe")
        for name in ("vocab_size", "max_bytes", "batch_size", "seq_len", "val_batches", "eval_problems"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"data.{name} must be positive, got {getattr(self, name)}")
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")


@dataclass
class TrainConfig:
    """How to train: AdamW, linear warm-up then cosine decay, clipping, accumulation."""

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
    divergence_factor: float = 3.0
    compile: bool = False
    device: str = "auto"

    def __post_init__(self) -> None:
        for name in ("steps", "grad_accum", "eval_every", "checkpoint_every"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"train.{name} must be positive, got {getattr(self, name)}")
        for name in ("warmup", "weight_decay", "grad_clip"):
            if getattr(self, name) < 0:
                raise ConfigError(f"train.{name} must not be negative, got {getattr(self, name)}")
        if not self.lr > 0:
            raise ConfigError(f"train.lr must be positive, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"train.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if not self.divergence_factor > 1:
            raise ConfigError(f"train.divergence_factor must be above 1, got {self.divergence_factor}")


@dataclass
class AnalysisConfig:
    """The paper's diagnostics for a run (see docs/analysis.md).

    ``every``: record probes (stream RMS per sublayer, gradient norm per block, norm gains) in
    ``probes.jsonl`` every ``every`` steps; 0 turns them off. ``batch_size``: sequences of the
    probes' fixed batch (taken from the first validation batch). ``batches``: validation batches
    that ``siamesenorm analyze`` uses. ``at_end``: when probes are on, analyse the final model
    (``analysis.json`` and plots) as the run finishes.
    """

    every: int = 0
    batch_size: int = 4
    batches: int = 2
    at_end: bool = True

    def __post_init__(self) -> None:
        if self.every < 0:
            raise ConfigError(f"analysis.every must not be negative (0 turns probes off), got {self.every}")
        for name in ("batch_size", "batches"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"analysis.{name} must be positive, got {getattr(self, name)}")


@dataclass
class RunConfig:
    """One language-model run (``task: lm``): the model, its data, its training, and the seed of
    everything random."""

    task: str = "lm"
    model: LMConfig = field(default_factory=LMConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = 0
    analysis: AnalysisConfig = field(default_factory=AnalysisConfig)


@dataclass
class ImageDataConfig:
    """Images for ``task: vit`` and ``task: dit``: ``dataset`` is ``digits`` (scikit-learn's 8x8
    handwritten digits, embedded), a folder of class sub-folders, or an ``.npz`` file of ``images``
    and ``labels``; ``dataset_options`` go to its loader (a folder's ``image_size``, ``channels``).
    The split is stratified and fixed by ``split_seed``. ``augment`` applies to training batches
    only. The model's image size, channels and classes are set from the data when the run starts.
    """

    dataset: str = "digits"
    dataset_options: dict[str, Any] = field(default_factory=dict)
    val_fraction: float = 0.2
    split_seed: int = 0
    batch_size: int = 64
    val_batches: int = 16             # at most this many validation batches of batch_size images
    # Off by default: at 8x8 with 2x2 patches a one-pixel shift is half a patch, and it cut a
    # 200-step ViT's digit accuracy from 83% to 27% in our measurement. Presets for larger images
    # turn DeiT's augmentations on.
    augment: ImageAugment = field(default_factory=lambda: ImageAugment(translate=0, erase_prob=0.0))

    def __post_init__(self) -> None:
        for name in ("batch_size", "val_batches"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"data.{name} must be positive, got {getattr(self, name)}")
        if not 0 < self.val_fraction < 1:
            raise ConfigError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")


@dataclass
class DiffusionConfig:
    """The DiT diffusion process and how a ``task: dit`` run scores its samples.

    ``timesteps`` of a ``schedule`` (linear, as DiT; or cosine). ``beta_start`` and ``beta_end``
    are the linear schedule's endpoints at 1,000 steps; for other ``timesteps`` both are scaled by
    ``1000 / timesteps`` (ADM's and DiT's rule), and a ``timesteps`` that scales ``beta_end`` to 1
    or more is refused. At every evaluation the run samples with ``sampler`` (ddim or ddpm) over
    ``sample_steps`` respaced steps with classifier-free guidance ``cfg_scale``, writes a grid of
    ``grid_per_class`` samples per class to ``samples/step_N.png``, and scores ``eval_samples``
    class-conditional samples with the FD-proxy (a Frechet distance in the feature space of a small
    classifier trained on the same data: not Inception FID) and the classifier's accuracy on them.
    """

    timesteps: int = 1000
    schedule: str = "linear"
    beta_start: float = 1e-4
    beta_end: float = 0.02
    sampler: str = "ddim"
    sample_steps: int = 50
    eta: float = 0.0
    cfg_scale: float = 1.5
    eval_samples: int = 500
    grid_per_class: int = 8

    def __post_init__(self) -> None:
        for name in ("timesteps", "sample_steps", "eval_samples", "grid_per_class"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"diffusion.{name} must be positive, got {getattr(self, name)}")
        if self.schedule not in ("linear", "cosine"):
            raise ConfigError(f"diffusion.schedule: unknown value {self.schedule!r}; choose linear or cosine")
        if self.sampler not in ("ddim", "ddpm"):
            raise ConfigError(f"diffusion.sampler: unknown value {self.sampler!r}; choose ddim or ddpm")
        if self.sample_steps > self.timesteps:
            raise ConfigError(f"diffusion.sample_steps ({self.sample_steps}) exceeds diffusion.timesteps "
                              f"({self.timesteps})")
        if not 0 < self.beta_start < self.beta_end < 1:
            raise ConfigError("diffusion needs 0 < beta_start < beta_end < 1, got "
                              f"{self.beta_start} and {self.beta_end}")
        if self.schedule == "linear":
            try:
                linear_betas(self.timesteps, self.beta_start, self.beta_end)
            except ConfigError as error:
                raise ConfigError(f"diffusion: {error}") from None
        if self.eta < 0 or self.cfg_scale < 0:
            raise ConfigError(f"diffusion.eta and diffusion.cfg_scale must not be negative, got "
                              f"{self.eta} and {self.cfg_scale}")


def _digits_vit() -> ViTConfig:
    return ViTConfig.from_size("digits")


def _digits_dit() -> DiTConfig:
    return DiTConfig.from_size("digits", learn_sigma=False)


@dataclass
class ViTRunConfig:
    """One image-classification run (``task: vit``): a DeiT-style ViT on an image set."""

    task: str = "vit"
    model: ViTConfig = field(default_factory=_digits_vit)
    data: ImageDataConfig = field(default_factory=ImageDataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    seed: int = 0
    analysis: AnalysisConfig = field(default_factory=AnalysisConfig)

    def __post_init__(self) -> None:
        # Under mixup/cutmix the targets are smoothed by data.augment.smoothing, else by
        # model.label_smoothing (tasks.common.training_augment); two different values contradict.
        a, smoothing = self.data.augment, self.model.label_smoothing
        if a.smoothing > 0 and not a.mixes:
            raise ConfigError(f"data.augment.smoothing={a.smoothing} only smooths mixup/cutmix targets, and "
                              "both are off; set model.label_smoothing instead")
        if a.smoothing > 0 and smoothing > 0 and a.smoothing != smoothing:
            raise ConfigError(f"data.augment.smoothing={a.smoothing} and model.label_smoothing={smoothing} "
                              "disagree; under mixup/cutmix one smoothing applies: set one of them (or both "
                              "to the same value)")


@dataclass
class DiTRunConfig:
    """One class-conditional diffusion run (``task: dit``): a DiT on an image set."""

    task: str = "dit"
    model: DiTConfig = field(default_factory=_digits_dit)
    data: ImageDataConfig = field(default_factory=ImageDataConfig)
    diffusion: DiffusionConfig = field(default_factory=DiffusionConfig)
    # The diffusion loss of one batch swings with its random timesteps (a batch of small t's costs
    # many times one of large t's), so "3x the best loss so far" stopped healthy runs; non-finite
    # losses still stop a run at once.
    train: TrainConfig = field(default_factory=lambda: TrainConfig(divergence_factor=20.0))
    seed: int = 0
    analysis: AnalysisConfig = field(default_factory=AnalysisConfig)

    def __post_init__(self) -> None:
        a = self.data.augment
        if a.mixes or a.smoothing > 0:
            raise ConfigError("data.augment.mixup_alpha, cutmix_alpha and smoothing make soft class targets, "
                              "which a DiT cannot take (it is conditioned on one label per image); set them "
                              "to 0 for task=dit")


# The configuration class of each task (the ``task`` key of a preset or an override picks it).
TASKS: dict[str, type] = {"lm": RunConfig, "vit": ViTRunConfig, "dit": DiTRunConfig}
AnyRunConfig = RunConfig | ViTRunConfig | DiTRunConfig


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
        return _coerce(key, value, inner[0])
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key} must be a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    if origin is dict or tp is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a mapping, got {value!r}")
        return dict(value)
    if tp is float and isinstance(value, str):  # YAML 1.1 reads "2e-3" (no dot) as a string
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"{key} must be a number, got {value!r}") from None
    if tp is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise ConfigError(f"{key} must be finite, got {value!r}")
        return float(value)
    if tp in (int, float, bool, str):
        if isinstance(value, bool) != (tp is bool) or not isinstance(value, tp):
            raise ConfigError(f"{key} must be {_type_name(tp)}, got {value!r}")
        return value
    raise ConfigError(f"{key}: unsupported field type {tp!r}")  # a programming error, kept loud


def _set(obj: Any, path: list[str], value: Any, full_key: str) -> None:
    """Set ``obj.<path>`` to ``value`` (a dict value merges into a section)."""
    hints = get_type_hints(type(obj))
    fields = {f.name for f in dataclasses.fields(obj)}
    name = path[0]
    if name not in fields:
        prefix = full_key[: len(full_key) - len(".".join(path))]
        close = difflib.get_close_matches(name, sorted(fields), n=1)
        hint = f"; did you mean {prefix}{close[0]}?" if close else \
            f"; known keys here: {', '.join(sorted(fields))}"
        raise ConfigError(f"unknown key {full_key!r}{hint}")
    current = getattr(obj, name)
    if dataclasses.is_dataclass(current):
        if len(path) > 1:
            _set(current, path[1:], value, full_key)
        elif isinstance(value, dict):
            for k, v in value.items():
                _set(current, [str(k)], v, f"{full_key}.{k}")
        else:
            raise ConfigError(f"{full_key} is a section; set its keys, e.g. {full_key}.KEY=VALUE")
        return
    if len(path) > 1:
        if not isinstance(current, dict):
            raise ConfigError(f"unknown key {full_key!r}: {'.'.join(path[:1])} has no sub-keys")
        object.__setattr__(obj, name, {**current, ".".join(path[1:]): value})
        return
    # object.__setattr__ also fills frozen sections (data.augment): each load builds fresh
    # instances, and _revalidate rebuilds every section afterwards so its own checks run.
    object.__setattr__(obj, name, _coerce(full_key, value, hints[name]))


def _revalidate(obj: Any) -> Any:
    """Rebuild the dataclass tree so every section's own checks run on the final values."""
    kwargs = {f.name: _revalidate(getattr(obj, f.name)) if dataclasses.is_dataclass(getattr(obj, f.name))
              else getattr(obj, f.name) for f in dataclasses.fields(obj)}
    return type(obj)(**kwargs)


def parse_override(text: str) -> tuple[str, Any]:
    """``"model.n_layers=24"`` -> ``("model.n_layers", 24)``; the value is read as YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override {text!r} is not KEY=VALUE (e.g. train.lr=2e-3)")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def read_preset(preset: str) -> dict:
    """A preset name from the packaged ``configs/`` folder, or a path to a YAML file."""
    path = Path(preset)
    if not path.suffix:
        path = PRESET_DIR / f"{preset}.yaml"
    if not path.is_file():
        known = sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))
        raise ConfigError(f"preset {preset!r} not found: give a YAML file or one of "
                          f"{', '.join(known) or '(none packaged)'}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except (OSError, yaml.YAMLError) as err:
        raise ConfigError(f"cannot read preset {path}: {str(err).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"preset {path} must be a mapping of sections, got {type(data).__name__}")
    return data


def _flatten(data: dict, prefix: str = "") -> list[tuple[str, Any]]:
    out = []
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and not key.endswith(("scheme_options", "corpus_options", "dataset_options")):
            out += _flatten(v, key + ".")
        else:
            out.append((key, v))
    return out


# Preset sections that are not part of a run's configuration (``compare`` holds an experiment's grid).
NON_RUN_SECTIONS = ("compare",)


def load_config(preset: str | None = None, overrides: list[str] | tuple[str, ...] = (),
                extra: list[tuple[str, Any]] | tuple[tuple[str, Any], ...] = ()) -> AnyRunConfig:
    """Defaults, then the preset, then the overrides, then ``extra`` (already parsed ``(key, value)``
    pairs, e.g. a compare variant's settings); every value checked, the scheme's options too.

    The ``task`` key (``lm``, the default; ``vit``; ``dit``) picks the configuration class, so it
    is read first, wherever it is set.
    """
    data = read_preset(preset) if preset else {}
    items = _flatten({k: v for k, v in data.items() if k not in NON_RUN_SECTIONS})
    items += [parse_override(o) for o in overrides]
    items += list(extra)
    task = next((v for k, v in reversed(items) if k == "task"), "lm")
    if task not in TASKS:
        raise ConfigError(f"task: unknown value {task!r}; choose one of {', '.join(TASKS)}")
    cfg = TASKS[task]()
    for key, value in items:
        _set(cfg, key.split("."), value, key)
    cfg = _revalidate(cfg)
    if task == "lm":
        check_corpus_options(cfg.data.corpus, cfg.data.corpus_options)
    else:
        check_image_options(cfg.data.dataset, cfg.data.dataset_options)
    get_scheme_class(cfg.model.scheme)
    known = scheme_options(cfg.model.scheme)
    unknown = sorted(set(cfg.model.scheme_options) - set(known))
    if unknown:
        raise ConfigError(f"model.scheme_options.{unknown[0]}: scheme {cfg.model.scheme!r} has no option "
                          f"{unknown[0]!r}; its options are: {', '.join(sorted(known)) or 'none'}")
    # Build the scheme on the meta device (no memory, no compute) so its option values are checked now.
    build_scheme(cfg.model.scheme, cfg.model.dim, cfg.model.n_layers, norm=cfg.model.norm,
                 eps=cfg.model.norm_eps, device="meta", **cfg.model.scheme_options)
    return cfg


def config_to_dict(cfg: Any) -> dict:
    """The fully resolved configuration as plain data (for ``config.yaml``)."""
    out = {}
    for f in dataclasses.fields(cfg):
        v = getattr(cfg, f.name)
        out[f.name] = config_to_dict(v) if dataclasses.is_dataclass(v) else \
            (list(v) if isinstance(v, tuple) else v)
    return out


def dump_config(cfg: AnyRunConfig) -> str:
    return yaml.safe_dump(config_to_dict(cfg), sort_keys=False)
