"""A fixed, stratified train/validation split of an :class:`ImageSet`."""

from __future__ import annotations

import numpy as np

from ...errors import UserError
from .imageset import ImageSet

__all__ = ["split_images", "stratified_split_indices"]


def stratified_split_indices(labels: np.ndarray, val_fraction: float = 0.1,
                             seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """``(train, val)`` sorted index arrays: class ``c`` gives ``round(n_c * val_fraction)`` images (at most
    ``n_c - 1``) to validation, chosen by ``default_rng([seed, c])`` alone."""
    if not 0 < val_fraction < 1:
        raise UserError(f"val_fraction must be in (0, 1), got {val_fraction}")
    labels = np.asarray(labels)
    val_parts = []
    for c in np.unique(labels):
        members = np.flatnonzero(labels == c)
        n_val = min(int(round(len(members) * val_fraction)), len(members) - 1)
        if n_val > 0:
            rng = np.random.default_rng([int(seed), int(c)])
            val_parts.append(rng.permutation(members)[:n_val])
    val = np.sort(np.concatenate(val_parts)) if val_parts else np.zeros(0, dtype=np.int64)
    if len(val) == 0:
        raise UserError(f"val_fraction={val_fraction} leaves no validation image among {len(labels)}; "
                          "raise val_fraction or use more images")
    is_val = np.zeros(len(labels), dtype=bool)
    is_val[val] = True
    return np.flatnonzero(~is_val), val


def split_images(images: ImageSet, val_fraction: float = 0.1, seed: int = 0) -> tuple[ImageSet, ImageSet]:
    """``(train, val)`` sets of :func:`stratified_split_indices` (own fingerprints, ``meta["split"]``)."""
    train_idx, val_idx = stratified_split_indices(images.labels, val_fraction, seed)
    split = {"val_fraction": float(val_fraction), "seed": int(seed),
             "parent_sha256": images.meta.get("sha256")}
    return (images.subset(train_idx, split={"part": "train", **split}),
            images.subset(val_idx, split={"part": "val", **split}))
