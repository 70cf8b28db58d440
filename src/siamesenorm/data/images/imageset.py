"""The :class:`ImageSet` record every image loader returns, its fingerprint, and the pixel convention:
uint8 is 0..255, float 0..1; models see :func:`to_model_range`, float32 in [-1, 1]."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from ...errors import UserError

__all__ = ["ImageSet", "image_fingerprint", "to_model_range"]


@dataclass
class ImageSet:
    """Labelled images: ``images`` uint8 or float32 ``(N, C, H, W)``, ``labels`` int64 ``(N,)``; ``meta``
    is the fingerprint (:func:`image_fingerprint`), plus ``split`` for a part of a split."""

    images: np.ndarray
    labels: np.ndarray
    num_classes: int
    class_names: list[str]
    meta: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.images.ndim != 4:
            raise UserError(f"images must be N x C x H x W, got shape {self.images.shape}")
        if not (self.images.dtype == np.uint8 or np.issubdtype(self.images.dtype, np.floating)):
            raise UserError(f"images must be uint8 or float, got {self.images.dtype}")
        if self.labels.shape != (len(self.images),):
            raise UserError(f"{len(self.images)} images but labels of shape {self.labels.shape}")
        if len(self.class_names) != self.num_classes:
            raise UserError(f"{len(self.class_names)} class names for {self.num_classes} classes")
        if len(self.labels) and (self.labels.min() < 0 or self.labels.max() >= self.num_classes):
            raise UserError(f"labels must lie in [0, {self.num_classes}), got "
                              f"{self.labels.min()}..{self.labels.max()}")

    def __len__(self) -> int:
        return len(self.images)

    @property
    def shape(self) -> tuple[int, int, int]:
        _, c, h, w = self.images.shape
        return int(c), int(h), int(w)

    @property
    def fingerprint(self) -> str:
        """A short hex digest of ``meta``'s identity fields: pixels, labels, shape, dtype, classes."""
        keys = ("sha256", "labels_sha256", "shape", "dtype", "count", "num_classes")
        return hashlib.sha256(repr([self.meta.get(k) for k in keys]).encode()).hexdigest()[:16]

    def subset(self, indices: np.ndarray, **meta: Any) -> ImageSet:
        """The images at ``indices`` (in that order), with a fresh fingerprint plus ``meta``."""
        images = np.ascontiguousarray(self.images[indices])
        labels = np.ascontiguousarray(self.labels[indices])
        options = {k: v for k, v in self.meta.items() if k not in _IDENTITY}
        fp = image_fingerprint(self.meta.get("source", "?"), images, labels, self.num_classes)
        return ImageSet(images, labels, self.num_classes, list(self.class_names),
                        {**options, **fp, **meta})


_IDENTITY = ("count", "shape", "dtype", "sha256", "labels_sha256", "num_classes")


def image_fingerprint(source: str, images: np.ndarray, labels: np.ndarray, num_classes: int) -> dict:
    pixels = np.ascontiguousarray(images)
    return {"source": source, "count": int(len(pixels)), "shape": [int(s) for s in pixels.shape[1:]],
            "dtype": str(pixels.dtype), "sha256": hashlib.sha256(pixels.tobytes()).hexdigest(),
            "labels_sha256": hashlib.sha256(np.ascontiguousarray(labels, np.int64).tobytes()).hexdigest(),
            "num_classes": int(num_classes)}


def to_model_range(images: np.ndarray | Tensor) -> Tensor:
    """Images (uint8 0..255 or float 0..1) as a float32 tensor in [-1, 1], where the models work."""
    if isinstance(images, np.ndarray):
        images = torch.from_numpy(np.ascontiguousarray(images))
    if images.dtype == torch.uint8:
        return images.float() / 127.5 - 1.0
    if not images.is_floating_point():
        raise UserError(f"images must be uint8 or float, got {images.dtype}")
    return images.float() * 2.0 - 1.0
