"""Batches of images: a seeded, resumable epoch sampler with augmentation, and fixed validation batches."""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from ...errors import UserError
from .augment import ImageAugment
from .imageset import ImageSet, to_model_range

__all__ = ["ImageBatchSampler", "image_validation_batches"]


def _arrays(images: np.ndarray | Tensor, labels: np.ndarray | Tensor) -> tuple[Tensor, Tensor]:
    x = torch.as_tensor(np.ascontiguousarray(images) if isinstance(images, np.ndarray) else images)
    y = torch.as_tensor(np.asarray(labels) if isinstance(labels, np.ndarray) else labels)
    if x.ndim != 4:
        raise UserError(f"images must be N x C x H x W, got shape {tuple(x.shape)}")
    if x.dtype != torch.uint8 and not x.is_floating_point():
        raise UserError(f"images must be uint8 (0..255) or float (0..1), got {x.dtype}")
    if y.shape != (len(x),) or y.is_floating_point() or y.dtype == torch.bool:
        raise UserError(f"labels must be one integer per image, got {y.dtype} {tuple(y.shape)} for "
                          f"{len(x)} images")
    return x, y.long()


class ImageBatchSampler:
    """Epochs of shuffled images from the sampler's own generator seeded with ``seed``; a batch running
    past an epoch's end is completed from the next, and :meth:`load_state_dict` resumes exactly.
    ``num_classes`` (default ``max(labels) + 1``) sizes the soft targets of mixup and cutmix."""

    def __init__(self, images: np.ndarray | Tensor, labels: np.ndarray | Tensor, batch_size: int,
                 seed: int = 0, *, augment: ImageAugment | None = None,
                 num_classes: int | None = None) -> None:
        self.images, self.labels = _arrays(images, labels)
        if batch_size < 1:
            raise UserError(f"batch_size must be positive, got {batch_size}")
        if len(self.images) == 0:
            raise UserError("the training image set is empty")
        self.batch_size, self.seed, self.augment = batch_size, seed, augment
        self.num_classes = int(self.labels.max()) + 1 if num_classes is None else int(num_classes)
        if int(self.labels.max()) >= self.num_classes or int(self.labels.min()) < 0:
            raise UserError(f"labels must lie in [0, {self.num_classes}); pass the right num_classes")
        self.generator = torch.Generator().manual_seed(seed)
        self.perm = torch.zeros(0, dtype=torch.int64)
        self.pos = 0
        self.epoch = 0
        self.batches_drawn = 0

    @classmethod
    def from_set(cls, images: ImageSet, batch_size: int, seed: int = 0, *,
                 augment: ImageAugment | None = None) -> ImageBatchSampler:
        return cls(images.images, images.labels, batch_size, seed, augment=augment,
                   num_classes=images.num_classes)

    def _indices(self) -> Tensor:
        parts, need = [], self.batch_size
        while need > 0:
            if self.pos >= len(self.perm):
                self.perm = torch.randperm(len(self.images), generator=self.generator)
                self.pos = 0
                self.epoch += 1
            take = self.perm[self.pos:self.pos + need]
            parts.append(take)
            self.pos += len(take)
            need -= len(take)
        return torch.cat(parts)

    def next_batch(self) -> tuple[Tensor, Tensor]:
        """The next ``(x, y)``: x float32 ``(B, C, H, W)`` in [-1, 1], y int64 ``(B,)`` or soft targets."""
        index = self._indices()
        x, y = to_model_range(self.images[index]), self.labels[index]
        if self.augment is not None:
            x, y = self.augment(x, y, self.num_classes, self.generator)
        self.batches_drawn += 1
        return x.contiguous(), y.contiguous()

    def __iter__(self) -> ImageBatchSampler:
        return self

    def __next__(self) -> tuple[Tensor, Tensor]:
        return self.next_batch()

    def state_dict(self) -> dict:
        return {"generator": self.generator.get_state(), "perm": self.perm.clone(), "pos": self.pos,
                "epoch": self.epoch, "batches_drawn": self.batches_drawn, "seed": self.seed,
                "batch_size": self.batch_size, "n_images": len(self.images)}

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``; refuses a state drawn for other data or another batch size."""
        for key, mine in (("batch_size", self.batch_size), ("n_images", len(self.images))):
            if key in state and int(state[key]) != mine:
                raise UserError(f"sampler state was saved with {key}={int(state[key])}, this run has "
                                  f"{mine}; resume with the same images and batch_size")
        try:
            self.generator.set_state(state["generator"])
            perm = torch.as_tensor(state["perm"], dtype=torch.int64).clone()
        except (KeyError, RuntimeError, TypeError) as exc:
            raise UserError(f"image sampler state is incomplete or invalid: {exc}") from None
        self.perm, self.pos = perm, int(state.get("pos", len(perm)))
        self.epoch = int(state.get("epoch", 0))
        self.batches_drawn = int(state.get("batches_drawn", 0))
        self.seed = int(state.get("seed", self.seed))


def image_validation_batches(images: np.ndarray | Tensor | ImageSet,
                             labels: np.ndarray | Tensor | None = None, batch_size: int = 64,
                             n_batches: int | None = None) -> list[tuple[Tensor, Tensor]]:
    """Fixed ``(x, y)`` validation batches, unaugmented: every image in order when ``n_batches=None`` (the
    last batch may be smaller), else ``n_batches`` full batches of evenly spaced images (as many as fit)."""
    if isinstance(images, ImageSet):
        images, labels = images.images, images.labels
    if labels is None:
        raise UserError("image_validation_batches needs labels (or an ImageSet)")
    x, y = _arrays(images, labels)
    if batch_size < 1 or (n_batches is not None and n_batches < 1):
        raise UserError(f"batch_size and n_batches must be positive, got {batch_size} and {n_batches}")
    if n_batches is None:
        index = torch.arange(len(x))
    else:
        n_batches = min(n_batches, len(x) // batch_size)
        if n_batches == 0:
            raise UserError(f"validation set has {len(x)} images, fewer than batch_size={batch_size}")
        wanted = n_batches * batch_size
        index = torch.arange(wanted) * len(x) // wanted
    return [(to_model_range(x[part]).contiguous(), y[part].contiguous())
            for part in index.split(batch_size)]
