"""What every task's run shares: the run directory's checks, the engine's settings, image data."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import dump_config, load_config
from ..data.image_augment import ImageAugment
from ..data.image_batches import ImageBatchSampler, image_validation_batches
from ..data.image_split import split_images
from ..data.images import ImageSet, load_images
from ..devices import resolve_device
from ..errors import ConfigError
from ..train import TrainSettings


def open_run_dir(cfg: Any, run_dir: Path, resume: bool) -> Any:
    """The configuration to train: ``cfg``, or with ``resume`` the run's own ``config.yaml``.

    A fresh run refuses a folder that already holds one (nothing is written there).
    """
    if resume:
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"cannot resume {run_dir}: it holds no config.yaml")
        return load_config(str(run_dir / "config.yaml"))
    if (run_dir / "metrics.jsonl").exists() or (run_dir / "checkpoints").exists():
        raise ConfigError(f"{run_dir} already holds a run; resume it with --resume or choose another --out")
    return cfg


def write_config(cfg: Any, run_dir: Path, resume: bool) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        (run_dir / "config.yaml").write_text(dump_config(cfg))


def make_probe(cfg: Any, val_batches: list):
    """The training probes of ``analysis.every`` (None when off), on the first validation batch."""
    if cfg.analysis.every <= 0:
        return None
    from ..analysis.training_probes import TrainingProbes

    x, y = val_batches[0]
    n = cfg.analysis.batch_size
    return TrainingProbes(cfg.analysis.every, (x[:n], y[:n]))


def analyze_at_end(cfg: Any, model: torch.nn.Module, val_batches: list, run_dir: Path, summary: dict,
                   device: torch.device, head_fn=None) -> None:
    """With probes on and ``analysis.at_end``, analyse the finished model into ``run_dir``."""
    if cfg.analysis.every <= 0 or not cfg.analysis.at_end or summary.get("diverged") \
            or summary.get("interrupted"):
        return
    from ..analysis.run_analysis import analyze_model, write_analysis

    batches = [tuple(t.to(device) for t in b) for b in val_batches[:cfg.analysis.batches]]
    write_analysis(run_dir, analyze_model(model, batches, head_fn=head_fn), source="validation")


def train_settings(cfg: Any, eval_batches: list) -> TrainSettings:
    """The engine's settings from a run configuration's ``train`` section."""
    t = cfg.train
    return TrainSettings(steps=t.steps, lr=t.lr, warmup=t.warmup, min_lr_ratio=t.min_lr_ratio,
                         weight_decay=t.weight_decay, betas=t.betas, grad_clip=t.grad_clip,
                         grad_accum=t.grad_accum, eval_every=t.eval_every, eval_batches=eval_batches,
                         checkpoint_every=t.checkpoint_every, divergence_factor=t.divergence_factor,
                         compile=t.compile, seed=cfg.seed)


@dataclasses.dataclass
class ImageData:
    """An image run's data: the split, the training sampler and the fixed validation batches."""

    train: ImageSet
    val: ImageSet
    sampler: ImageBatchSampler
    val_batches: list
    image_size: int
    in_chans: int
    num_classes: int


def check_training_images(cfg: Any, images: ImageSet) -> None:
    """Refuse an image set that a run of ``cfg.task`` cannot train on, before anything is written.

    Both tasks need square images and at least two classes with images (a ViT classifies them; a
    DiT's FD-proxy classifier scores its samples by them). A DiT also needs 1 (grey) or 3 (RGB)
    channels: its evaluations write the samples as a PNG grid, and showing some channels of a 2-
    or 4-channel image (RGBA, latents) would misrepresent what the model draws.
    """
    d = cfg.data
    chans, height, width = images.shape
    if height != width:
        raise ConfigError(f"{d.dataset}: images are {height}x{width}; the models take square images "
                          "(resize them, e.g. a folder's image_size option)")
    present = np.unique(images.labels)
    if len(present) < 2:
        name = images.class_names[int(present[0])] if len(present) else "none"
        raise ConfigError(f"{d.dataset}: every image is of one class ({name!r}); task={cfg.task} needs "
                          "images of at least 2 classes (add another class)")
    if cfg.task == "dit" and chans not in (1, 3):
        raise ConfigError(f"{d.dataset}: images have {chans} channels; task=dit draws its samples as a "
                          "grey (1 channel) or RGB (3 channel) PNG grid, so give 1- or 3-channel images "
                          "(e.g. drop an alpha channel)")


