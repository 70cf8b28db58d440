"""What the image tasks (``vit``, ``dit``) share: the ``data`` section, and loading, checking and
batching an image set for a run."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import check_seed
from ..data import (
    ImageAugment,
    ImageBatchSampler,
    ImageSet,
    image_validation_batches,
    load_images,
    split_images,
)
from ..errors import UserError


@dataclasses.dataclass(frozen=True)
class ImageDataConfig:
    """Images for ``task: vit`` and ``task: dit``: ``dataset`` is ``digits`` (scikit-learn's 8x8
    handwritten digits, embedded), a folder of class sub-folders, or an ``.npz`` file of ``images``
    and ``labels``; ``dataset_options`` go to its loader (a folder's ``image_size``, ``channels``).
    The split is stratified and fixed by ``split_seed``. ``augment`` applies to training batches
    only. The model's image size, channels and classes are set from the data when the run starts.
    """

    dataset: str = "digits"
    dataset_options: dict[str, Any] = dataclasses.field(default_factory=dict)
    val_fraction: float = 0.2
    split_seed: int = 0
    batch_size: int = 64
    val_batches: int = 16             # at most this many validation batches of batch_size images
    # Off by default: at 8x8 with 2x2 patches a one-pixel shift is half a patch, and it cut a
    # 200-step ViT's digit accuracy from 83% to 27% in our measurement. Presets for larger images
    # turn DeiT's augmentations on.
    augment: ImageAugment = dataclasses.field(
        default_factory=lambda: ImageAugment(translate=0, erase_prob=0.0))

    def __post_init__(self) -> None:
        for name in ("batch_size", "val_batches"):
            if getattr(self, name) <= 0:
                raise UserError(f"data.{name} must be positive, got {getattr(self, name)}")
        if not 0 < self.val_fraction < 1:
            raise UserError(f"data.val_fraction must be in (0, 1), got {self.val_fraction}")
        check_seed(self.split_seed, "data.split_seed")


@dataclasses.dataclass(frozen=True)
class ImageData:
    """The data of one ``data`` setting of an image run (shared by the runs of a compare that have
    it): the split, the fixed validation batches, the sizes, and how the task augments training
    batches (``augment(cfg)``; the ViT folds its label smoothing into mixed targets)."""

    train: ImageSet
    val: ImageSet
    val_batches: list
    image_size: int
    in_chans: int
    num_classes: int
    augment: Callable[[Any], ImageAugment]

    def batches(self, cfg: Any) -> ImageBatchSampler:
        return ImageBatchSampler.from_set(self.train, cfg.data.batch_size, seed=cfg.seed,
                                          augment=self.augment(cfg))

    def analysis_batches(self, cfg: Any, n: int) -> list:
        return self.val_batches[:n]

    def info(self, cfg: Any) -> dict:
        """Nothing yet: an image run's summary records no data fingerprint."""
        return {}

    def save(self, run_dir: Path) -> None:
        """Nothing to keep: an image set is read again from ``data.dataset``."""


def check_training_images(cfg: Any, images: ImageSet) -> None:
    """Refuse an image set that no image run can train on, before anything is written: the models
    take square images, and both tasks need at least two classes with images (a ViT classifies
    them; a DiT's FD-proxy classifier scores its samples by them)."""
    d = cfg.data
    _, height, width = images.shape
    if height != width:
        raise UserError(f"{d.dataset}: images are {height}x{width}; the models take square images "
                          "(resize them, e.g. a folder's image_size option)")
    present = np.unique(images.labels)
    if len(present) < 2:
        name = images.class_names[int(present[0])] if len(present) else "none"
        raise UserError(f"{d.dataset}: every image is of one class ({name!r}); task={cfg.task} needs "
                          "images of at least 2 classes (add another class)")


def load_image_data(cfg: Any, *, augment: Callable[[Any], ImageAugment] | None = None,
                    check: Callable[[Any, ImageSet], None] | None = None) -> ImageData:
    """Load ``data.dataset``, check it (:func:`check_training_images`, then the task's own
    ``check``), split it, and batch the validation split; training batches are augmented by
    ``augment(cfg)`` (default ``data.augment``)."""
    d = cfg.data
    full = load_images(d.dataset, **d.dataset_options)
    check_training_images(cfg, full)
    if check is not None:
        check(cfg, full)
    chans, height, _ = full.shape
    train, val = split_images(full, d.val_fraction, d.split_seed)
    if len(val) == 0:
        raise UserError(f"{d.dataset}: data.val_fraction={d.val_fraction} leaves no validation images")
    # Every validation image when they fit in val_batches batches, else evenly spaced full batches.
    few = len(val) <= d.val_batches * d.batch_size
    batches = image_validation_batches(val, batch_size=d.batch_size, n_batches=None if few else d.val_batches)
    return ImageData(train, val, batches, height, chans, full.num_classes, augment or configured_augment)


def configured_augment(cfg: Any) -> ImageAugment:
    """``data.augment`` (a module-level function, so that the data pickles for compare's workers)."""
    return cfg.data.augment


def image_analysis_batches(cfg: Any, run_dir: Path, data: str | None, n: int, *, size: int,
                           load: Callable[[Any], ImageData]) -> list:
    """``n`` batches to analyse: the run's own first validation batches (``load(cfg)``, the task's
    data loader), or evenly spaced batches of the image set ``data`` (a folder or ``.npz``, resized
    as the run's were), whose images must be what the model takes (``size`` x ``size``, its
    channels) and whose labels must be among its classes."""
    if data is None:
        return load(cfg, run_dir, True).val_batches[:n]
    images = load_images(data, **cfg.data.dataset_options)
    chans, height, width = images.shape
    if (height, width) != (size, size):
        raise UserError(f"{data}: images are {height}x{width}, the run's model takes "
                          f"{cfg.data.dataset_options or 'its own size'}; give images of that size")
    if chans != cfg.model.in_chans:
        raise UserError(f"{data}: images have {chans} channels, the run's model takes "
                          f"{cfg.model.in_chans}; give images with that many channels")
    if len(images) and int(images.labels.max()) >= cfg.model.num_classes:
        raise UserError(f"{data}: holds class {int(images.labels.max())}, the run's model knows "
                          f"{cfg.model.num_classes} classes; give images of the run's classes")
    count = min(n, max(1, len(images) // cfg.data.batch_size))
    return image_validation_batches(images, batch_size=min(cfg.data.batch_size, len(images)),
                                    n_batches=count)


def image_micro_batch(size_key: str) -> Callable[[Any], tuple[torch.Tensor, torch.Tensor]]:
    """A task's ``micro_batch``: images of ``cfg.model.<size_key>`` pixels and class labels."""
    def micro_batch(cfg: Any) -> tuple[torch.Tensor, torch.Tensor]:
        m, b = cfg.model, cfg.data.batch_size
        size = getattr(m, size_key)
        return (torch.empty(b, m.in_chans, size, size, device="meta"),
                torch.empty(b, dtype=torch.long, device="meta"))
    return micro_batch


def image_tokens_per_sample(cfg: Any) -> int:
    """The tokens an image model sees per image (its sequence, else its patches)."""
    m = cfg.model
    return m.seq_len if hasattr(m, "seq_len") else m.num_patches