def training_augment(cfg: Any) -> ImageAugment:
    """``data.augment`` with a ViT's label smoothing folded into the mixup/cutmix targets.

    Under mixup or cutmix the model gets soft targets and cannot smooth them itself, so, as DeiT's
    ``Mixup(label_smoothing=...)`` does, the targets are smoothed before mixing: by
    ``data.augment.smoothing`` when it is set, else by ``model.label_smoothing`` (the config refuses
    two different non-zero values).
    """
    augment = cfg.data.augment
    if cfg.task != "vit" or not augment.mixes or augment.smoothing > 0:
        return augment
    return dataclasses.replace(augment, smoothing=cfg.model.label_smoothing)


def load_image_data(cfg: Any) -> ImageData:
    """Load ``data.dataset``, check it (:func:`check_training_images`), split it, and build the
    sampler (seeded by ``seed``, with :func:`training_augment`) and the validation batches."""
    d = cfg.data
    full = load_images(d.dataset, **d.dataset_options)
    check_training_images(cfg, full)
    chans, height, _ = full.shape
    train, val = split_images(full, d.val_fraction, d.split_seed)
    if len(val) == 0:
        raise ConfigError(f"{d.dataset}: data.val_fraction={d.val_fraction} leaves no validation images")
    sampler = ImageBatchSampler.from_set(train, d.batch_size, seed=cfg.seed, augment=training_augment(cfg))
    # Every validation image when they fit in val_batches batches, else evenly spaced full batches.
    few = len(val) <= d.val_batches * d.batch_size
    batches = image_validation_batches(val, batch_size=d.batch_size, n_batches=None if few else d.val_batches)
    return ImageData(train, val, sampler, batches, height, chans, full.num_classes)


def build_image_model(cfg: Any, device: torch.device | str | None = None) -> torch.nn.Module:
    """The trained module of an image run: the ViT, or the DiT inside its diffusion objective."""
    if cfg.task == "vit":
        from ..models.vit import VisionTransformer

        return VisionTransformer(cfg.model, device=device)
    from ..diffusion import DiffusionObjective, create_diffusion
    from ..models.dit import DiT

    d = cfg.diffusion
    return DiffusionObjective(DiT(cfg.model, device=device),
                              create_diffusion(d.timesteps, d.schedule, d.beta_start, d.beta_end),
                              eval_seed=cfg.seed)


def load_image_run(run_dir: Path, device: str = "cpu") -> tuple[torch.nn.Module, Any]:
    """The module of the image run ``run_dir`` with its last checkpoint's weights (eval mode)."""
    from ..train import load_checkpoint

    cfg = load_config(str(run_dir / "config.yaml"))
    model = build_image_model(cfg, resolve_device(device, "--device"))
    load_checkpoint(run_dir / "checkpoints" / "last", model, None)
    return model.eval(), cfg


def image_analysis_batches(cfg: Any, data: str | None, n: int) -> list:
    """``n`` batches to analyse: the run's own first validation batches, or evenly spaced batches of
    the image set ``data`` (a folder or ``.npz``, resized as the run's were)."""
    if data is None:
        return load_image_data(cfg).val_batches[:n]
    images = load_images(data, **cfg.data.dataset_options)
    if images.shape[1:] != (cfg.model.image_size if cfg.task == "vit" else cfg.model.input_size,) * 2:
        raise ConfigError(f"{data}: images are {images.shape[1]}x{images.shape[2]}, the run's model takes "
                          f"{cfg.data.dataset_options or 'its own size'}; give images of that size")
    count = min(n, max(1, len(images) // cfg.data.batch_size))
    return image_validation_batches(images, batch_size=min(cfg.data.batch_size, len(images)),
                                    n_batches=count)
